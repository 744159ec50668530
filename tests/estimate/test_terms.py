"""Each activation / temporary / overhead term pinned on a hand-made spec, and the phases' behaviour."""
import pytest

from estimate_cases import BIG, GPT, HAND, LoRA, params_plan, plan
from shardfit.estimate import PHASES, estimate
from shardfit.estimate import activations as act
from shardfit.estimate import overhead as ovh
from shardfit.estimate import temporaries as tmp

h, H, KV, HD, I, V, L = 64, 4, 2, 16, 128, 256, 2
q, kv = H * HD, KV * HD


@pytest.mark.parametrize("regime,per_token", [
    # half: fp32 norm-input copies (2 x 4h), normed + output 16-bit (4 x 2h), q/out 2h each, k/v, lse 4H,
    # rsqrt 2 x 4, SwiGLU gate/act/up/product 4 x 2I.
    ("half", 20 * h + 4 * kv + 8 * I + 4 * H + 8),
    ("fp32", 32 * h + 8 * kv + 16 * I + 4 * H + 8),
    # autocast: fp32 residual + normed, one 16-bit cast per linear (3 + 2), 16-bit projections.
    ("autocast", 30 * h + 4 * kv + 8 * I + 4 * H + 8),
])
def test_llama_block_bytes_per_token(regime, per_token):
    prof = act.activation_profile(HAND, regime, "sdpa", None)
    assert prof.block == per_token
    assert prof.block_quad == 0


def test_eager_attention_adds_s_squared_terms():
    sdpa = act.activation_profile(HAND, "half", "sdpa", None)
    eager = act.activation_profile(HAND, "half", "eager", None)
    # fp32 softmax + its 16-bit copy per head per key position; k/v repeated to all heads.
    assert eager.block_quad == (4 + 2) * H
    assert eager.block - sdpa.block == 2 * 2 * (q - kv) - 4 * H
    fp32 = act.activation_profile(HAND, "fp32", "eager", None)
    assert fp32.block_quad == 4 * H  # the fp32 softmax is the probabilities: no second copy
    long = estimate(plan(HAND, "ddp", seq_len=8192, attention="eager"))
    short = estimate(plan(HAND, "ddp", seq_len=8192, attention="sdpa"))
    assert long.phases["forward"]["activations"] > 10 * short.phases["forward"]["activations"]


def test_head_logits_and_loss():
    prof = act.activation_profile(HAND, "half", "sdpa", None)
    # The logits (16-bit) and their fp32 upcast for cross-entropy live while the loss is computed.
    assert prof.loss_fwd_temp == 2 * V + 4 * V
    assert prof.loss_bwd_temp == 8 * V
    head = dict((label, per) for label, per, _ in prof.head_items)
    assert head["loss.log_softmax_fp32"] == 4 * V
    assert head["embedding.input_ids"] == 8
    fp32 = act.activation_profile(HAND, "fp32", "sdpa", None)
    assert fp32.loss_fwd_temp == 4 * V  # .float() is a no-op: just the logits


def test_gpt2_dropout_masks_and_gelu_new():
    cuda = dict((label, per) for label, per, _ in act.activation_profile(GPT, "half", "sdpa", None, "cuda").block_items)
    cpu = dict((label, per) for label, per, _ in act.activation_profile(GPT, "half", "sdpa", None, "cpu").block_items)
    assert cuda["attn.resid_dropout_mask"] == 64  # bool mask on CUDA
    assert cpu["attn.resid_dropout_mask"] == 2 * 64  # the CPU kernel keeps a mask in the input dtype
    assert cuda["mlp.gelu_new_intermediates"] == 3 * 2 * 256
    assert "attn.math_softmax_mask_dropped" in cpu and "attn.logsumexp" in cuda


def test_moe_routes_top_k_tokens():
    moe = BIG.__class__(**{**BIG.to_dict(), "num_experts": 8, "experts_per_token": 2})
    dense = act.activation_profile(BIG, "half", "sdpa", None)
    routed = act.activation_profile(moe, "half", "sdpa", None)
    items = dict((label, per) for label, per, _ in routed.block_items)
    assert items["moe.gate_up"] == 2 * 2 * 2 * BIG.intermediate_size
    assert items["moe.router_softmax"] == 4 * 8
    assert routed.block > dense.block


