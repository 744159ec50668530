"""FSDP2 x TP for real: 4 CPU ranks (gloo) on a 2 x 2 (dp, tp) DeviceMesh, tiny-llama sharded with its
own transformers TP plan through torch's parallelize_module, then FSDP2 over dp. One torchrun launch of
the profiling harness (shardfit.measure.worker) runs two configurations.

Checked: the losses are finite, fall, and equal plain single-process torch training the same model on
the same two data-parallel batches (the TP ranks of a group read one batch); the tracker's categories
match the estimator's per-rank figures (estimate/model_parallel.py) within 5% per category, with the
one gap named below.
"""
from __future__ import annotations

import json
import math

import pytest

from launch import measure_worker, test_env as launch_env
from shardfit.spec.tiny import tiny_config

pytest.importorskip("torch")
pytestmark = [pytest.mark.multirank, pytest.mark.slow]

CATEGORIES = ("params", "grads", "optimizer", "activations", "temporaries")
TOLERANCE = 0.05
SMALL_TERM = 0.01  # a term under 1% of its phase is compared in bytes (as the engine matrix does)
STEPS = 8


def _plan(precision: str, ac: str, model: str = "tiny-llama", sp: bool = False, loss_parallel: bool = False) -> dict:
    return {"model": model, "strategy": {"kind": "fsdp2"}, "cluster": {"nodes": 1, "gpus_per_node": 4},
            "training": {"micro_batch": 2, "seq_len": 64, "precision": precision, "activation_checkpointing": ac},
            "schedule": {"lr": 0.003, "warmup_steps": 0},
            "parallelism": {"tp": 2, "loss_parallel": loss_parallel, "sequence_parallel": sp}}


CONFIGS = [{"label": "fsdp2xtp/fp32/ac-none", "plan": _plan("fp32", "none"), "steps": STEPS, "repeat_batch": True},
           {"label": "fsdp2xtp/bf16/ac-full", "plan": _plan("bf16", "full"), "steps": 3, "repeat_batch": True},
           # Sequence parallel (engines/sequence_parallel.py): the same arithmetic, activations sharded
           # over the sequence between the TP regions.
           {"label": "fsdp2xtpxsp/fp32/ac-none", "plan": _plan("fp32", "none", sp=True), "steps": 3,
            "repeat_batch": True},
           # Colwise-sharded q/k/v biases.
           {"label": "tiny-qwen2/fsdp2xtp/fp32", "plan": _plan("fp32", "none", "tiny-qwen2"), "steps": 3,
            "repeat_batch": True}]
# Derived specs (no hand-written rules; estimate/derived_parallel.py): the rank's sliced config, traced.
# Qwen3's per-head q_norm / k_norm are `replicated_with_grad_allreduce` in its plan (transformers' hook);
# StarCoder2 has LayerNorms and biased linears. Their model folders are written by the fixture.
DERIVED = {"qwen3", "starcoder2"}
CONFIGS += [{"label": "qwen3/fsdp2xtp/fp32", "plan": _plan("fp32", "none", "qwen3"), "steps": 3, "repeat_batch": True},
            {"label": "starcoder2/fsdp2xtp/fp32", "plan": _plan("fp32", "none", "starcoder2"), "steps": 3,
             "repeat_batch": True},
            {"label": "qwen3/fsdp2xtp/bf16/ac-full", "plan": _plan("bf16", "full", "qwen3"), "steps": 3,
             "repeat_batch": True},
            {"label": "qwen3/fsdp2xtpxsp/fp32", "plan": _plan("fp32", "none", "qwen3", sp=True), "steps": 3,
             "repeat_batch": True},
            # Sequence parallel under per-op selective checkpointing: the blocks' inputs are sequence shards,
            # SAC's kept rowwise outputs are the full partial sums (estimate/sequence_parallel.py).
            {"label": "fsdp2xtpxsp/fp32/ac-selective", "plan": _plan("fp32", "selective", sp=True), "steps": 3,
             "repeat_batch": True},
            {"label": "qwen3/fsdp2xtpxsp/fp32/ac-selective", "plan": _plan("fp32", "selective", "qwen3", sp=True),
             "steps": 3, "repeat_batch": True}]
# The vocab-parallel loss (torch's loss_parallel on the head's V/tp logits shard, never gathered):
# measured phase totals fp32 -0.0 / -0.1%, bf16 full -0.1 / -0.3%, SP -0.6 / -0.1% (forward / backward);
# without checkpointing every category within 5% (or 1% of its phase), with it the backward split varies
# as under the gathering head (VARIES).
VOCAB_PARALLEL = [{"label": label, "plan": _plan(precision, ac, sp=sp, loss_parallel=True), "steps": 3,
                   "repeat_batch": True}
                  for label, precision, ac, sp in (("fsdp2xtp/fp32/ac-none/vocab-parallel", "fp32", "none", False),
                                                   ("fsdp2xtp/bf16/ac-full/vocab-parallel", "bf16", "full", False),
                                                   ("fsdp2xtpxsp/fp32/ac-none/vocab-parallel", "fp32", "none", True))]
