"""A key written twice in one mapping of a plan file is an error, at any depth, in YAML and JSON:
both formats would otherwise keep the last value without a word. One line names the file, the
line of the repeat and the line of the first one. Every command that reads a plan file refuses it."""
import json
from types import SimpleNamespace

import pytest

from shardfit.cli import main
from shardfit.errors import ShardfitError
from shardfit.spec.planfile import load_plan, read_plan_data

NESTED_YAML = """\
model: tiny-llama
training:
  micro_batch: 2
  seq_len: 64
  grad_accum: 1
  precision: fp32
  micro_batch: 4
"""


def error(path) -> str:
    with pytest.raises(ShardfitError) as info:
        read_plan_data(path)
    message = str(info.value)
    assert "\n" not in message
    return message


def test_nested_yaml_duplicate_names_key_lines_and_file(tmp_path):
    path = tmp_path / "plan.yaml"
    path.write_text(NESTED_YAML)
    assert error(path) == f"{path} line 7: duplicate key 'micro_batch' (also at line 3): keep one"


@pytest.mark.parametrize("text,key,line,first", [
    ("model: tiny-llama\nstrategy: {kind: ddp}\nmodel: tiny-gpt2\n", "model", 3, 1),  # top level
    ("model: tiny-llama\nstrategy: {kind: zero2,\n  kind: zero3}\n", "kind", 3, 2),  # flow mapping
    ("model:\n  name: m\n  family: llama\n  layers:\n    - {a: 1}\n    - a: 1\n      b: 2\n      a: 3\n", "a", 8, 6),
    ("model: tiny-llama\n'seq': 1\nseq: 2\n", "seq", 3, 2),  # quoting does not make another key
])
def test_yaml_duplicates_at_any_depth(tmp_path, text, key, line, first):
    path = tmp_path / "p.yaml"
    path.write_text(text)
    assert error(path).endswith(f"line {line}: duplicate key '{key}' (also at line {first}): keep one")


def test_json_duplicates_name_their_lines(tmp_path):
    path = tmp_path / "plan.json"
    path.write_text('{\n  "model": "tiny-llama",\n  "training": {"micro_batch": 2,\n'
                    '    "seq_len": 64, "x": {"a": 1, "b": {"a": 2}},\n    "micro_batch": 4}\n}\n')
    assert error(path) == f"{path} line 5: duplicate key 'micro_batch' (also at line 3): keep one"
    path.write_text('{"model": "tiny-llama", "model": "tiny-gpt2"}')
    assert error(path) == f"{path} line 1: duplicate key 'model' (also earlier on the same line): keep one"


def test_the_same_key_in_different_mappings_and_merge_overrides_are_fine(tmp_path):
    path = tmp_path / "p.yaml"
    path.write_text("model: tiny-llama\ntraining: &t {micro_batch: 2, seq_len: 64}\n"
                    "schedule: {steps: 2}\ncluster: {nodes: 1}\nstrategy: {kind: ddp}\n"
                    "data: {path: null}\n")
    assert read_plan_data(path)["training"]["seq_len"] == 64
    merged = tmp_path / "merged.yaml"
    merged.write_text("model: tiny-llama\ntraining:\n  <<: {micro_batch: 1, seq_len: 64}\n  micro_batch: 4\n")
    assert read_plan_data(merged)["training"] == {"micro_batch": 4, "seq_len": 64}
    as_json = tmp_path / "p.json"
    as_json.write_text(json.dumps({"model": "tiny-llama", "strategy": {"kind": "zero2", "offload": {"kind": "cpu"}}}))
    assert read_plan_data(as_json)["strategy"] == {"kind": "zero2", "offload": {"kind": "cpu"}}
    as_json.write_text(json.dumps({"model": "tiny-llama", "training": {"seq_len": 64}}, indent=2))
    assert load_plan(as_json).training.seq_len == 64  # an ordinary plan still loads


def test_still_a_safe_loader(tmp_path):
    marker = tmp_path / "pwned"
    path = tmp_path / "evil.yaml"
    path.write_text(f"model: tiny-llama\ntraining: !!python/object/apply:os.system ['touch {marker}']\n")
    assert "not valid YAML" in error(path) and not marker.exists()


def test_every_command_that_reads_a_plan_refuses_it(tmp_path, capsys, monkeypatch):
    path = tmp_path / "plan.yaml"
    path.write_text(NESTED_YAML)
    expected = f"{path} line 7: duplicate key 'micro_batch' (also at line 3): keep one"
    for argv in (["plan", path], ["emit", path, "-f", "torchrun"], ["bench", path, "--out", tmp_path / "b"]):
        rc = main([str(a) for a in argv])
        assert rc == 2 and capsys.readouterr().err.strip() == f"shardfit: error: {expected}", argv
    # train and profile read the plan before they start torchrun: their readers, directly
    from shardfit.commands.profile import build_plan_dict
    from shardfit.train.launch import read_plan_dict

    with pytest.raises(ShardfitError, match="duplicate key 'micro_batch'"):
        read_plan_dict(str(path))
    with pytest.raises(ShardfitError, match="duplicate key 'micro_batch'"):
        build_plan_dict(SimpleNamespace(plan=str(path), model=None, strategy=None, bucket=None))
