"""`shardfit train` on architectures outside the hand-written families: the config builds, FSDP2 wraps
and checkpoints the derived blocks, and the loss falls."""
from __future__ import annotations

import json
import os

import pytest
from launch import shardfit
from shardfit.spec.tiny import tiny_config

pytestmark = [pytest.mark.multirank, pytest.mark.slow]


@pytest.mark.parametrize("model_type,ac", [("qwen3", "full"), ("olmo2", "selective")])
def test_fsdp2_with_checkpointing_trains_a_derived_model(model_type, ac, tmp_path):
    model = tmp_path / model_type
    model.mkdir()
    (model / "config.json").write_text(json.dumps(tiny_config(model_type)))
    out = tmp_path / "run"
    env = {**os.environ, "SHARDFIT_CACHE_DIR": str(tmp_path / "cache")}
    shardfit("train", "--model", str(model), "--strategy", "fsdp2", "--nproc", "2", "--steps", "8", "--seq", "64",
             "--micro-batch", "2", "--ac", ac, "--lr", "3e-3", "--no-progress", "--out", str(out),
             timeout=400, env=env)
    losses = [json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().splitlines() if "loss" in line]
    assert len(losses) == 8 and all(loss == loss for loss in losses)
    assert losses[-1] < losses[0]
