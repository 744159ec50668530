"""The traced step (estimate/backward_timeline.py) against real CPU steps: thirteen architectures
without hand-written rules, from tiny configs of their own defaults, on one device (`single`, one
rank) and under DDP (2 ranks), fp32 and bf16, checkpointing none / full / selective rotating across
them. Every category of every phase within 5% (or 1% of its phase when small) and the peak within 5%:
the forward and backward splits come from the trace, not from assumed instants.

DeepSpeed ZeRO-1 and ZeRO-2 (2 ranks, small buckets so that several reductions happen) place the
same traced terms by their own rules (estimate/traced_phases.py: a gradient stays in .grad until its
hook copies it into the bucket, the first hook allocates the buckets; estimate/zero_partitions.py: the
gradient buffer holds every parameter the rank's slice touches whole): every term of load, forward
and backward, and the peak, as strictly. Their optimizer step is held by its total only: whether one of
the two ipg buffers is still allocated on a rank while it steps is a race between the ranks (seen on
any model: +100 to +400 KB here), and so is whether a parameter larger than a bucket still has its own
gradient beside its copy in the buffer: the step may read up to one of those more than predicted.

ZeRO-3 on six settings, its step aside (its bucket reductions: a flat copy of the bucket, and gloo's
copy of it, beside the gradient waiting, estimate/zero_partitions.py; a tied head's partial gradient). FSDP1
and FSDP2 on three settings each (a unit's reduce-scatter after its reshard, gloo's input copy, the
root's gradients and all-gather output). The full grid's figures are benchmarks/bench_any_model.py's.
"""
from __future__ import annotations

import json

import pytest

import launch
from shardfit.measure.compare import off_terms
from shardfit.spec.models import load_model_spec
from test_any_model_matrix import ARCHITECTURES, tiny_models

pytest.importorskip("torch")
pytestmark = [pytest.mark.multirank, pytest.mark.slow]

SETTINGS = [(p, ac) for p in ("fp32", "bf16") for ac in ("none", "full", "selective")]


# ZeRO-1/2: reduce_bucket_size elements per ipg buffer (x2 with overlap_comm, our default)
SMALL_BUCKETS = {"reduce_bucket_size": 100_000, "allgather_bucket_size": 100_000}
KINDS = (("single", 1, 0), ("ddp", 2, 1), ("zero2", 2, 3), ("zero1", 2, 0))
# ZeRO-3 on six settings (docs/estimator-calibration.md §15: its bucket reductions mid-backward, a
# tied head): load, forward and backward term by term; its step is the engine matrix's (whether the
# persistent parameters stay gathered through step() is a race). FSDP1 / FSDP2 on settings that hold
# their reduce-scatter and root mechanisms (calibration §15): every term. Not under checkpointing: there
# the backward peak of FSDP1 / FSDP2 moves between identical runs (more often under load).
ZERO3 = (("gpt_neox", "fp32", "full"), ("qwen3", "fp32", "full"), ("falcon", "bf16", "selective"),
         ("deepseek_v3", "fp32", "none"), ("opt", "fp32", "full"), ("granitemoe", "fp32", "full"))
FSDP = {"fsdp": (("opt", "bf16", "none"), ("opt", "fp32", "none"), ("granitemoe", "bf16", "none")),
        "fsdp2": (("opt", "fp32", "none"), ("opt", "bf16", "none"), ("qwen3", "bf16", "none"))}
# Where the backward peak itself moves between identical runs: its split is not asserted, its total is.
VARIES_BACKWARD = {
    # Inside the first block, as predicted (2 of 3 runs alone), or at the last bucket's reduction:
    # allreduce_bucket's flat copy of the bucket (350,208 B in fp32) beside the embedding's gradient,
    # not yet hooked (81,920 B), after every activation is gone (2026-12-05; total +1.3% then); seen
    # under ZeRO-1 and ZeRO-2, fp32 and bf16.
    "gpt_neox/zero2/fp32/ac-full": "the last bucket's reduction or the first block's backward",
    "gpt_neox/zero2/bf16/ac-full": "the last bucket's reduction or the first block's backward",
    "gpt_neox/zero1/fp32/ac-full": "the last bucket's reduction or the first block's backward",
    "gpt_neox/zero1/bf16/ac-full": "the last bucket's reduction or the first block's backward",
}


