"""fit's kernel levers (fit/kernels.py): the chunked cross-entropy is turned on where it is what makes a
plan fit, and only there; the AdamW implementation is chosen explicitly (fused where the engine runs
torch's AdamW), printed, written into the plan, and emitted the same way by every format."""
from __future__ import annotations

import json

import pytest

from shardfit.emit import emit
from shardfit.estimate.estimator import estimate
from shardfit.fit import FitRequest, fit
from shardfit.fit.report import format_text, to_json
from shardfit.spec.models import load_model_spec
from shardfit.spec.plan import plan_from_dict

GIB = 1024**3


def _long_context(**changes) -> FitRequest:
    # Llama-3.1-8B at 32k tokens: the loss's fp32 b*s*V buffers (V = 128256) are most of the peak. Data
    # parallel only: a tp / cp layout would split those buffers too, and the loss is the lever under test.
    return FitRequest.build(model=load_model_spec("llama-3.1-8b"), gpu="H100-80GB", gpus_per_node=8, seq_len=32768,
                            global_batch=8, engines=("fsdp",), host_memory_gib=64, layouts=False, **changes)


def test_fit_turns_the_chunked_loss_on_when_nothing_fits_without_it():
    # the state rungs (8-bit AdamW, pure bf16) off: the loss is the lever under test
    without = fit(_long_context(loss="standard", rungs=()))
    assert not without.fits  # no FSDP family fits, and offload needs more than 64 GiB of host RAM
    result = fit(_long_context())
    assert result.fits and result.best.plan.training.loss == "chunked"
    assert not result.best.plan.strategy.offload_params
    # The estimator itself agrees: the same plan with the standard loss does not fit.
    standard = result.best.plan.with_changes(training={"loss": "standard"})
    assert estimate(standard).device_peak_bytes > result.usable_bytes >= result.best.peak_bytes
    why = [n for n in result.notes if n.startswith("chunked cross-entropy")]
    assert why and "without it this plan needs" in why[0], result.notes
    text = format_text(result)
    assert "loss chunked:8" in text and "loss=chunked:8" in text  # best line and alternatives
    assert to_json(result)["best"]["loss"] == "chunked"


def test_chunked_loss_stays_off_where_the_standard_loss_fits():
    # One sequence per GPU at seq 2048: every setting fits its largest micro-batch with the standard loss.
    result = fit(FitRequest.build(model=load_model_spec("llama-3.1-8b"), gpu="H100-80GB", gpus_per_node=8, seq_len=2048,
                                  global_batch=8))
    assert result.best.plan.training.loss == "standard"
    assert all(c.plan.training.loss == "standard" for c in result.alternatives)
    assert not any(n.startswith("chunked cross-entropy") for n in result.notes)


def test_a_chunked_candidate_is_one_the_standard_loss_does_not_fit():
    # Eight sequences per GPU: the chunked loss lets AC none fit micro-batch 4 (and is then fastest); every
    # chunked candidate is a setting whose micro-batch does not fit with the standard loss.
    result = fit(FitRequest.build(model=load_model_spec("llama-3.1-8b"), gpu="H100-80GB", gpus_per_node=8, seq_len=2048,
                                  global_batch=64))
    chunked = [c for c in (result.best, *result.alternatives) if c.plan.training.loss == "chunked"]
    assert chunked
    for cand in chunked:
        standard = cand.plan.with_changes(training={"loss": "standard"})
        assert estimate(standard).device_peak_bytes > result.usable_bytes >= cand.peak_bytes


def test_the_chunked_rung_costs_the_heads_recompute():
    from shardfit.fit.steptime import step_flops

    plan = fit(_long_context()).best.plan
    standard = plan.with_changes(training={"loss": "standard"})
    m, tokens = plan.model, plan.training.micro_batch * plan.training.seq_len * plan.training.grad_accum
    assert step_flops(plan)[0] - step_flops(standard)[0] == pytest.approx(2 * m.vocab_size * m.hidden_size * tokens)
    assert step_flops(plan)[1] == step_flops(standard)[1]  # MFU counts the model's FLOPs only


def test_fused_adamw_turns_a_no_fit_into_a_fit():
    # Llama-3.1-70B on 8 x B200 at seq 2048 (FSDP engines): foreach's step scratch (a full copy of the
    # AdamW states, 70.6B/8 x 4 B) puts fsdp2 over the limit; the fused step has none.
    request = dict(model=load_model_spec("llama-3.1-70b"), gpu="B200", gpus_per_node=8, seq_len=2048, engines=("fsdp",))
    # the state rungs (8-bit AdamW, pure bf16) off: with them foreach fits pure bf16 before offload
    foreach = fit(FitRequest.build(**request, optimizer_impl="foreach", rungs=()))
    fused = fit(FitRequest.build(**request))
    assert foreach.best.plan.strategy.offload_params == "cpu"  # without the fused step only offload fits
    assert not fused.best.rung  # the fused step fits with full-precision states: no rung is climbed
    assert fused.best.family == "fsdp2" and fused.best.plan.training.optimizer_impl == "fused"
    as_foreach = estimate(fused.best.plan.with_changes(training={"optimizer_impl": "foreach"}))
    assert as_foreach.device_peak_bytes > fused.usable_bytes >= fused.best.peak_bytes
    line = next(n for n in fused.notes if n.startswith("optimizer step: fused"))
    assert "it would not fit" in line


