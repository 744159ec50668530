"""FSDP1's flat shards (estimate/flat_shards.py): the torch-free layout against a brute force over
every rank, and against the views shardfit's real FSDP1 engine hands its optimizer."""
from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

import launch
from shardfit.estimate.flat_shards import fsdp1_step_scratch, local_views
from shardfit.spec.models import load_model_spec
from shardfit.spec.tiny import tiny_config

HERE = Path(__file__).parent


def _brute_force(order, shard, param_bytes) -> int:
    best = 0
    for rank in range(shard):
        # A parameter with no elements on this rank has no gradient there: the optimizer skips it.
        views = [n for n in local_views(order, shard, param_bytes, rank) if n]
        best = max([best] + [2 * n + (views[i - 1] if i else 0) for i, n in enumerate(views)])
    return best


def test_the_scratch_is_the_worst_rank_of_every_view():
    generator = random.Random(0)
    for _ in range(300):
        order = []
        for _ in range(generator.randint(1, 5)):
            unit = generator.choice(("root", "block"))
            sizes = tuple(generator.choice((1, 3, 64, 257, 4096, 20000)) for _ in range(generator.randint(1, 6)))
            order.append((unit, sizes, generator.randint(1, 4) if unit == "block" else 1))
        order = tuple(order)
        for shard in (1, 2, 3, 8, 64):
            for param_bytes in (2, 4):
                largest, previous = fsdp1_step_scratch(order, shard, param_bytes)
                assert 2 * largest + previous == _brute_force(order, shard, param_bytes), (order, shard, param_bytes)


def test_one_rank_sees_whole_parameters():
    order = (("root", (100, 7), 1), ("block", (30, 50), 3), ("root", (9,), 1))
    assert local_views(order, 1, 4, 0) == [100, 7, 30, 50, 30, 50, 30, 50, 9]
    # Two ranks, fp32 (16-byte alignment: 4 elements). Root: 100 at 0, 7 at 100, 9 at 108 (after one
    # padding element), 117 padded to 118: chunks of 59. A block: 30 at 0, 50 at 32: chunks of 41.
    assert local_views(order, 2, 4, 0) == [59, 0, 30, 9, 30, 9, 30, 9, 0]
    assert local_views(order, 2, 4, 1) == [41, 7, 0, 41, 0, 41, 0, 41, 9]
    # Rank 1 skips each block's empty first view, so one block's 41 sits beside the previous block's
    # 41 (2*41 + 41), above rank 0's whole 59 (2*59).
    assert fsdp1_step_scratch(order, 2, 4) == (41, 41)


ARCHS = ("qwen3", "gemma3_text", "bloom", "opt")


@pytest.mark.multirank
@pytest.mark.slow
def test_layout_equals_the_real_fsdp1_engines_views(tmp_path, monkeypatch):
    folders = []
    for arch in ARCHS:
        (tmp_path / arch).mkdir()
        (tmp_path / arch / "config.json").write_text(json.dumps(tiny_config(arch)))
        folders.append(str(tmp_path / arch))
    monkeypatch.setenv("SHARDFIT_CACHE_DIR", str(tmp_path / "cache"))
    env = launch.test_env(SHARDFIT_CACHE_DIR=str(tmp_path / "cache"))
    out = tmp_path / "views.json"
    launch.torchrun([str(HERE / "fsdp1_views_script.py"), str(out), *folders], nproc=2, timeout=300, env=env)
    real = json.loads(out.read_text())
    for folder in folders:
        spec = load_model_spec(folder)
        assert spec.param_order, folder
        for precision, param_bytes in (("fp32", 4), ("bf16", 2)):
            every = real[f"{folder}|{precision}"]
            assert [local_views(spec.param_order, 2, param_bytes, rank) for rank in range(2)] == every, \
                (Path(folder).name, precision)
