"""The traced step (fake tensors, no memory) allocates what a real CPU step allocates."""
import pytest

torch = pytest.importorskip("torch")

from shardfit.engines.base import apply_activation_checkpointing, apply_lora  # noqa: E402
from shardfit.errors import ShardfitError  # noqa: E402
from shardfit.measure.traced import run_tracked_step, trace_step  # noqa: E402
from shardfit.modeling import block_classes, build_model  # noqa: E402
from shardfit.spec.models import model_spec_for  # noqa: E402
from shardfit.spec.plan import parse_activation_checkpointing, plan_from_dict  # noqa: E402

B, S = 2, 64


def real_saved_bytes(model, input_ids) -> int:
    """Ground truth independent of traced.py: unique storages autograd keeps for backward in a
    real forward, by real data pointer, parameters and buffers excluded."""
    held = {t.untyped_storage().data_ptr() for t in (*model.parameters(), *model.buffers())}
    seen, keep = {}, []

    def pack(tensor):
        ptr = tensor.untyped_storage().data_ptr()
        if ptr not in held and ptr not in seen:
            seen[ptr] = tensor.untyped_storage().nbytes()
            keep.append(tensor)
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        model(input_ids=input_ids, labels=input_ids).loss.backward()
    return sum(seen.values())


def real_model(name, ac, precision):
    model = build_model(name, device="cpu", dtype="fp32" if precision == "fp32" else "bf16", seed=0)
    every = parse_activation_checkpointing(ac)
    if every:
        apply_activation_checkpointing(model, tuple(block_classes(model, model_spec_for(name))), every)
    return model


CASES = [("tiny-llama", "none", "fp32"), ("tiny-llama", "every-2", "bf16"),
         ("tiny-gpt2", "full", "fp32"), ("tiny-gpt2", "none", "bf16")]


@pytest.mark.parametrize("name,ac,precision", CASES)
def test_traced_step_equals_real_cpu_step(name, ac, precision):
    traced = trace_step(name, micro_batch=B, seq_len=S, activation_checkpointing=ac, precision=precision)
    ids = torch.randint(0, 256, (B, S))
    model = real_model(name, ac, precision)
    real = run_tracked_step(model, ids, torch.optim.AdamW(model.parameters(), foreach=False))
    got = traced["bytes"]
    assert got["activations"] == pytest.approx(real["after_forward"]["activations"], rel=0.02)
    assert traced["backward_peak"] == pytest.approx(real["backward_peak"]["total"], rel=0.02)
    assert traced["saved_for_backward"] == pytest.approx(real_saved_bytes(real_model(name, ac, precision), ids), rel=0.02)
    # States are exact: tied weights once, grads like params, AdamW 2 moments + a 4-byte step each.
    spec = model_spec_for(name)
    width = 4 if precision == "fp32" else 2
    assert got["params"] == got["grads"] == width * spec.n_params
    n_tensors = len(list(model.parameters()))
    assert got["optimizer"] == 2 * width * spec.n_params + 4 * n_tensors
    assert got["activations"] > 0 and got["temporaries"] > 0
    assert traced["step_peak"] >= traced["backward_peak"] >= got["params"] + got["grads"]


def test_checkpointing_shrinks_activations_in_order():
    acts = {ac: trace_step("tiny-llama", B, S, ac, "fp32", optimizer=False)["bytes"]["activations"]
            for ac in ("none", "every-2", "full")}
    assert acts["full"] < acts["every-2"] < acts["none"]
    # full recompute keeps about one block input (b*s*h fp32) per layer plus the logits and loss
    spec = model_spec_for("tiny-llama")
    logits = B * S * spec.vocab_size * 4
    assert acts["full"] < logits + 3 * spec.num_layers * B * S * spec.hidden_size * 4


def test_autocast_keeps_fp32_params_and_16bit_activations():
    plain = trace_step("tiny-llama", B, S, "none", "fp32", optimizer=False)["bytes"]
    auto = trace_step("tiny-llama", B, S, "none", "bf16", optimizer=False, autocast=True)["bytes"]
    assert auto["params"] == plain["params"]
    assert auto["activations"] < plain["activations"]


def test_plan_supplies_the_training_knobs():
    plan = plan_from_dict({"model": "tiny-gpt2", "training": {"micro_batch": 1, "seq_len": 32, "precision": "fp32",
                                                              "activation_checkpointing": "full"}},
                          resolve_model=model_spec_for)
    from_plan = trace_step(plan, optimizer=False)
    explicit = trace_step("tiny-gpt2", 1, 32, "full", "fp32", optimizer=False)
    assert (from_plan["micro_batch"], from_plan["seq_len"], from_plan["activation_checkpointing"]) == (1, 32, "full")
    assert from_plan["bytes"] == explicit["bytes"]
    assert trace_step(plan, seq_len=64, optimizer=False)["bytes"]["activations"] > explicit["bytes"]["activations"]


def test_lora_plan_traces_frozen_base_and_adapter_states():
    plan = plan_from_dict({"model": "tiny-llama", "training": {"micro_batch": B, "seq_len": S, "precision": "fp32",
                                                               "activation_checkpointing": "full", "lora": {"rank": 4}}},
                          resolve_model=model_spec_for)
    traced = trace_step(plan)
    model = build_model("tiny-llama", device="cpu", seed=0)
    blocks = tuple(block_classes(model))
    model = apply_lora(plan, model)
    apply_activation_checkpointing(model, blocks, 1)
    adapters = [p for p in model.parameters() if p.requires_grad]
    real = run_tracked_step(model, torch.randint(0, 256, (B, S)), torch.optim.AdamW(adapters, foreach=False))
    got = traced["bytes"]
    assert got["activations"] == pytest.approx(real["after_forward"]["activations"], rel=0.02)
    assert traced["backward_peak"] == pytest.approx(real["backward_peak"]["total"], rel=0.02)
    n_adapter = sum(p.numel() for p in adapters)
    assert 0 < n_adapter < model_spec_for("tiny-llama").n_params // 5
    assert got["grads"] == 4 * n_adapter and got["optimizer"] == 8 * n_adapter + 4 * len(adapters)
    assert got["params"] == 4 * (model_spec_for("tiny-llama").n_params + n_adapter)


@pytest.mark.parametrize("kwargs,fragment", [
    ({"model_or_plan": "tiny-mixtral"}, "mixture-of-experts"),
    ({"model_or_plan": "tiny-llama", "precision": "int4"}, "precision 'int4'"),
    ({"model_or_plan": "tiny-llama", "seq_len": 100_000}, "exceeds"),
    ({"model_or_plan": "tiny-llama", "seq_len": 32, "activation_checkpointing": "sometimes"}, "every-N"),
    ({"model_or_plan": "no-such-model"}, "unknown model"),
])
def test_bad_trace_requests_are_one_line_errors(kwargs, fragment):
    with pytest.raises(ShardfitError) as info:
        trace_step(**kwargs)
    assert fragment in str(info.value) and "\n" not in str(info.value)
