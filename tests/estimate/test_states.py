"""Model-state terms: the ZeRO paper reproduced exactly, and each engine's real rules pinned."""
import pytest

from estimate_cases import BIG, HAND, LoRA, params_plan, plan
from shardfit.estimate import estimate
from shardfit.estimate import states as sts

GB = 1e9
P = 7.5e9


def states_total(est, phase="optimizer"):
    cats = est.phases[phase]
    return cats["params"] + cats["grads"] + cats["optimizer"]


@pytest.mark.parametrize("strategy,expected_gb", [("ddp", 120.0), ("zero1", 31.4), ("zero2", 16.6), ("zero3", 1.9)])
def test_zero_paper_figure_1(strategy, expected_gb):
    # ZeRO paper Figure 1: 7.5B params, N=64, K=12 -> 120 / 31.4 / 16.6 / 1.9 GB per device.
    est = estimate(params_plan(P, strategy, 64), accounting="ideal", explain=True)
    assert round(states_total(est, "load") / GB, 1) == expected_gb
    assert est.overhead_bytes == 0 and est.phases["load"]["temporaries"] == 0
    assert est.term("ideal.model_states").inputs["K"] == 12


def test_zero_paper_formulas_exact():
    n = 64
    exact = {"ddp": 16 * P, "zero1": 4 * P + 12 * P / n, "zero2": 2 * P + 14 * P / n, "zero3": 16 * P / n}
    for strategy, value in exact.items():
        est = estimate(params_plan(P, strategy, n), accounting="ideal")
        assert abs(states_total(est, "load") - value) <= 3, strategy
    # FSDP maps onto the stages: full_shard = 3, shard_grad_op = 2, no_shard = 0.
    for strategy, same_as in (("fsdp:full_shard", "zero3"), ("fsdp:shard_grad_op", "zero2"), ("fsdp:no_shard", "ddp")):
        a = estimate(params_plan(P, strategy, n), accounting="ideal")
        b = estimate(params_plan(P, same_as, n), accounting="ideal")
        assert states_total(a, "load") == states_total(b, "load")


def test_ddp_mixed_precision_is_16_bytes_per_param_and_pure_bf16_is_8():
    est = estimate(plan(HAND, "ddp", precision="bf16"))
    n = HAND.n_params
    assert est.phases["optimizer"]["params"] == 4 * n
    assert est.phases["optimizer"]["grads"] == 4 * n
    assert est.phases["optimizer"]["optimizer"] == 8 * n
    pure = estimate(plan(HAND, "ddp", precision="bf16-pure"))
    assert states_total(pure) == 8 * n
    # torch's default: the reducer's flat buckets are a second copy of every grad, allocated at wrap
    # time; .grad tensors exist from backward to the step.
    assert est.phases["forward"]["grads"] == 0
    assert est.phases["forward"]["temporaries"] >= 4 * n and est.phases["load"]["temporaries"] == 4 * n
    view = estimate(plan(HAND, "ddp", precision="bf16").with_changes(strategy={"ddp_gradient_as_bucket_view": True}))
    assert view.phases["forward"]["grads"] == 4 * n and view.phases["load"]["temporaries"] == 0
    assert view.phase_total("optimizer") == est.phase_total("optimizer") - 4 * n


def test_fsdp_mixed_precision_keeps_fp32_shards_and_16bit_gathers():
    est = estimate(plan(BIG, "fsdp:full_shard", gpus=8, precision="bf16"), explain=True)
    n = BIG.n_params
    assert est.phases["optimizer"]["params"] == int(4 * n / 8)
    assert est.phases["optimizer"]["optimizer"] == int(8 * n / 8)
    assert est.phases["optimizer"]["grads"] == int(4 * n / 8)
    # Two 16-bit units gathered (current + prefetch), the root (embeddings + head) kept gathered.
    assert est.term("temporaries.fsdp_gathered_units").bytes == 2 * 2 * BIG.block_params
    assert est.term("temporaries.fsdp_root_unit").bytes == 2 * BIG.non_block_params
    pure = estimate(plan(BIG, "fsdp:full_shard", gpus=8, precision="bf16-pure"))
    assert states_total(pure) == int(2 * n / 8) + int(2 * n / 8) + int(4 * n / 8)
    fp32 = estimate(plan(BIG, "fsdp:full_shard", gpus=8, precision="fp32"), explain=True)
    assert fp32.term("temporaries.fsdp_gathered_units").bytes == 2 * 4 * BIG.block_params


