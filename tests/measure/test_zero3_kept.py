"""ZeRO-3 keeps the weights gathered in forward until their backward: those its prefetcher marked (up to
stage3_max_live_parameters) and those reused within stage3_max_reuse_distance (estimate/temporaries.py
zero3_kept_params). Measured on 2 CPU ranks with a prefetch bucket well below the model, where the
current module + prefetch alone would be far short."""
from __future__ import annotations

from pathlib import Path

import pytest
from launch import measure_worker

pytestmark = [pytest.mark.multirank, pytest.mark.deepspeed, pytest.mark.slow]

MODEL = Path(__file__).resolve().parents[2] / "benchmarks" / "oracle_model" / "config.json"  # 0.82M params
# HF's "auto" buckets for hidden 128: prefetch 14,745 elements (the model is 820,352), threshold 1,280.
ZERO3 = {"kind": "zero3", "reduce_bucket_size": 16384, "allgather_bucket_size": 16384,
         "prefetch_bucket_size": 14745, "param_persistence_threshold": 1280}


def _config(label: str, ac: str = "none", **strategy) -> dict:
    return {"label": label, "steps": 2,
            "plan": {"model": str(MODEL), "strategy": {**ZERO3, **strategy},
                     "cluster": {"nodes": 1, "gpus_per_node": 2},
                     "training": {"micro_batch": 2, "seq_len": 128, "precision": "fp32",
                                  "activation_checkpointing": ac}}}


def test_forward_leaves_the_weights_gathered_unless_both_rules_release_them(tmp_path):
    results = measure_worker([_config("default"), _config("reuse-0", max_reuse_distance=0),
                              _config("live-50k", max_live_parameters=50_000),
                              _config("both-off", max_reuse_distance=0, max_live_parameters=50_000),
                              _config("full-ac", ac="full")], tmp_path, nproc=2, timeout=600)
    forward = {label: r["comparison"]["forward"]["temporaries"] for label, r in results.items()}
    # The whole model gathered by the loss: kept by the prefetcher's marks (reuse-0), by the reuse
    # distance (live-50k), or both.
    for label in ("default", "reuse-0", "live-50k", "full-ac"):
        assert forward[label]["predicted"] == pytest.approx(forward[label]["measured"], rel=0.02), (label, forward)
    assert forward["reuse-0"]["measured"] == pytest.approx(forward["default"]["measured"], rel=0.01)
    assert forward["live-50k"]["measured"] == pytest.approx(forward["default"]["measured"], rel=0.01)
    # Neither rule: released module by module (measured 743,449 B, a fifth of the model kept).
    assert forward["both-off"]["measured"] < 0.3 * forward["default"]["measured"]
    assert forward["both-off"]["predicted"] < 0.3 * forward["default"]["predicted"]
    for label, result in results.items():
        peak = result["comparison"]["peak"]
        # Was -12% (the current module + prefetch only); with checkpointing the backward is over-estimated.
        assert -0.05 <= peak["error"] <= 0.10, (label, peak)
