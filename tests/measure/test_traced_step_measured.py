"""The traced step (estimate/backward_timeline.py) against real CPU steps: thirteen architectures
without hand-written rules, from tiny configs of their own defaults, on one device (`single`, one
rank) and under DDP (2 ranks), fp32 and bf16, checkpointing none / full / selective rotating across
them. Every category of every phase within 5% (or 1% of its phase when small) and the peak within 5%:
the forward and backward splits come from the trace, not from assumed instants.

DeepSpeed ZeRO-1 and ZeRO-2 (2 ranks, small buckets so that several reductions happen) place the
same traced terms by their own rules (estimate/traced_phases.py: a gradient stays in .grad until its
hook copies it into the bucket, the first hook allocates the buckets; estimate/zero_partitions.py: the
gradient buffer holds every parameter the rank's slice touches whole): every term of every phase, the
optimizer step included, and the peak, as strictly.

ZeRO-3 on six settings (its bucket reductions: a flat copy of the bucket, and gloo's copy of it,
beside the gradient waiting, estimate/zero_partitions.py; a tied head's partial gradient). FSDP1 and
FSDP2 on five and seven settings (a unit's reduce-scatter after its reshard, gloo's input copy, the root's
gradients and all-gather output; full and selective checkpointing). Until 2026-12-06 the optimizer
step and FSDP's checkpointed backward moved between identical runs: gloo's worker thread, not the
program, decided when some buffers died; the tracker now lets it finish first
(measure/collective_release.py, docs/estimator-calibration.md §16), so they are held like the rest.
The full grid's figures are benchmarks/bench_any_model.py's.
"""
from __future__ import annotations

import json

import pytest

import launch
from shardfit.measure.compare import off_terms
from test_any_model_matrix import ARCHITECTURES, tiny_models

pytest.importorskip("torch")
pytestmark = [pytest.mark.multirank, pytest.mark.slow]

SETTINGS = [(p, ac) for p in ("fp32", "bf16") for ac in ("none", "full", "selective")]


# ZeRO-1/2: reduce_bucket_size elements per ipg buffer (x2 with overlap_comm, our default)
SMALL_BUCKETS = {"reduce_bucket_size": 100_000, "allgather_bucket_size": 100_000}
KINDS = (("single", 1, 0), ("ddp", 2, 1), ("zero2", 2, 3), ("zero1", 2, 0))
# ZeRO-3 on six settings (docs/estimator-calibration.md §15: its bucket reductions mid-backward, a
# tied head). FSDP1 / FSDP2 on settings that hold their reduce-scatter and root mechanisms (§15), a
# recompute that stops early, FSDP2's last unsharded gradient through its reduce-scatter and blocks of
# unequal size (DeepSeek's dense first layer below an MoE one) (§16).
ZERO3 = (("gpt_neox", "fp32", "full"), ("qwen3", "fp32", "full"), ("falcon", "bf16", "selective"),
         ("deepseek_v3", "fp32", "none"), ("opt", "fp32", "full"), ("granitemoe", "fp32", "full"))
FSDP = {"fsdp": (("opt", "bf16", "none"), ("opt", "fp32", "none"), ("granitemoe", "bf16", "none"),
                 ("falcon", "fp32", "full"), ("bloom", "fp32", "selective")),
        "fsdp2": (("opt", "fp32", "none"), ("opt", "bf16", "none"), ("qwen3", "bf16", "none"),
                  ("falcon", "fp32", "full"), ("gpt_neox", "bf16", "selective"), ("granitemoe", "bf16", "none"),
                  ("deepseek_v3", "fp32", "none"))}


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
    assert not off, off


def test_every_setting_is_covered():
    seen = {tuple(label.split("/")[1:]) for label in LABELS}
    assert {(kind, p, f"ac-{ac}") for kind, _, _ in KINDS for p, ac in SETTINGS} <= seen
