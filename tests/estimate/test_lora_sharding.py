"""LoRA under FSDP1 / FSDP2 / ZeRO-3 as each engine really runs it (estimate/lora_sharding.py); the
measured side is tests/measure/test_engine_matrix.py (the lora-ac-none rows)."""
import pytest

from shardfit.estimate import estimate
from shardfit.estimate.lora_sharding import fsdp1_adapter_share, largest_adapter
from shardfit.estimate.lora_targets import default_lora_targets
from shardfit.estimate.states import lora_adapter_params
from shardfit.spec.models import load_model_spec
from shardfit.spec.plan import LoRA, Plan, parse_strategy

QKVO = ("q_proj", "k_proj", "v_proj", "o_proj")


def _est(model, strategy, lora, gpus=8, precision="bf16"):
    plan = Plan(model=model).with_changes(strategy=parse_strategy(strategy), cluster={"gpus_per_node": gpus},
                                          training={"lora": lora, "precision": precision, "seq_len": 2048})
    return estimate(plan, explain=True)


def test_fsdp2_reduces_only_the_adapters():
    model = load_model_spec("llama-3.1-70b")
    lora = LoRA(rank=16, target_modules=QKVO, base_dtype="nf4")
    est = _est(model, "fsdp2", lora)
    per_block = lora_adapter_params(model, 16, QKVO) // model.num_layers
    # Reduce-scatter: an fp32 copy-in of the block's adapters plus its 1/S shard, never the frozen block.
    assert est.term("temporaries.fsdp_reduce_scatter").bytes == pytest.approx(4 * per_block * (1 + 1 / 8), rel=1e-6)
    assert est.term("temporaries.fsdp_unsharded_grads").bytes == pytest.approx(2 * per_block, rel=1e-6)
    full = _est(model, "fsdp2", None)
    assert full.term("temporaries.fsdp_reduce_scatter").bytes > 100 * est.term("temporaries.fsdp_reduce_scatter").bytes


def test_fsdp1_keeps_the_whole_flat_gradient_and_uneven_adapter_state():
    model = load_model_spec("tiny-llama")
    lora = LoRA(rank=8, target_modules=QKVO, base_dtype="fp32")
    est = _est(model, "fsdp:full_shard", lora, gpus=2, precision="fp32")
    trained = lora_adapter_params(model, 8, QKVO)
    blocks = model.n_params - model.non_block_params + trained
    assert est.phases["load"]["grads"] == 4 * blocks // 2  # measured 398,336 B on tiny-llama
    # Every q/k/v/o adapter sits in the first half of its block's flat parameter: rank 0 holds them all.
    assert fsdp1_adapter_share(model, 8, QKVO, 2) == 1.0
    assert est.phases["load"]["optimizer"] == pytest.approx(8 * trained, abs=16)  # measured 114,816 B
    assert fsdp2_grads(model, lora) < est.phases["load"]["grads"] / 10
    # all-linear spreads adapters over the MLP too: the worst rank's share drops.
    assert fsdp1_adapter_share(model, 8, ("all-linear",), 2) < 1.0


def fsdp2_grads(model, lora):
    return _est(model, "fsdp2", lora, gpus=2, precision="fp32").phases["optimizer"]["grads"]


def test_zero3_lora_saves_the_frozen_linears_inputs():
    model = load_model_spec("tiny-llama")
    lora = LoRA(rank=8, target_modules=QKVO, base_dtype="fp32")
    zero3 = _est(model, "zero3", lora, gpus=2, precision="fp32").phases["forward"]["activations"]
    zero2 = _est(model, "zero2", lora, gpus=2, precision="fp32").phases["forward"]["activations"]
    full = _est(model, "zero3", None, gpus=2, precision="fp32").phases["forward"]["activations"]
    assert zero2 < zero3 < full  # measured 2,118,664 / 2,642,952 B (full fine-tune's norms also save)


def test_default_targets_are_the_models_own_attention_projections():
    assert default_lora_targets(load_model_spec("llama-3.1-8b")) == QKVO
    assert default_lora_targets(load_model_spec("gpt2-xl")) == ("c_attn",)
    assert default_lora_targets(load_model_spec("bert-large")) == ("query", "key", "value")
    assert largest_adapter(load_model_spec("tiny-llama"), 8, QKVO) == 8 * 64