def test_the_70b_fsdp_case_of_the_issue_fits_with_neither_step_in_mixed_bf16():
    # Llama-3.1-70B on 16 x A100-80GB, seq 2048, bf16 mixed (fp32 master weights), FSDP2, AC full, micro-batch 1:
    # the fused step removes the optimizer phase's 16.4 GiB foreach copy, but backward (fp32 shards + grads +
    # states + the gathered units) still peaks above 80 GB; pure bf16 fits with either step.
    plan = plan_from_dict({"model": "llama-3.1-70b", "strategy": {"kind": "fsdp2"},
                           "cluster": {"nodes": 2, "gpus_per_node": 8, "gpu": "A100-80GB"},
                           "training": {"seq_len": 2048, "activation_checkpointing": "full"}}, resolve_model=load_model_spec)
    peaks = {impl: estimate(plan.with_changes(training={"optimizer_impl": impl})) for impl in ("foreach", "fused")}
    assert peaks["foreach"].peak_phase == "optimizer" and peaks["fused"].peak_phase == "backward"
    assert peaks["foreach"].device_peak_bytes - peaks["fused"].device_peak_bytes > 4 * GIB
    assert peaks["fused"].device_peak_bytes > 80e9
    pure = plan.with_changes(training={"precision": "bf16-pure", "optimizer_impl": "foreach"})
    assert estimate(pure).device_peak_bytes < 0.9 * 80e9


@pytest.mark.parametrize("model,gpus,engines", [("llama-3.1-8b", 8, ("fsdp",)), ("llama-3.1-8b", 8, ("deepspeed",)),
                                                 ("llama-1b", 1, ("single",)), ("llama-1b", 8, ("ddp",))])
def test_fit_and_emit_agree_on_the_optimizer_step(model, gpus, engines, tmp_path):
    from shardfit.spec.planfile import dump_plan, load_plan

    result = fit(FitRequest.build(model=load_model_spec(model), gpu="H100-80GB", gpus_per_node=gpus, seq_len=2048,
                                  engines=engines))
    plan = result.best.plan
    impl = plan.training.optimizer_impl
    assert impl == "fused"  # torch's AdamW (or DeepSpeed's FusedAdam) on every engine here
    assert any(n.startswith("optimizer step: fused") for n in result.notes)
    assert f"optimizer step {impl}" in format_text(result) and to_json(result)["best"]["optimizer_impl"] == impl
    dump_plan(plan, tmp_path / "plan.yaml")
    plan = load_plan(tmp_path / "plan.yaml")  # the choice travels with the plan file
    assert plan.training.optimizer_impl == impl
    args = json.loads(emit(plan, "hf-trainer").main)
    assert args["optim"] == "adamw_torch_fused"
    if plan.strategy.is_deepspeed:
        config = json.loads(emit(plan, "deepspeed").main)
        assert config["optimizer"]["type"] == "AdamW"  # DeepSpeed builds FusedAdam from it on CUDA
    else:
        fmt = {"single": "single", "ddp": "accelerate"}.get(plan.strategy.kind, plan.strategy.kind)
        text = emit(plan, fmt).main
        assert "fused=True" in text


def test_emit_writes_the_plans_step_and_loss_for_each_choice():
    plan = plan_from_dict({"model": "tiny-llama", "strategy": {"kind": "fsdp2"}, "cluster": {"gpus_per_node": 2}},
                          resolve_model=load_model_spec)
    for impl, keyword, optim in (("foreach", "foreach=True", "adamw_torch"), ("single", "foreach=False", "adamw_torch"),
                                 ("fused", "fused=True", "adamw_torch_fused"), ("auto", None, "adamw_torch")):
        chosen = plan.with_changes(training={"optimizer_impl": impl})
        script = emit(chosen, "fsdp2").main
        line = next(x for x in script.splitlines() if "optimizer = torch.optim.AdamW(" in x or "betas=(0.9" in x)
        assert (keyword in script) if keyword else ("fused=" not in line and "foreach=" not in line), impl
        hf = emit(chosen, "hf-trainer")
        assert json.loads(hf.main)["optim"] == optim
        assert (impl == "single") == any("single-tensor" in n for n in hf.notes)
    chunked = plan.with_changes(training={"loss": "chunked", "loss_chunks": 4})
    script = emit(chunked, "fsdp2").main
    assert "class ChunkedLinearCrossEntropy" in script and "patch_head(head, 4)" in script
    assert "model_loss(model, " in script
    assert "from shardfit" not in script and "import shardfit" not in script  # the script stands alone
    assert "class ChunkedLinearCrossEntropy" not in emit(plan, "fsdp2").main
    for fmt in ("hf-trainer", "accelerate", "lightning"):
        out = emit(chunked, fmt)
        assert any("use_liger_kernel=True" in n and "liger-kernel" in n for n in out.notes), fmt
    assert "use_liger_kernel=True" in emit(chunked, "accelerate").main  # a comment line in the YAML
