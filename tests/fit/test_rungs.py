"""The state rungs (fit/rungs.py): 8-bit AdamW and pure bf16 are tried after precision, micro-batch,
checkpointing and sharding, before offload; each is picked only when it is what makes a plan fit, says
what it saves and costs, and emit carries it."""
import json
import re

import pytest

from shardfit.cli import main
from shardfit.emit import emit
from shardfit.estimate.estimator import estimate
from shardfit.fit import FitRequest, fit
from shardfit.spec.models import load_model_spec
from shardfit.spec.planfile import load_plan

GIB = 1024**3


def _fit(model, gpu, gpus, **kw):
    # Data parallel only: on these clusters a tp layout (exact arithmetic) fits before any state rung
    # would be climbed (test_a_layout_comes_before_the_state_rungs); the rungs are the levers under test.
    kw.setdefault("layouts", False)
    return fit(FitRequest.build(model=load_model_spec(model), gpu=gpu, gpus_per_node=gpus, seq_len=2048, **kw))


def test_a_layout_comes_before_the_state_rungs():
    # Llama-3.1-8B on 4 x A100-40GB: no data-parallel plan fits in full precision; a tensor-parallel
    # layout keeps the optimizer and precision as asked, so it is taken before 8-bit AdamW or pure bf16.
    best = _fit("llama-3.1-8b", "A100-40GB", 4, layouts=True).best
    assert best.plan.parallelism.tp > 1 and best.rung == ""
    assert (best.plan.training.optimizer, best.plan.training.precision) == ("adamw", "bf16")
    assert _fit("llama-3.1-8b", "A100-40GB", 4).best.rung == "8-bit AdamW"


@pytest.mark.parametrize("model,gpu,gpus,rung,optimizer,precision", [
    ("llama-3.1-8b", "A100-40GB", 4, "8-bit AdamW", "adamw8bit", "bf16"),
    ("llama-2-7b", "A100-40GB", 2, "pure bf16", "adamw", "bf16-pure"),
    ("llama-3.1-8b", "A100-40GB", 2, "8-bit AdamW + pure bf16", "adamw8bit", "bf16-pure"),
])
def test_each_rung_is_picked_when_it_is_what_makes_the_plan_fit(model, gpu, gpus, rung, optimizer, precision):
    result = _fit(model, gpu, gpus)
    best = result.best
    assert best.rung == rung and not best.plan.strategy.offload_params and not best.plan.strategy.offload_optimizer
    t = best.plan.training
    assert (t.optimizer, t.precision) == (optimizer, precision)
    # Without the rungs nothing fits but offload: full-precision states were what kept the plan out.
    full = _fit(model, gpu, gpus, rungs=())
    assert full.best is None or "offload" in full.best.family
    # The same plan with full-precision states does not fit; the note says what the rung saves and costs.
    before = estimate(best.plan.with_changes(training={"optimizer": "adamw", "precision": "bf16"})).device_peak_bytes
    assert before > result.usable_bytes >= best.peak_bytes
    note = next(n for n in result.notes if n.startswith(rung + " ("))
    saved = float(re.search(r"saves ([0-9.]+) GiB per GPU", note).group(1))
    assert saved == pytest.approx((before - best.peak_bytes) / GIB, abs=0.01)
    assert "cost:" in note and ("bitsandbytes" in note) == ("8-bit" in rung)
    assert ("Kahan summation / stochastic rounding" in note) == ("pure bf16" in rung)
    # Offload is explained as not needed, because of the rung.
    assert any(r.reason.startswith(f"not needed: {best.family} fits without offload (with {rung})")
               for r in result.rejected if "offload" in r.family)


def test_no_rung_when_something_cheaper_fits():
    # 8 GPUs: ZeRO-3 fits with full-precision AdamW and bf16 mixed precision.
    result = _fit("llama-3.1-8b", "A100-40GB", 8)
    assert result.best.rung == "" and result.best.plan.training.optimizer == "adamw"
    assert result.best.plan.training.precision == "bf16"
    assert not any("cost:" in n for n in result.notes)
    # fp16-only hardware has no pure-bf16 rung; V100s fit 7B with 8-bit AdamW before offload.
    v100 = _fit("llama-2-7b", "V100-32GB", 2)
    assert v100.best is None or "bf16" not in v100.best.plan.training.precision


def test_8bit_never_lands_on_fsdp2():
    # bitsandbytes' 8-bit kernels reject FSDP2's DTensors (the emitted script failed with "got mixed torch.Tensor
    # and DTensor"): fit puts 8-bit AdamW on FSDP1 / ZeRO / DDP.
    for model, gpu, gpus in [("llama-3.1-8b", "A100-40GB", 4), ("llama-2-13b", "H100-80GB", 2)]:
        best = _fit(model, gpu, gpus).best
        assert best.plan.training.optimizer == "adamw8bit" and best.plan.strategy.kind != "fsdp2"


