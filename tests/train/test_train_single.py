"""`shardfit train --strategy single` as a user runs it: one rank under torchrun (no --nproc needed),
DCP checkpoints, and a resume that continues bit for bit."""
from __future__ import annotations

import json

import pytest
from launch import shardfit

pytestmark = [pytest.mark.multirank, pytest.mark.slow]


def _metrics(out):
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_train_single_runs_one_rank_and_resumes_bit_identically(tmp_path):
    from safetensors.torch import load_file

    out, resumed = tmp_path / "run", tmp_path / "resumed"
    shardfit("train", "--strategy", "single", "--steps", "6", "--save-every", "3", "--eval-every", "3",
             "--out", str(out), "--no-progress", "--export", str(out / "hf"), timeout=300)
    step = out / "checkpoints" / "step-3"
    manifest = json.loads((step / "manifest.json").read_text())
    assert (manifest["engine"], manifest["world_size"], manifest["format"]) == ("single", 1, "dcp")
    assert sorted(p.name for p in (step / "rng").iterdir()) == ["rank-0.pt"]  # one process
    records = _metrics(out)
    assert [r["step"] for r in records] == list(range(1, 7)) and records[-1]["loss"] < records[0]["loss"]
    # No plan file, no --nproc: the checkpoint's own plan says single, so one rank again.
    result = shardfit("train", "--out", str(resumed), "--no-progress", "--resume", str(step),
                      "--export", str(resumed / "hf"), timeout=300)
    assert "resumed from" in result.stdout
    original = {r["step"]: r for r in records}
    again = _metrics(resumed)
    assert [r["step"] for r in again] == [4, 5, 6]
    for record in again:  # exact equality: bit for bit
        assert (record["loss"], record["grad_norm"]) == (original[record["step"]]["loss"],
                                                         original[record["step"]]["grad_norm"])
    assert again[-1]["val_loss"] == original[6]["val_loss"]
    first, second = load_file(str(out / "hf" / "model.safetensors")), load_file(str(resumed / "hf" / "model.safetensors"))
    assert first.keys() == second.keys() and all(first[name].equal(second[name]) for name in first)


def test_single_on_two_ranks_is_one_line():
    result = shardfit("train", "--strategy", "single", "--nproc", "2", check=False)
    assert result.returncode == 2 and "strategy single runs on one device" in result.stderr
    assert "--nproc 1" in result.stderr and len(result.stderr.strip().splitlines()) == 1
    result = shardfit("train", "--strategy", "single+offload", check=False)
    assert result.returncode == 2 and "no options and no offload" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1