# The same split the data-parallel FSDP2 estimate misses on this model (tests/measure/matrix_gaps.py
# "tiny-llama/fsdp2/bf16/ac-full"): at the backward peak the unsharded grads of a unit and a recomputed
# block are not all live at the instant the estimator picks; the phase total is within 0.1%.
# And in both: the harness's own batch (input_ids + labels, 16*b*s = 2,048 B) is still alive during the
# optimizer step next to 40,960 B of single-tensor AdamW scratch (measured 43,152 vs 40,968 predicted:
# -5.1%; SHARDFIT_PROFILE_DEBUG lists the two 1,024 B tensors).
_BATCH = "optimizer/temporaries"
KNOWN_GAPS = {"fsdp2xtp/fp32/ac-none": {_BATCH}, "tiny-qwen2/fsdp2xtp/fp32": {_BATCH},
              "fsdp2xtpxsp/fp32/ac-none": {_BATCH},
              "qwen3/fsdp2xtp/fp32": {_BATCH}, "qwen3/fsdp2xtp/bf16/ac-full": {_BATCH},
              "qwen3/fsdp2xtpxsp/fp32": {_BATCH}, "fsdp2xtpxsp/fp32/ac-selective": {_BATCH},
              "qwen3/fsdp2xtpxsp/fp32/ac-selective": {_BATCH},
              "fsdp2xtp/bf16/ac-full": {_BATCH}}


TOTAL_TOLERANCE: dict = {}
# Under per-op SAC with FSDP2 the backward peak lands at a unit's unsharded grads or at a recomputed
# block, run to run (tiny-llama SP: grads 0 or 46,336 B, activations 766,736 or 643,088 B): the split
# varies, the phase total is held to 2% (seen before the tracker made gloo's frees repeatable,
# calibration §16; not re-checked on 4 ranks since).
_SPLIT = {"backward/grads", "backward/activations", "backward/temporaries"}
# The same under full checkpointing in bf16: the split was a listed gap and came out within tolerance once
# in a full file run (2026-12-05), the total within 2% every time.
VARIES = {"fsdp2xtpxsp/fp32/ac-selective": _SPLIT, "qwen3/fsdp2xtpxsp/fp32/ac-selective": _SPLIT,
          "fsdp2xtp/bf16/ac-full": _SPLIT}


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tp")
    configs = []
    for config in CONFIGS + VOCAB_PARALLEL:
        model = config["plan"]["model"]
        if model in DERIVED:
            (folder / model).mkdir(exist_ok=True)
            (folder / model / "config.json").write_text(json.dumps(tiny_config(model)))
            config = {**config, "plan": {**config["plan"], "model": str(folder / model)}}
        configs.append(config)
    env = launch_env(SHARDFIT_CACHE_DIR=str(folder / "cache"))
    return measure_worker(configs, folder, nproc=4, timeout=300, env=env)


def _reference_losses(plan_data: dict, steps: int) -> list[float]:
    """Plain torch on one process: the mean loss of the two dp batches, the engines' own optimizer,
    schedule and clipping. Rank 0 reports its own batch's loss, so that is what is returned."""
    import torch

    from shardfit.engines.base import build_optimizer, build_scheduler
    from shardfit.measure.worker import load_plan, make_batch
    from shardfit.modeling import build_model

    plan = load_plan(plan_data)
    model = build_model(plan.model.source, device="cpu", dtype=None, seed=plan.schedule.seed,
                        attn_implementation=plan.training.attention)
    optimizer, vocab = build_optimizer(plan, model.parameters()), plan.model.vocab_size
    scheduler = build_scheduler(plan, optimizer)
    batches = [make_batch(plan, 0, rank, vocab) for rank in (0, 2)]  # global ranks 0 and 2: dp ranks 0 and 1
    losses = []
    for _ in range(steps):
        per_rank = [model(**batch).loss for batch in batches]
        (sum(per_rank) / len(per_rank)).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), plan.schedule.grad_clip, foreach=False)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(float(per_rank[0].detach()))
    return losses


def test_fsdp2_x_tp_trains_like_plain_torch(results):
    losses = results["fsdp2xtp/fp32/ac-none"]["losses"]
    assert len(losses) == STEPS and all(math.isfinite(x) for x in losses)
    assert losses[-1] < losses[0] - 0.5
    for config in CONFIGS:
        got = results[config["label"]]["losses"]
        assert all(math.isfinite(x) for x in got) and got[-1] < got[0], config["label"]
        if config["plan"]["training"]["precision"] == "fp32":
            plan = results[config["label"]]["plan"]  # the derived models' folders as the run had them
            assert got == pytest.approx(_reference_losses(plan, config["steps"]), rel=1e-4), config["label"]