def test_activation_checkpointing_keeps_block_inputs():
    none = estimate(plan(BIG, "fsdp2", seq_len=4096), explain=True)
    full = estimate(plan(BIG, "fsdp2", seq_len=4096, activation_checkpointing="full"), explain=True)
    half = estimate(plan(BIG, "fsdp2", seq_len=4096, activation_checkpointing="every-2"), explain=True)
    tokens = 4096
    blocks_full = full.term("activations.blocks").bytes
    assert blocks_full == BIG.num_layers * 2 * BIG.hidden_size * tokens  # 2*sbh per layer in 16-bit
    assert none.phases["forward"]["activations"] > half.phases["forward"]["activations"] > full.phases["forward"]["activations"]
    # During backward one block is recomputed: the backward peak is at least the states plus every
    # checkpointed input plus one full block.
    block = full.term("activations.block").bytes
    assert full.phase_total("backward") >= full.phase_total("load") + blocks_full + block
    assert act.checkpointed_blocks(32, 2) == 16 and act.checkpointed_blocks(31, 2) == 16
    assert act.checkpointed_blocks(32, 0) == 0


def test_fp32_training_keeps_4_byte_activations():
    fp32 = estimate(plan(BIG, "fsdp2", precision="fp32")).phases["forward"]["activations"]
    bf16 = estimate(plan(BIG, "fsdp2", precision="bf16")).phases["forward"]["activations"]
    assert 1.6 < fp32 / bf16 < 2.1


def test_temporaries_terms():
    assert tmp.gathered_unit_bytes(1000, 2) == 4000
    assert tmp.zero12_ipg_bucket_bytes(500_000_000, 2, overlap_comm=False) == 1_000_000_000
    assert tmp.zero12_ipg_bucket_bytes(500_000_000, 2, overlap_comm=True) == 2_000_000_000
    assert tmp.zero3_live_param_bytes(10**9, 5 * 10**7, 10**9, 2) == 2 * 10**9  # capped by max_live
    assert tmp.zero3_live_param_bytes(10**6, 5 * 10**7, 10**9, 2) == 2 * (10**6 + 5 * 10**7)
    assert tmp.ddp_bucket_bytes(100, bucket_view=True) == 0 and tmp.ddp_bucket_bytes(100, bucket_view=False) == 100
    assert tmp.optimizer_step_temp_bytes("adamw", "foreach", 1000, 4, 10) == 4000  # one copy of every state
    assert tmp.optimizer_step_temp_bytes("adamw", "single", 1000, 4, 10) == 80  # 2 x the largest tensor
    assert tmp.optimizer_step_temp_bytes("adamw", "fused", 1000, 4, 10) == 0
    assert tmp.reduce_scatter_bytes(1000, 8, 4, input_copy=True) == 4000 + 500
    assert tmp.reduce_scatter_bytes(1000, 8, 2, input_copy=False) == 250
    assert tmp.checkpoint_save_bytes("sharded", 10, 4) == 0 and tmp.checkpoint_save_bytes("full", 10, 4) == 40


def test_overhead_terms_and_cpu_device():
    assert ovh.nccl_buffer_bytes(1, 1, 1) == 0
    assert ovh.nccl_buffer_bytes(16, 2, 1) > ovh.nccl_buffer_bytes(8, 1, 1) > 0
    est = estimate(plan(BIG, "fsdp2", gpus=8))
    assert est.overhead["cuda_context"] == 512 * 2**20
    assert est.overhead["allocator_margin"] == int(0.05 * est.peak_bytes)
    assert est.device_peak_bytes == est.peak_bytes + est.overhead_bytes
    cpu = estimate(plan(BIG, "fsdp2", gpus=8), device="cpu")
    assert cpu.overhead_bytes == 0
    hybrid = estimate(plan(BIG, "fsdp:hybrid_shard", gpus=8, nodes=2))
    assert hybrid.overhead["nccl"] == 2 * (ovh.NCCL_INTRA_NODE_BYTES + ovh.NCCL_INTER_NODE_EXTRA_BYTES)


def test_phases_are_consistent():
    for strategy in ("ddp", "fsdp:full_shard", "fsdp2", "zero1", "zero2", "zero3", "zero3+offload"):
        est = estimate(plan(BIG, strategy, seq_len=2048))
        assert set(est.phases) == set(PHASES)
        assert est.phases["load"]["activations"] == 0 and est.phases["optimizer"]["activations"] == 0
        assert est.phases["forward"]["activations"] > 0
        assert est.peak_bytes == max(est.phase_total(p) for p in PHASES)
        assert est.phases["optimizer"]["grads"] >= est.phases["load"]["grads"]


def test_more_gpus_shrink_sharded_states_not_replicated_ones():
    for strategy, shrinks in (("fsdp2", True), ("zero3", True), ("ddp", False)):
        small = estimate(plan(BIG, strategy, gpus=8, nodes=1)).phases["optimizer"]
        large = estimate(plan(BIG, strategy, gpus=8, nodes=8)).phases["optimizer"]
        assert (large["optimizer"] < small["optimizer"]) == shrinks, strategy


