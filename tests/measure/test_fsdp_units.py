"""FSDP2 with the embedding and head as units of their own (torchtitan's wrapping, spec/fsdp_units.py),
measured against predicted on real 2-rank CPU runs (gloo), next to the same plans with both in the root
unit. Tolerances as in the engine matrix: each phase/category term within 5% (or 1% of its phase when
small), the peak within 5%. A term that misses is listed below with its mechanism, strictly both ways."""
from __future__ import annotations


import pytest

from launch import measure_worker, test_env as launch_env

pytestmark = pytest.mark.multirank

SEQ, BATCH = 64, 2
LORA = {"rank": 8, "base_dtype": "fp32", "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj"]}


def _plan(units: str, precision: str, ac: str, model: str = "tiny-llama", reshard: bool = True, lora: bool = False):
    plan = {"model": model, "strategy": {"kind": "fsdp2", "embedding_units": units, "reshard_after_forward": reshard},
            "cluster": {"nodes": 1, "gpus_per_node": 2},
            "training": {"micro_batch": BATCH, "seq_len": SEQ, "precision": precision, "activation_checkpointing": ac}}
    if lora:
        plan["training"]["lora"] = dict(LORA)
    return plan


SEPARATE = {
    "separate/fp32/none": _plan("separate", "fp32", "none"),
    "separate/fp32/full": _plan("separate", "fp32", "full"),
    "separate/bf16/none": _plan("separate", "bf16", "none"),
    "separate/bf16/full": _plan("separate", "bf16", "full"),
    "separate/no_reshard/fp32/none": _plan("separate", "fp32", "none", reshard=False),
    "separate/mistral/bf16/none": _plan("separate", "bf16", "none", model="tiny-mistral"),
    "separate/lora/fp32/none": _plan("separate", "fp32", "none", lora=True),
}
ROOT = {"root/fp32/none": _plan("root", "fp32", "none"), "root/bf16/none": _plan("root", "bf16", "none"),
        "root/fp32/full": _plan("root", "fp32", "full")}
TIED = {"auto/tied-gpt2/fp32/none": _plan("auto", "fp32", "none", model="tiny-gpt2")}

_BACKWARD = ("FSDP backward peak split, as with the root unit (tests/measure/matrix_gaps.py _FSDP_BACKWARD): with "
             "checkpointing the real peak falls inside a recomputed block, between the estimator's instants; "
             "without it (tiny-mistral) at backward's start, a near-tie with the instant the estimator picks")
_LORA_FORWARD = ("LoRA forward (matrix_gaps.py _LORA_FORWARD): the adapter path keeps one more b*s*h fp32 tensor "
                 "per block than the block model lists; with the head out of the root the forward peak moves from "
                 "the loss into the last block, where it shows")
_STEP = ("optimizer-step scratch (matrix_gaps.py _STEP): 6 KiB above the estimator's single-tensor AdamW scratch, "
         "the same miss with the root unit: the step's scratch does not depend on the wrapping")
GAPS = {
    "separate/mistral/bf16/none": {"backward/grads": _BACKWARD, "backward/activations": _BACKWARD,
                                   "backward/temporaries": _BACKWARD, "optimizer/temporaries": _STEP},
    "separate/lora/fp32/none": {"forward/activations": _LORA_FORWARD, "forward/temporaries": _LORA_FORWARD},
}


# Terms whose measured value moves between identical runs (neither asserted): the LoRA plan's backward
# peak with or without the next unit's prefetched all-gather out on the worst rank (903064 B of
# temporaries and a -6.1% peak once in a full suite, 2026-12-05; within 1% alone), as in
# matrix_gaps.VARIES for the root-unit LoRA row. Its optimizer step's temporaries too: 16,536 B measured
# against 2,056 predicted once in a full suite (2026-12-05, 3 workers on 2 cores; 2,056 alone): a
# 14,480-B allocation alive at the step's peak in one run only, 1% of that phase.
VARIES = {"separate/lora/fp32/none": {"backward/temporaries", "peak/*", "optimizer/temporaries"}}
# Under full checkpointing FSDP2's backward peak lands at a different recompute instant run to run
# (matrix_gaps.VARIES_FSDP2_AC; _BACKWARD above): the split between grads, activations and temporaries
# is not asserted, the peak is. Seen in full suites here: separate/fp32/full forward and backward splits
# (2026-12-05, once each) and separate/bf16/full backward grads 225,792 vs 318,336 predicted, activations
# 400,912 vs 379,904 (once; the listed gaps within tolerance in the runs before).
_AC_SPLIT = {"backward/grads", "backward/activations", "backward/temporaries"}
VARIES.update({"separate/fp32/full": _AC_SPLIT | {"forward/activations", "forward/temporaries"},
               "separate/bf16/full": _AC_SPLIT,
               # Without checkpointing, whether the next unit's prefetched all-gather is out at the worst rank's
               # backward peak: 411,784 B of temporaries against 368,768 predicted once in a full suite (2026-12-05).
               "separate/bf16/none": {"backward/temporaries"}})


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    configs = [{"label": label, "plan": plan, "steps": 2} for label, plan in {**SEPARATE, **ROOT, **TIED}.items()]
    return measure_worker(configs, tmp_path_factory.mktemp("fsdp-units"), nproc=2, timeout=600, env=launch_env())


