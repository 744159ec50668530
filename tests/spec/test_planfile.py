"""Plan files (spec/planfile.py): YAML/JSON round trip, atomic writes, one-line errors."""
import os

import pytest

from estimate_cases import BIG, plan
from shardfit.errors import ShardfitError
from shardfit.spec.planfile import dump_plan, load_plan
from shardfit.spec.plan import LoRA


@pytest.mark.parametrize("suffix", [".yaml", ".json"])
def test_round_trip(tmp_path, suffix):
    original = plan(BIG, "zero3+offload", gpus=8, nodes=2, micro_batch=2, seq_len=4096,
                    activation_checkpointing="every-2").with_changes(
        training={"lora": LoRA(rank=8, target_modules=("q_proj", "v_proj"), base_dtype="nf4")})
    path = dump_plan(original, tmp_path / f"plan{suffix}")
    assert load_plan(path) == original
    assert [p.name for p in tmp_path.iterdir()] == [f"plan{suffix}"]  # no temp file left behind


def test_model_by_reference(tmp_path):
    path = tmp_path / "p.yaml"
    path.write_text("model: tiny-llama\nstrategy: {kind: fsdp, sharding: shard_grad_op}\n")
    loaded = load_plan(path)
    assert loaded.model.name == "tiny-llama" and loaded.strategy.label == "fsdp:shard_grad_op"


def test_atomic_write_keeps_the_old_file_on_failure(tmp_path, monkeypatch):
    path = tmp_path / "plan.yaml"
    dump_plan(plan(BIG), path)
    before = path.read_text()

    def boom(*_args):
        raise OSError("disk full")
    monkeypatch.setattr(os, "replace", boom)
    with pytest.raises(OSError):
        dump_plan(plan(BIG, "zero3"), path)
    assert path.read_text() == before
    assert [p.name for p in tmp_path.iterdir()] == ["plan.yaml"]


@pytest.mark.parametrize("text,message", [
    ("model: [unclosed\n", "not valid YAML"),
    ("", "is empty"),
    ("- a\n- b\n", "must be a mapping"),
    ("strategy: {kind: zero2}\n", "has no 'model'"),
    ("model: tiny-llama\nstrategy: {kind: zero2, offload_optimizer: nvme}\n", "NVMe"),
    ("model: tiny-llama\ntraining: {micro_batch: two}\n", "must be a number"),
])
def test_errors_are_one_line(tmp_path, text, message):
    path = tmp_path / "plan.yaml"
    path.write_text(text)
    with pytest.raises(ShardfitError, match=message) as info:
        load_plan(path)
    assert "\n" not in str(info.value)


def test_missing_file_and_folder(tmp_path):
    with pytest.raises(ShardfitError, match="does not exist"):
        load_plan(tmp_path / "nope.yaml")
    with pytest.raises(ShardfitError, match="does not exist"):
        dump_plan(plan(BIG), tmp_path / "no" / "such" / "plan.yaml")