def test_grad_accumulation_keeps_grads_through_forward():
    one = estimate(plan(BIG, "zero2", gpus=8))
    many = estimate(plan(BIG, "zero2", gpus=8, grad_accum=4))
    assert one.phases["forward"]["grads"] == 0
    assert many.phases["forward"]["grads"] == many.phases["backward"]["grads"] > 0


def test_optimizer_impl_and_reduce_dtype():
    auto = estimate(plan(BIG, "fsdp2", gpus=8), explain=True)
    assert auto.term("temporaries.optimizer_step").bytes == int(BIG.n_params / 8) * 4  # foreach on CUDA
    cpu = estimate(plan(BIG, "fsdp2", gpus=8), device="cpu", explain=True)
    # Single-tensor AdamW (shardfit's engines, CPU): sqrt + div of the largest shard at a time.
    assert cpu.term("temporaries.optimizer_step").bytes == 2 * 4 * (BIG.largest_layer_params // 8 + 1)
    ds = estimate(plan(BIG, "zero2", gpus=8), explain=True)
    assert ds.term("temporaries.optimizer_step").bytes == 0  # FusedAdam on CUDA
    ds_cpu = estimate(plan(BIG, "zero2", gpus=8), device="cpu", explain=True)
    # torch AdamW (single tensor) on DeepSpeed's one flat fp32 partition: two partition-sized copies.
    assert ds_cpu.term("temporaries.optimizer_step").bytes == 2 * 4 * int(BIG.n_params / 8)
    # FSDP reduces in fp32 under MixedPrecision: an fp32 copy of the unit's grad plus the fp32 shard.
    assert auto.term("temporaries.fsdp_reduce_scatter").bytes == int(4 * BIG.block_params + 4 * BIG.block_params / 8)
    with pytest.raises(Exception, match="optimizer_impl"):
        estimate(plan(BIG), optimizer_impl="magic")


def test_checkpoint_full_consolidates_on_host():
    est = estimate(plan(BIG, "fsdp2"), checkpoint="full")
    assert est.host["checkpoint_consolidation"] == BIG.n_params * (4 + 8)
    assert est.phases["checkpoint"]["temporaries"] == 4 * BIG.non_block_params


def test_states_only_spec_has_no_activations():
    est = estimate(params_plan(7.5e9, "zero3", 64))
    assert all(est.phases[p]["activations"] == 0 for p in PHASES)


def test_lora_activations_skip_frozen_inputs_and_qlora_dequantizes():
    lora = LoRA(rank=16, target_modules=("q_proj", "v_proj"), base_dtype="bf16")
    full = act.activation_profile(BIG, "half", "sdpa", None)
    adapted = act.activation_profile(BIG, "half", "sdpa", lora)
    assert adapted.block < full.block  # frozen down_proj does not save its input, norms skip normed
    items = dict((label, per) for label, per, _ in adapted.block_items)
    assert items["q_proj.lora_A_out"] == 4 * 16
    assert items["input_norm.out.fp32_cast_for_lora_q_proj"] == 4 * BIG.hidden_size
    q = act.activation_profile(BIG, "half", "sdpa", LoRA(rank=16, base_dtype="nf4"))
    assert q.dequant_temp > 0
    with pytest.raises(Exception, match="not a linear"):
        estimate(plan(BIG, "ddp").with_changes(training={"lora": LoRA(target_modules=("qq_proj",))}))


def test_explain_terms_have_formula_inputs_and_source():
    est = estimate(plan(BIG, "zero3", seq_len=2048), explain=True)
    names = {t.name for t in est.terms}
    assert {"states.params", "states.optimizer", "activations.block", "temporaries.zero3_live_params",
            "overhead.nccl"} <= names
    assert all(t.formula and t.source for t in est.terms)
    assert est.assumptions
    fast = estimate(plan(BIG, "zero3", seq_len=2048))
    assert fast.terms == () and fast.phases == est.phases


def test_warnings_for_whole_model_units_and_host_ram():
    est = estimate(params_plan(7.5e9, "fsdp:full_shard", 64))
    assert any("one unit" in w for w in est.warnings)
    tight = plan(BIG, "zero3+offload", gpus=8).with_changes(cluster={"host_memory_gib": 64.0})
    assert any("host RAM" in w for w in estimate(tight).warnings)
    roomy = plan(BIG, "zero3+offload", gpus=8).with_changes(cluster={"host_memory_gib": 2048.0})
    assert not estimate(roomy).warnings