def test_a_pinned_knob_is_not_climbed(capsys):
    # --optimizer given: no 8-bit rung (pure bf16 may still be climbed); --precision given: no pure-bf16 rung.
    assert main(["fit", "llama-3.1-8b", "--gpu", "A100-40GB", "--gpus", "4", "--data-parallel-only", "--json"]) == 0
    free = json.loads(capsys.readouterr().out)
    assert free["plan"]["training"]["optimizer"] == "adamw8bit" and free["best"]["rung"] == "8-bit AdamW"
    assert main(["fit", "llama-3.1-8b", "--gpu", "A100-40GB", "--gpus", "4", "--data-parallel-only", "--optimizer", "adamw",
                 "--precision", "bf16", "--json"]) == 0
    pinned = json.loads(capsys.readouterr().out)
    assert pinned["plan"]["training"]["optimizer"] == "adamw" and pinned["plan"]["training"]["precision"] == "bf16"
    assert "offload" in pinned["best"]["strategy"]


def test_emit_carries_the_rung(tmp_path, capsys):
    plan_path = tmp_path / "plan.yaml"
    assert main(["fit", "llama-3.1-8b", "--gpu", "A100-40GB", "--gpus", "4", "--data-parallel-only", "-o", str(plan_path)]) == 0
    plan = load_plan(plan_path)
    assert plan.training.optimizer == "adamw8bit"
    args = json.loads(emit(plan, "hf-trainer").files["training_args.json"])
    assert args["optim"] == "adamw_bnb_8bit"
    script = emit(plan, "fsdp").files["train_fsdp.py"]
    assert "bnb.optim.AdamW8bit(" in script and "import bitsandbytes as bnb" in script
    assert "torch.optim.AdamW(" not in script
    pure = _fit("llama-2-7b", "A100-40GB", 2).best.plan
    text = emit(pure, "fsdp2").files["train_fsdp2.py"]
    assert "PURE_BF16 = True" in text and "model = model.to(torch.bfloat16)" in text


def test_nothing_fits_lists_the_rungs_with_their_costs(capsys):
    # LoRA on 70B over one RTX 4090: nothing fits; the suggestions list both rungs, each with numbers and cost.
    code = main(["fit", "llama-3.1-70b", "--gpu", "RTX-4090", "--gpus", "1", "--lora-r", "16",
                 "--host-memory-gib", "64", "--engine", "fsdp,ddp,single"])
    out = capsys.readouterr().out
    assert code == 1 and "NOTHING FITS" in out
    lines = {line.strip().split(":")[0]: line for line in out.splitlines() if line.startswith("  ")}
    for rung, flags, cost in [("8-bit AdamW", "--optimizer adamw8bit", "needs bitsandbytes"),
                              ("pure bf16", "--precision bf16-pure", "Kahan summation")]:
        assert rung in lines, out
        assert flags in lines[rung] and "GiB per GPU" in lines[rung] and cost in lines[rung]


@pytest.mark.multirank
@pytest.mark.parametrize("budget,rung,fmt", [("custom:0.0012", "8-bit AdamW + pure bf16", "fsdp"),
                                             ("custom:0.0016", "pure bf16", "fsdp2")])
def test_the_emitted_script_of_a_rung_plan_trains(tmp_path, capsys, budget, rung, fmt):
    """fit (CPU budget: tensor bytes) picks the rung, emit writes it, and the script runs on 2 gloo ranks
    with the real bitsandbytes AdamW8bit / bf16 weights."""
    from launch import test_env, torchrun

    plan_path = tmp_path / "plan.yaml"
    assert main(["fit", "tiny-llama", "--gpu", budget, "--gpus", "2", "--cpu", "--seq", "32", "--global-batch", "4",
                 "--engine", "fsdp", "-o", str(plan_path)]) == 0
    out = capsys.readouterr().out
    assert f"{rung} (" in out and "is what makes" in out
    plan = load_plan(plan_path)
    assert plan.strategy.kind == ("fsdp" if fmt == "fsdp" else "fsdp2")
    name, text = next(iter(emit(plan, fmt).files.items()))
    script = tmp_path / name
    script.write_text(text)
    # In tmp_path: the script checkpoints under out/ where it runs, and would resume another run's steps.
    result = torchrun([str(script)], nproc=2, timeout=240, env=test_env(STEPS="3", CHECKSUM="1"), cwd=tmp_path)
    losses = [float(x) for x in re.findall(r"step \d+ loss ([0-9.]+)", result.stdout)]
    assert losses and all(0 < loss < 20 for loss in losses)
    assert len(re.findall(r"rank \d checksum", result.stdout)) == 2
