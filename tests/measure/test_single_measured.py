"""Strategy single measured against predicted on real one-process CPU runs (torchrun with one rank,
as `shardfit train` launches it): tiny-llama and tiny-gpt2 × {fp32, bf16} × {AC none, full}, every
category of every phase within 5% (1% of the phase total for a small term) and the peak within 5%.

What the estimator still misses is listed in KNOWN_GAPS with its mechanism, strict both ways as in
test_engine_matrix.py: all of it is activation checkpointing's backward (and, for GPT-2, forward)
working set, the same gaps DDP has there; one device has no collective whose timing moves a peak.
"""
from __future__ import annotations

import pytest

from matrix_gaps import _BACKWARD
from test_engine_matrix import SMALL_TERM, TERM_TOLERANCE, _check_categories, _plan, _result, _run

pytestmark = pytest.mark.multirank

PEAK_TOLERANCE = 0.05
_GPT2_AC_FORWARD = ("GPT-2 checkpointed block in forward: the estimator takes the block's backward working set plus "
                    "attention's s^2 scores (math SDPA under dropout), but in forward they never coexist, and the peak "
                    "is in the MLP, where NewGELU builds three b*s*I temporaries next to c_fc's output")
KNOWN_GAPS = {
    "tiny-llama/single/fp32/ac-full": dict.fromkeys(("backward/grads", "backward/activations"), _BACKWARD),
    "tiny-llama/single/bf16/ac-full": dict.fromkeys(("backward/grads", "backward/activations", "backward/temporaries"),
                                                    _BACKWARD),
    "tiny-gpt2/single/fp32/ac-full": {"forward/temporaries": _GPT2_AC_FORWARD, **dict.fromkeys(
        ("backward/grads", "backward/activations", "backward/temporaries"), _BACKWARD)},
    "tiny-gpt2/single/bf16/ac-full": {"forward/temporaries": _GPT2_AC_FORWARD, **dict.fromkeys(
        ("backward/grads", "backward/activations", "backward/temporaries"), _BACKWARD)},
}
CONFIGS = [{"label": f"{model}/single/{precision}/ac-{ac}", "plan": _plan(model, "single", precision, ac, gpus=1),
            "steps": 2}
           for model in ("tiny-llama", "tiny-gpt2") for precision in ("fp32", "bf16") for ac in ("none", "full")]


@pytest.fixture(scope="module")
def single_results(tmp_path_factory):
    return _run(tmp_path_factory, "single", CONFIGS, nproc=1)


@pytest.mark.parametrize("label", [c["label"] for c in CONFIGS])
def test_single_categories_and_no_reducer_buckets(single_results, label):
    result = _result(single_results, label)
    _check_categories(result)  # fp32 params (4 B) and AdamW moments (8 B) per parameter, unsharded
    from shardfit.spec.models import model_spec_for

    n = model_spec_for(result["plan"]["model"]).n_params
    # DDP's reducer holds a flat fp32 copy of every gradient (4n B) from wrap time on; one device has none.
    assert result["measured"]["load"].get("temporaries", 0) < 0.05 * 4 * n, result["measured"]["load"]
    # Gradients exist only after backward: set_to_none zero_grad frees them between steps.
    assert result["measured"]["load"].get("grads", 0) == 0
    assert result["measured"]["optimizer"]["grads"] == pytest.approx(4 * n, rel=0.02)


def test_gap_table_names_real_configurations():
    assert set(KNOWN_GAPS) <= {c["label"] for c in CONFIGS}


@pytest.mark.parametrize("label", [c["label"] for c in CONFIGS])
def test_single_peak_within_5_percent(single_results, label):
    peak = _result(single_results, label)["comparison"]["peak"]
    assert abs(peak["error"]) <= PEAK_TOLERANCE, peak
    assert peak["measured_phase"] == peak["predicted_phase"], peak


@pytest.mark.parametrize("label", [c["label"] for c in CONFIGS])
def test_single_estimate_within_tolerance(single_results, label):
    from shardfit.measure.compare import off_terms

    comparison = _result(single_results, label)["comparison"]
    off = {term: line for term, line in off_terms(comparison, TERM_TOLERANCE, SMALL_TERM).items() if term != "peak/*"}
    known = KNOWN_GAPS.get(label, {})
    unexpected = [f"{term}: {line}" for term, line in off.items() if term not in known]
    assert not unexpected, f"{label}: estimator off by more than tolerance:\n  " + "\n  ".join(unexpected)
    closed = sorted(set(known) - set(off))
    assert not closed, f"{label}: {closed} now within tolerance: remove them from KNOWN_GAPS"
    if off:
        pytest.xfail("known estimator gaps: " + "; ".join(f"{term}: {off[term]}" for term in off))