def test_fsdp_sharding_modes():
    n = BIG.n_params
    full = estimate(plan(BIG, "fsdp:full_shard", gpus=8, nodes=2))
    hybrid = estimate(plan(BIG, "fsdp:hybrid_shard", gpus=8, nodes=2))
    no_shard = estimate(plan(BIG, "fsdp:no_shard", gpus=8, nodes=2))
    assert full.phases["load"]["params"] == int(4 * n / 16)
    assert hybrid.phases["load"]["params"] == int(4 * n / 8)  # sharded within a node of 8
    assert no_shard.phases["load"]["params"] == 4 * n
    # SHARD_GRAD_OP and fsdp2 without reshard keep every unit gathered from forward to backward.
    sgo = estimate(plan(BIG, "fsdp:shard_grad_op", gpus=8), explain=True)
    keep = estimate(plan(BIG, "fsdp2:no_reshard", gpus=8), explain=True)
    expected = 2 * (n - BIG.non_block_params)
    assert sgo.term("temporaries.fsdp_gathered_units").bytes == expected
    assert keep.term("temporaries.fsdp_gathered_units").bytes == expected
    assert sgo.phases["forward"]["temporaries"] > full.phases["forward"]["temporaries"]


def test_deepspeed_real_accounting():
    n, world = BIG.n_params, 8
    z2 = estimate(plan(BIG, "zero2", gpus=world), explain=True)
    # 16-bit params + 16-bit grad partition + fp32 grad partition + fp32 master + Adam = 2P + 18P/N
    # (the 16-bit partition and the fp32 copy exist one after the other at the step).
    z2_states = states_total(z2) + int(2 * n / world)
    assert abs(z2_states - (2 * n + 18 * n / world)) <= 4
    z1 = estimate(plan(BIG, "zero1", gpus=world))
    # DeepSpeed 0.19 reduces ZeRO-1 grads into partitions during backward, like ZeRO-2; step()
    # turns the 16-bit partition into fp32 and frees it.
    assert z1.phases["backward"]["grads"] <= int(2 * n / world)
    assert z1.phases["optimizer"]["grads"] == int(4 * n / world)
    z3 = estimate(plan(BIG, "zero3", gpus=8, nodes=2), explain=True)
    # ZeRO-3 also keeps the 16-bit param partition DeepSpeed's estimator leaves out: 20P/N, plus the
    # small persistent params (norms) on every rank.
    persistent = (2 * BIG.num_layers + 1) * BIG.hidden_size
    assert abs(states_total(z3) - 20 * n / 16) <= 8
    assert z3.phases["forward"]["params"] == z3.phases["optimizer"]["params"] + 2 * persistent
    # The fp32 gradient exists one sub-group (1e9 elements) at a time at step.
    big_part = estimate(plan(BIG, "zero3", gpus=world))
    assert big_part.phases["optimizer"]["grads"] == int(2 * n / world) + 4 * 1_000_000_000
    fp32 = estimate(plan(BIG, "zero3", gpus=8, nodes=2, precision="fp32"))
    assert fp32.phases["load"]["optimizer"] == int(12 * n / 16)  # a separate fp32 master even in fp32
    # The default buckets: ZeRO-1/2 double 5e8-element 16-bit buckets with overlap_comm -> 2 GB.
    assert z2.term("temporaries.zero_ipg_buckets").bytes == 2 * 500_000_000 * 2
    assert z3.term("temporaries.zero3_ipg_bucket").bytes == 500_000_000 * 2
    assert z3.phases["load"]["temporaries"] == 500_000_000 * 2  # allocated at init
    assert z2.phases["load"]["temporaries"] == 0  # ZeRO-1/2 allocate them in backward


def test_tiny_model_buckets_dominate():
    # engines-on-cpu.md: ~1 GB of bucket per rank in bf16 even for a 2M-parameter model.
    est = estimate(plan(HAND, "zero2", gpus=2, precision="bf16").with_changes(strategy={"overlap_comm": False}))
    assert est.phases["backward"]["temporaries"] >= 1e9
    assert est.peak_category == "temporaries"


