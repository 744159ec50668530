"""QLoRA through the real training loop on CPU: a bitsandbytes base (nf4 / int8) quantized in place,
peft's prepare_model_for_kbit_training, LoRA r=8 on q_proj,v_proj, bf16 autocast. One launch of one
rank (single) and one of two ranks (DDP, FSDP2, and DDP with bitsandbytes' AdamW8bit). Every run saves at
step 2 and is resumed from there (and DDP's nf4 checkpoint by FSDP2): the resumed losses must be the
uninterrupted run's, bit for bit."""
from __future__ import annotations

import json
import math

import pytest
import launch

from jobs import plan

pytest.importorskip("bitsandbytes")
pytestmark = [pytest.mark.multirank, pytest.mark.slow]
WORKER = "tests/engines/worker.py"


def qlora_job(tmp, engine: str, base_dtype: str, optimizer: str = "adamw", resume: str | None = None) -> dict:
    data = plan(engine, precision="bf16", steps=4, save_every=2)
    data["training"].update(optimizer=optimizer,
                            lora={"rank": 8, "target_modules": ["q_proj", "v_proj"], "base_dtype": base_dtype})
    data["schedule"]["lr"] = 1e-2
    name = f"{engine}-{base_dtype}-{optimizer}"
    if resume is None:
        return {"name": name, "plan": data, "out": str(tmp / name)}
    name = f"{name}-resumed-from-{resume}"
    return {"name": name, "plan": data, "out": str(tmp / name), "resume": str(tmp / resume / "checkpoints" / "step-2")}


def with_resumes(tmp, jobs: list[dict]) -> list[dict]:
    resumed = [qlora_job(tmp, *job["name"].split("-"), resume=job["name"]) for job in jobs]
    return jobs + resumed


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("qlora")
    out = {}
    one = with_resumes(tmp, [qlora_job(tmp, "single", "nf4"), qlora_job(tmp, "single", "int8")])
    two = with_resumes(tmp, [qlora_job(tmp, "ddp", "nf4"), qlora_job(tmp, "ddp", "int8"),
                             qlora_job(tmp, "fsdp2", "nf4"), qlora_job(tmp, "ddp", "nf4", "adamw8bit")])
    two.append(qlora_job(tmp, "fsdp2", "nf4", resume="ddp-nf4-adamw"))  # engine switch
    for nproc, jobs in ((1, one), (2, two)):
        spec, result = tmp / f"spec-{nproc}.json", tmp / f"result-{nproc}.json"
        spec.write_text(json.dumps(jobs))
        launch.torchrun([WORKER, str(spec), str(result)], nproc=nproc, timeout=900, env=launch.test_env())
        out.update(json.loads(result.read_text()))
    return out


@pytest.mark.parametrize("name", ["single-nf4-adamw", "single-int8-adamw", "ddp-nf4-adamw", "ddp-int8-adamw", "fsdp2-nf4-adamw",
                                  "ddp-nf4-adamw8bit"])
def test_qlora_trains(results, name):
    result = results[name]
    assert result["ok"], f"{name}: {result.get('error')}\n{result.get('trace', '')}"
    losses = result["losses"]
    assert len(losses) == 4 and all(math.isfinite(x) for x in losses)
    assert losses[-1] < losses[0] - 0.1, losses


def test_fsdp2_shards_nf4_without_changing_the_math(results):
    # FSDP2 all-gathers the packed 4-bit bytes: the same step as DDP up to the reduction order.
    assert results["fsdp2-nf4-adamw"]["losses"] == pytest.approx(results["ddp-nf4-adamw"]["losses"], rel=1e-4)


@pytest.mark.parametrize("name", ["single-nf4-adamw", "single-int8-adamw", "ddp-nf4-adamw", "ddp-int8-adamw",
                                  "fsdp2-nf4-adamw", "ddp-nf4-adamw8bit"])
def test_qlora_resumes_exactly(results, name):
    resumed = results[f"{name}-resumed-from-{name}"]
    assert resumed["ok"], f"{name}: {resumed.get('error')}\n{resumed.get('trace', '')}"
    assert resumed["steps"] == [3, 4]
    assert resumed["losses"] == results[name]["losses"][2:]  # bit for bit


def test_fsdp2_resumes_a_ddp_qlora_checkpoint(results):
    switched = results["fsdp2-nf4-adamw-resumed-from-ddp-nf4-adamw"]
    assert switched["ok"], f"{switched.get('error')}\n{switched.get('trace', '')}"
    assert switched["losses"] == pytest.approx(results["ddp-nf4-adamw"]["losses"][2:], rel=1e-4)
