"""The chunked cross-entropy and the plan's optimizer implementation under every engine, through the real
training loop on 2 CPU ranks (gloo): the chunked loss trains the same model as the model's own loss
(losses equal to fp tolerance) under DDP, FSDP1, FSDP2 and ZeRO-3, with torch's fused AdamW (DTensors
under FSDP2, DeepSpeed's client optimizer under ZeRO-3), and evaluation runs through the same loss."""
from __future__ import annotations

import json

import pytest

import launch
from jobs import plan

pytestmark = [pytest.mark.multirank, pytest.mark.deepspeed, pytest.mark.slow]
ENGINES = ("ddp", "fsdp", "fsdp2", "zero3")
STEPS = 3


def _jobs(root: str) -> list[dict]:
    jobs = []
    for engine in ENGINES:
        standard = plan(engine, steps=STEPS)
        chunked = plan(engine, steps=STEPS, eval_every=STEPS if engine == "fsdp2" else 0)
        chunked["training"].update({"loss": "chunked", "loss_chunks": 3, "optimizer_impl": "fused"})
        jobs += [{"name": f"{engine}-standard", "plan": standard, "out": f"{root}/{engine}-standard"},
                 {"name": f"{engine}-chunked-fused", "plan": chunked, "out": f"{root}/{engine}-chunked"}]
    return jobs


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("kernels")
    spec, result = tmp / "jobs.json", tmp / "result.json"
    spec.write_text(json.dumps(_jobs(str(tmp))))
    launch.torchrun(["tests/engines/worker.py", str(spec), str(result)], nproc=2, timeout=600, env=launch.test_env())
    return json.loads(result.read_text())


def _ok(runs, name):
    result = runs[name]
    assert result["ok"], f"{name}: {result.get('error')}\n{result.get('trace', '')}"
    return result


@pytest.mark.parametrize("engine", ENGINES)
def test_chunked_loss_with_fused_adamw_trains_the_same_model(runs, engine):
    standard, chunked = _ok(runs, f"{engine}-standard"), _ok(runs, f"{engine}-chunked-fused")
    assert len(chunked["losses"]) == STEPS
    # fp32: the chunked logsumexp and the fused step differ from log_softmax and the single-tensor loop
    # only in rounding.
    assert chunked["losses"] == pytest.approx(standard["losses"], rel=1e-5), (standard["losses"], chunked["losses"])
    assert chunked["losses"][-1] < chunked["losses"][0]


def test_evaluation_uses_the_chunked_loss(runs):
    records = _ok(runs, "fsdp2-chunked-fused")["records"]
    evaluated = [r for r in records if "val_loss" in r]
    assert evaluated and 0 < evaluated[-1]["val_loss"] < 20