def test_offload_moves_states_to_host_and_nvme():
    n, world = BIG.n_params, 8
    on = estimate(plan(BIG, "zero3", gpus=world))
    off = estimate(plan(BIG, "zero3+offload", gpus=world))
    persistent = (2 * BIG.num_layers + 1) * BIG.hidden_size  # norms stay gathered on the GPU
    assert off.phases["optimizer"]["optimizer"] == 0 and off.phases["optimizer"]["params"] == 2 * persistent
    assert off.host["offloaded_optimizer"] >= 16 * n / world - 8
    assert off.host["offloaded_params"] >= 2 * n / world - 8
    assert off.peak_bytes < on.peak_bytes
    nv = plan(BIG, "zero3+offload-nvme", gpus=world)
    est = estimate(nv)
    assert est.nvme_bytes >= 16 * n / world + 2 * n / world - 16
    assert est.host["nvme_swap_buffers"] > 0
    fsdp = estimate(plan(BIG, "fsdp2+offload", gpus=world))
    assert fsdp.phases["optimizer"]["params"] == 0
    assert fsdp.host["offloaded_states"] >= 16 * n / world - 8
    z2 = estimate(plan(BIG, "zero2+offload", gpus=world))
    assert z2.phases["optimizer"]["optimizer"] == 0 and z2.phases["optimizer"]["params"] == 2 * n


@pytest.mark.parametrize("optimizer,per_param", [("adamw", 8), ("adamw8bit", 2 + 8 / 256), ("sgd", 4), ("lion", 4)])
def test_optimizer_state_bytes(optimizer, per_param):
    est = estimate(plan(HAND, "ddp", optimizer=optimizer, precision="fp32"))
    assert est.phases["load"]["optimizer"] == int(per_param * HAND.n_params)


def test_adafactor_is_factored():
    ratio = sts.adafactor_ratio(BIG)
    assert 0 < ratio < 0.01
    est = estimate(plan(BIG, "ddp", optimizer="adafactor", precision="fp32"))
    assert est.phases["load"]["optimizer"] == int(4 * ratio * BIG.n_params)


def test_lora_adapter_count_from_shapes():
    # r*(in+out) per targeted projection per layer: q h->heads*hd, k/v h->kv*hd, o heads*hd->h.
    r = 8
    q, kv = 4 * 16, 2 * 16  # heads*head_dim, kv_heads*head_dim
    expected = 2 * r * ((64 + q) + 2 * (64 + kv) + (q + 64))
    assert sts.lora_adapter_params(HAND, r, ("q_proj", "k_proj", "v_proj", "o_proj")) == expected
    mlp = 2 * r * ((64 + 128) * 2 + (128 + 64))
    assert sts.lora_adapter_params(HAND, r, ("gate_proj", "up_proj", "down_proj")) == mlp
    assert sts.lora_adapter_params(HAND, r, ("all-linear",)) == expected + mlp


def test_lora_shrinks_grads_and_optimizer_and_qlora_shrinks_the_base():
    full = estimate(plan(BIG, "ddp", precision="bf16"))
    lora = LoRA(rank=16, target_modules=("q_proj", "v_proj"), base_dtype="bf16")
    est = estimate(plan(BIG, "ddp", precision="bf16").with_changes(training={"lora": lora}))
    adapters = sts.lora_adapter_params(BIG, 16, ("q_proj", "v_proj"))
    assert est.phases["optimizer"]["grads"] == 4 * adapters
    assert est.phases["optimizer"]["optimizer"] == 8 * adapters
    assert est.phases["load"]["params"] == 2 * BIG.n_params + 4 * adapters
    assert est.phases["optimizer"]["grads"] < full.phases["optimizer"]["grads"] / 100
    q = estimate(plan(BIG, "ddp", precision="bf16").with_changes(
        training={"lora": LoRA(rank=16, target_modules=("q_proj", "v_proj"), base_dtype="nf4")}))
    linear = sts.quantized_linear_params(BIG)
    # nf4 linears a bit over 0.5 B/param (plus ~1.1 KB of constants per weight); peft's
    # prepare_model_for_kbit_training upcasts the rest (embeddings, norms, head) to fp32.
    base = linear * (0.5 + 1 / 64 + 4 / (64 * 256)) + (BIG.n_params - linear) * 4
    per_weight = 1092 * sum(n for *_, n in sts.model_linears(BIG))
    assert abs(q.phases["load"]["params"] - (base + per_weight + 4 * adapters)) <= 1e5
    assert q.phases["load"]["params"] < 0.5 * est.phases["load"]["params"]
