"""An out-of-memory error inside `shardfit train` explains itself once: the phase, what grew by
category, and the smallest changes that fit (flags, plan fields, predicted peak), also in the run folder."""
from __future__ import annotations

import json

import pytest
from launch import shardfit

from shardfit.measure.oom import diagnose, format_diagnosis, phase_from_traceback, untracked_oom
from shardfit.measure.report import RankReport

BUDGET = 7 * 2**20


@pytest.mark.multirank
def test_train_oom_prints_the_worst_ranks_diagnosis_once(tmp_path):
    out = tmp_path / "run"
    result = shardfit("train", "--memory-budget", "7MiB", "--steps", "3", "--out", str(out), timeout=240, check=False)
    assert result.returncode != 0
    err = result.stderr
    assert "train fsdp2" not in err and "%|" not in err  # stderr is no terminal here: no live bar to interleave
    assert err.count("OUT OF MEMORY") == 1, err  # two ranks ran out: one diagnosis
    assert "rerun with --autopilot, or see" not in err  # the old per-rank line is gone
    assert "OUT OF MEMORY on rank 0 in forward" in err and "grew most in forward: activations" in err, err
    diagnosis = json.loads((out / "oom" / "rank-0.json").read_text())
    assert diagnosis["phase"] == "forward" and diagnosis["growing"] == "activations"
    assert diagnosis["limit_bytes"] == BUDGET and diagnosis["live"]["activations"] > diagnosis["live"]["params"]
    fitting = [f for f in diagnosis["fixes"] if f["fits"]]
    assert fitting and all(f["peak_bytes"] <= BUDGET for f in fitting), diagnosis["fixes"]
    assert any("--ac full" in f["flags"] and "training.activation_checkpointing: full" in f["fields"] for f in fitting)
    written = (out / "oom-diagnosis.txt").read_text()
    assert written.splitlines()[0] in err and "fits (peak" in written and "--ac full" in written
    assert f"also in {out / 'oom-diagnosis.txt'}" in err.splitlines()[-1]


def test_an_untracked_oom_names_its_phase_from_the_traceback():
    import torch

    def step():
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    try:
        step()
    except torch.OutOfMemoryError as exc:
        info = untracked_oom(exc, step=4)
    assert info["phase"] == "optimizer" and info["step"] == 4 and info["message"].startswith("CUDA out of memory")
    from shardfit.measure.worker import load_plan

    plan = load_plan({"model": "tiny-llama", "strategy": {"kind": "ddp"}, "cluster": {"gpus_per_node": 2},
                      "training": {"micro_batch": 4, "seq_len": 256, "precision": "fp32"}})
    diagnosis = diagnose(RankReport(rank=1, world_size=2, device="cuda", oom=dict(info, budget=2**20)), plan)
    text = format_diagnosis(diagnosis)
    assert "OUT OF MEMORY on rank 1 in optimizer (step 4)" in text and "not tracked" in text
    assert "(0 B)" not in text and "smallest changes (estimator)" in text and "[--ac full | plan:" in text, text