def _peak(row) -> int:
    return row["comparison"]["peak"]["measured"]


@pytest.mark.parametrize("label", sorted(SEPARATE))
def test_separate_units_measured_as_predicted(results, label):
    from shardfit.measure.compare import off_terms

    comparison = results[label]["comparison"]
    varies = VARIES.get(label, set())
    off = {term: line for term, line in off_terms(comparison, 0.05, 0.01, 0.05).items() if term not in varies}
    known = GAPS.get(label, {})
    assert "peak/*" not in off, f"{label}: peak {off.get('peak/*')}"
    unexpected = {term: line for term, line in off.items() if term not in known}
    assert not unexpected, f"{label}: off by more than 5%: {unexpected}"
    closed = sorted(set(known) - set(off))
    assert not closed, f"{label}: {closed} now within tolerance: remove them from GAPS"


def test_separate_units_lower_the_measured_peak(results):
    """What the root unit kept gathered: the embedding through the blocks' forward and backward, the head
    before its forward and after its backward, and its unsharded grad until the end of backward."""
    from shardfit.spec.models import load_model_spec

    spec = load_model_spec("tiny-llama")
    table = spec.vocab_size * spec.hidden_size  # elements of the embedding (and of the head)
    for precision, ac in (("fp32", "none"), ("bf16", "none"), ("fp32", "full")):
        root, separate = results[f"root/{precision}/{ac}"], results[f"separate/{precision}/{ac}"]
        saved = _peak(root) - _peak(separate)
        assert saved >= table * 2, (precision, ac, saved)  # at least one 16-bit table's worth
        # Sharding itself is unchanged: the same parameters and optimizer states at rest.
        assert root["comparison"]["load"]["params"]["measured"] == pytest.approx(
            separate["comparison"]["load"]["params"]["measured"], abs=512)
    # Forward at the loss: the embedding's gathered copy is gone (the head's all-gather buffer replaces the
    # last block's): exactly the estimator's figure.
    fwd = results["separate/bf16/none"]["comparison"]["forward"]["temporaries"]
    assert fwd["predicted"] == pytest.approx(fwd["measured"], rel=0.001)


def test_a_tied_head_stays_in_the_root(results):
    from shardfit.errors import ShardfitError
    from shardfit.spec.models import load_model_spec
    from shardfit.spec.plan import Plan, Strategy, validate_plan

    row = results["auto/tied-gpt2/fp32/none"]
    # auto on a tied model is the root wrapping: the estimate equals the root-unit estimate, and is measured
    # within the peak tolerance.
    from shardfit.estimate.estimator import estimate
    from shardfit.measure.worker import load_plan

    auto = load_plan(row["plan"])
    root = auto.with_changes(strategy={"embedding_units": "root"})
    assert estimate(auto).peak_bytes == estimate(root).peak_bytes
    assert abs(row["comparison"]["peak"]["error"]) <= 0.05
    gpt2 = load_model_spec("tiny-gpt2")
    with pytest.raises(ShardfitError, match="ties its head to the embedding"):
        validate_plan(Plan(model=gpt2, strategy=Strategy(kind="fsdp2", embedding_units="separate")))
    with pytest.raises(ShardfitError, match="FSDP2's wrapping"):
        validate_plan(Plan(model=load_model_spec("tiny-llama"), strategy=Strategy(kind="fsdp",
                                                                                    embedding_units="separate")))