def _plan(model_dir: str, kind: str, precision: str, ac: str) -> dict:
    strategy = {"kind": kind, **(SMALL_BUCKETS if kind.startswith("zero") else {}),
                **({"prefetch_bucket_size": 100_000} if kind == "zero3" else {})}
    return {"model": model_dir, "strategy": strategy,
            "cluster": {"nodes": 1, "gpus_per_node": 1 if kind == "single" else 2},
            "training": {"micro_batch": 2, "seq_len": 64, "precision": precision, "activation_checkpointing": ac}}


def _configs(models: dict, kind: str, offset: int) -> list[dict]:
    """Two settings per architecture, rotating, so every setting meets every kind of block."""
    out = []
    for index, arch in enumerate(ARCHITECTURES):
        for step in (0, 3):
            precision, ac = SETTINGS[(index + offset + step) % len(SETTINGS)]
            out.append({"label": f"{arch}/{kind}/{precision}/ac-{ac}", "steps": 2,
                        "plan": _plan(models[arch], kind, precision, ac)})
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    folder = tmp_path_factory.mktemp("traced-step")
    models, env = tiny_models(folder)
    out = {}
    for kind, nproc, offset in KINDS:
        if kind.startswith("zero"):
            pytest.importorskip("deepspeed")
        configs = _configs(models, kind, offset)
        (folder / f"{kind}.json").write_text(json.dumps(configs))
        launch.torchrun(["-m", "shardfit.measure.worker", str(folder / f"{kind}.json"), str(folder / f"{kind}.jsonl")],
                        nproc=nproc, timeout=900, env=env)
        for line in (folder / f"{kind}.jsonl").read_text().splitlines():
            result = json.loads(line)
            out[result["label"]] = result
    for kind, settings in (("zero3", ZERO3), *FSDP.items()):
        configs = [{"label": f"{arch}/{kind}/{p}/ac-{ac}", "steps": 2, "plan": _plan(models[arch], kind, p, ac)}
                   for arch, p, ac in settings]
        (folder / kind).mkdir()
        out.update(launch.measure_worker(configs, folder / kind, nproc=2, timeout=900, env=env))
    # The largest tensor's bytes (fp32) per architecture, from the specs the runs cached (torch-free).
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("SHARDFIT_CACHE_DIR", env["SHARDFIT_CACHE_DIR"])
        for arch, folder_of in models.items():
            order = load_model_spec(folder_of).param_order
            out[f"largest/{arch}"] = 4 * max(n for _, group, _ in order for n in group)
    return out


LABELS = [f"{arch}/{kind}/{SETTINGS[(i + offset + step) % len(SETTINGS)][0]}/ac-{SETTINGS[(i + offset + step) % len(SETTINGS)][1]}"
          for kind, _, offset in KINDS for i, arch in enumerate(ARCHITECTURES) for step in (0, 3)]
LABELS += [f"{arch}/zero3/{p}/ac-{ac}" for arch, p, ac in ZERO3]
LABELS += [f"{arch}/{kind}/{p}/ac-{ac}" for kind, settings in FSDP.items() for arch, p, ac in settings]


@pytest.mark.parametrize("label", LABELS)
def test_every_term_of_the_traced_step(results, label):
    result = results[label]
    assert result["error"] is None, result.get("traceback") or result["error"]
    off = off_terms(result["comparison"], term_tolerance=0.05, small_term=0.01, peak_tolerance=0.05)
    if "/zero3/" in label:
        off = {term: why for term, why in off.items() if not term.startswith("optimizer/")}
    elif "/zero" in label:
        step = result["comparison"]["optimizer"]["total"]
        # One ipg buffer (fp32 reduction dtype), or the largest parameter's gradient, once more: OPT's
        # embedding (larger than a bucket, reduced on its own) is at times still alive on the rank
        # that steps beside its copy in the buffer (983,040 B, 3 runs in 6, 2026-12-05).
        slack = max(SMALL_BUCKETS["reduce_bucket_size"] * 4, results[f"largest/{label.split('/')[0]}"])
        assert 0.95 * step["predicted"] <= step["measured"] <= 1.05 * step["predicted"] + slack, step
        off = {term: why for term, why in off.items() if not term.startswith("optimizer/")}
    if label in VARIES_BACKWARD:
        total = result["comparison"]["backward"]["total"]
        assert abs(total["measured"] - total["predicted"]) <= 0.05 * total["measured"], total
        off = {term: why for term, why in off.items() if not term.startswith("backward/")}
    assert not off, off


def test_every_setting_is_covered():
    seen = {tuple(label.split("/")[1:]) for label in LABELS}
    assert {(kind, p, f"ac-{ac}") for kind, _, _ in KINDS for p, ac in SETTINGS} <= seen