@pytest.mark.parametrize("label", [c["label"] for c in CONFIGS])
def test_measured_categories_match_the_per_rank_estimate(results, label):
    from shardfit.estimate.estimator import estimate
    from shardfit.measure.worker import load_plan

    result = results[label]
    predicted = estimate(load_plan(result["plan"]), device="cpu").phases
    gaps = KNOWN_GAPS.get(label, set())
    # Run to run, the logits all-gather's staging buffers are freed before or after the loss saves its
    # fp32 log_softmax (tiny-qwen2 forward activations 1,407,492 or 1,572,364 B; llama bf16 forward
    # temporaries 352,672 or 475,552 B): the estimate is the worst case, either measurement is allowed.
    varies = {"forward/activations", "forward/temporaries"} | VARIES.get(label, set())
    misses = []
    for phase, measured in result["measured"].items():
        total = sum(measured.get(c, 0) for c in CATEGORIES)
        for category in CATEGORIES:
            got, want = measured.get(category, 0), predicted[phase][category]
            small = max(got, want) < SMALL_TERM * total
            ok = abs(got - want) <= SMALL_TERM * total if small else abs(want - got) <= TOLERANCE * got
            if f"{phase}/{category}" in varies:
                continue
            if not ok and f"{phase}/{category}" not in gaps:
                misses.append(f"{phase}/{category}: measured {got}, predicted {want}")
            if ok and f"{phase}/{category}" in gaps:
                misses.append(f"{phase}/{category} is listed as a gap but now within tolerance: remove it")
        if phase == "forward":
            # The estimate is the gather instant's worst case (estimate/tp_head.logits_gather_instant):
            # a run may free the gather's staging (the V/tp shard and the all-gather buffer) first.
            plan = result["plan"]
            spec = load_plan(plan).model
            tokens = plan["training"]["micro_batch"] * plan["training"]["seq_len"]
            d = 4 if plan["training"]["precision"] == "fp32" else 2
            staging = tokens * (-(-spec.vocab_size // plan["parallelism"]["tp"]) + spec.vocab_size) * d
            want = sum(predicted[phase].values())
            assert want - staging - 0.02 * total <= total <= want * 1.10, (measured, predicted[phase], staging)
            continue
        # 2%: under checkpointing FSDP2's backward peak lands at different recompute instants run to run
        # (before calibration §16; here 1,395,968 predicted vs 1,397,244 or 1,413,628 measured).
        assert sum(predicted[phase].values()) == pytest.approx(total, rel=TOTAL_TOLERANCE.get(label, 0.02)), (
            phase, measured, predicted[phase])
    assert not misses, "; ".join(misses)


@pytest.mark.parametrize("label", [c["label"] for c in VOCAB_PARALLEL])
def test_vocab_parallel_loss_trains_like_the_gathered_logits_in_less_memory(results, label):
    """The same losses as the model's own gathering head (torch's loss_parallel cross-entropy on the
    vocab shards), a lower forward peak (no V-wide logits on any rank), and phase totals as estimated."""
    from shardfit.estimate.estimator import estimate
    from shardfit.measure.worker import load_plan

    result = results[label]
    gathered = results[label.replace("/vocab-parallel", "")]
    steps = len(result["losses"])
    assert result["losses"] == pytest.approx(gathered["losses"][:steps], rel=1e-5)
    total = {phase: sum(m.get(c, 0) for c in CATEGORIES) for phase, m in result["measured"].items()}
    assert total["forward"] < sum(gathered["measured"]["forward"].get(c, 0) for c in CATEGORIES)
    predicted = estimate(load_plan(result["plan"]), device="cpu").phases
    for phase in ("forward", "backward", "optimizer"):
        assert sum(predicted[phase].values()) == pytest.approx(total[phase], rel=0.02), (phase, result["measured"][phase],
                                                                                         predicted[phase])
        if "ac-none" not in label:
            continue
        for category in CATEGORIES:
            got, want = result["measured"][phase].get(category, 0), predicted[phase][category]
            assert abs(want - got) <= max(TOLERANCE * got, SMALL_TERM * total[phase]), (phase, category, got, want)


def test_sequence_parallel_shards_the_activations_between_the_tp_regions(results):
    """Same losses as TP alone (the fp32 reference above holds both), fewer saved activations: the norms'
    outputs and the residual stream are sequence shards (measured: 1,669,392 vs 1,950,224 B at the
    backward peak, tiny-llama, tp 2)."""
    plain = results["fsdp2xtp/fp32/ac-none"]["measured"]["backward"]["activations"]
    sharded = results["fsdp2xtpxsp/fp32/ac-none"]["measured"]["backward"]["activations"]
    assert sharded < 0.9 * plain, (sharded, plain)
    steps = len(results["fsdp2xtpxsp/fp32/ac-none"]["losses"])
    assert results["fsdp2xtpxsp/fp32/ac-none"]["losses"] == pytest.approx(
        results["fsdp2xtp/fp32/ac-none"]["losses"][:steps], rel=1e-5)


def test_sequence_parallel_keeps_per_head_norms_on_the_heads(results):
    """Qwen3's q_norm / k_norm run on this rank's heads inside the attention, not on sequence shards:
    SP leaves them alone (engines/sequence_parallel.py) and trains exactly as TP alone does."""
    assert results["qwen3/fsdp2xtpxsp/fp32"]["losses"] == pytest.approx(results["qwen3/fsdp2xtp/fp32"]["losses"],
                                                                         rel=1e-5)
