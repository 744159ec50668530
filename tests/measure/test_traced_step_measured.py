"""The traced step (estimate/backward_timeline.py) against real CPU steps: thirteen architectures
without hand-written rules, from tiny configs of their own defaults, on one device (`single`, one
rank) and under DDP (2 ranks), fp32 and bf16, checkpointing none / full / selective rotating across
them. Every category of every phase within 5% (or 1% of its phase when small) and the peak within 5%:
the forward and backward splits come from the trace, not from assumed instants.

The other engines (FSDP1/2, ZeRO) place the same traced terms by their own rules
(estimate/traced_phases.py); their figures over the full grid are benchmarks/bench_any_model.py's.
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


def _plan(model_dir: str, kind: str, precision: str, ac: str) -> dict:
    return {"model": model_dir, "strategy": {"kind": kind},
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
    for kind, nproc, offset in (("single", 1, 0), ("ddp", 2, 1)):
        configs = _configs(models, kind, offset)
        (folder / f"{kind}.json").write_text(json.dumps(configs))
        launch.torchrun(["-m", "shardfit.measure.worker", str(folder / f"{kind}.json"), str(folder / f"{kind}.jsonl")],
                        nproc=nproc, timeout=900, env=env)
        for line in (folder / f"{kind}.jsonl").read_text().splitlines():
            result = json.loads(line)
            out[result["label"]] = result
    return out


LABELS = [f"{arch}/{kind}/{SETTINGS[(i + offset + step) % len(SETTINGS)][0]}/ac-{SETTINGS[(i + offset + step) % len(SETTINGS)][1]}"
          for kind, offset in (("single", 0), ("ddp", 1)) for i, arch in enumerate(ARCHITECTURES) for step in (0, 3)]


@pytest.mark.parametrize("label", LABELS)
def test_every_term_of_the_traced_step(results, label):
    result = results[label]
    assert result["error"] is None, result.get("traceback") or result["error"]
    off = off_terms(result["comparison"], term_tolerance=0.05, small_term=0.01, peak_tolerance=0.05)
    assert not off, off


def test_every_setting_is_covered():
    seen = {tuple(label.split("/")[1:]) for label in LABELS}
    assert {(kind, p, f"ac-{ac}") for kind in ("single", "ddp") for p, ac in SETTINGS} <= seen
