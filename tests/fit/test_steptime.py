"""The step-time model's terms, pinned: FLOPs, recompute, communication per strategy, offload."""
from dataclasses import replace

import pytest

from shardfit.fit.steptime import (CAUSAL_ATTENTION_FACTOR, comm_parts, comm_volume, efficiency, memory_seconds,
                                   offload_seconds, step_flops, step_time)
from shardfit.spec.gpus import get_gpu
from shardfit.spec.models import load_model_spec
from shardfit.spec.plan import Cluster, LoRA, Plan, Training, parse_strategy

M = load_model_spec("llama-3.1-8b")


def plan(strategy="zero2", micro=1, accum=1, seq=4096, ac="none", nodes=1, gpus=8, lora=None, attention="sdpa", **changes):
    return Plan(model=M, strategy=replace(parse_strategy(strategy), **changes),
                training=Training(micro_batch=micro, grad_accum=accum, seq_len=seq, activation_checkpointing=ac, lora=lora,
                                  attention=attention),
                cluster=Cluster(nodes=nodes, gpus_per_node=gpus))


def test_flops_are_6_p_tokens_plus_causal_attention():
    flops, model_flops = step_flops(plan(micro=2, seq=4096))
    tokens = 2 * 4096
    attention = 3 * 4 * M.num_layers * M.hidden_size * 4096 * tokens * CAUSAL_ATTENTION_FACTOR
    assert model_flops == pytest.approx(6 * M.n_params * tokens + attention)
    assert flops == model_flops  # no recompute without checkpointing


def test_checkpointing_recomputes_one_forward_of_the_checkpointed_blocks():
    _, base = step_flops(plan())
    full, _ = step_flops(plan(ac="full"))
    half, _ = step_flops(plan(ac="every-2"))
    assert full == pytest.approx(base * 4 / 3)  # forward is a third of forward + backward
    assert half == pytest.approx(base * 7 / 6)


def test_accumulation_scales_work_and_lora_skips_weight_gradients():
    one, _ = step_flops(plan())
    four, _ = step_flops(plan(accum=4))
    assert four == pytest.approx(4 * one)
    lora, _ = step_flops(plan(lora=LoRA(rank=16)))
    assert lora == pytest.approx(one * 2 / 3)


def test_communication_volume_per_strategy():
    ring = 7 / 8
    grads = weights = M.n_params * 2
    assert comm_volume(plan("ddp"))["intra"][0] == pytest.approx(2 * grads * ring)
    # DeepSpeed 0.19 all-reduces ZeRO-1/2 gradient buckets: 3P, as much as ZeRO-3 (shardfit bench measured it).
    assert comm_volume(plan("zero2"))["intra"][0] == pytest.approx((2 * grads + weights) * ring)
    assert comm_volume(plan("zero3"))["intra"][0] == pytest.approx(3 * weights * ring)  # 1.5x the paper's ZeRO-2
    assert comm_volume(plan("fsdp:shard_grad_op"))["intra"][0] == pytest.approx(2 * weights * ring)
    # ZeRO-3 regathers for every micro-batch; ZeRO-1 reduces once per step.
    assert comm_volume(plan("zero3", accum=4))["intra"][0] == pytest.approx(4 * 3 * weights * ring)
    assert comm_volume(plan("zero1", accum=4))["intra"][0] == pytest.approx((2 * grads + weights) * ring)
    assert comm_volume(plan("zero3", gpus=1)) == {}


def test_zero3_keeps_small_models_gathered_for_backward_as_bench_counts_it():
    small = Plan(model=load_model_spec("gpt2-large"), strategy=parse_strategy("zero3"),
                 cluster=Cluster(nodes=1, gpus_per_node=8))
    weights = small.model.n_params * 2
    # At DeepSpeed's default max_reuse_distance (1e9) a 774M model is never re-gathered: 2P, not 3P.
    assert comm_volume(small)["intra"][0] == pytest.approx(2 * weights * 7 / 8)
    assert comm_volume(replace(small, strategy=replace(small.strategy, max_reuse_distance=0)))["intra"][0] == \
        pytest.approx(3 * weights * 7 / 8)


def test_gradient_traffic_hides_only_behind_backward():
    windows = {p.window for p in comm_parts(plan("ddp"))}
    assert windows == {"backward"}
    fsdp = comm_parts(plan("fsdp2"))
    assert [p.window for p in fsdp] == ["forward", "backward"]
    assert fsdp[0].bytes == pytest.approx(M.n_params * 2 * 7 / 8)  # forward: the all-gather alone


def test_a_reduction_held_to_the_boundary_hides_only_behind_the_last_backward():
    gpu = get_gpu("H100-80GB")
    assert [p.window for p in comm_parts(plan("zero1", accum=8, nodes=4))] == ["boundary", None]
    assert [p.window for p in comm_parts(plan("zero2", accum=8, nodes=4))] == ["backward", None]
    # DDP under no_sync: the same bytes hide behind one backward whether or not it accumulates; ZeRO-2
    # reduces after every micro-batch: 8x the bytes, spread over 8 backwards.
    one, eight = step_time(plan("ddp", micro=1, nodes=4), gpu), step_time(plan("ddp", micro=1, accum=8, nodes=4), gpu)
    assert eight.comm_s == pytest.approx(one.comm_s) and eight.exposed_comm_s == pytest.approx(one.exposed_comm_s)
    z2 = comm_parts(plan("zero2", accum=8, nodes=4))[0]
    assert z2.bytes == pytest.approx(8 * comm_parts(plan("zero2", nodes=4))[0].bytes)


def test_a_ring_across_nodes_shares_the_node_nics():
    gpu = get_gpu("A100-80GB")
    # One ring over 4 nodes: the per-rank volume leaves each node once, over its 8 NICs together.
    one_node, four_nodes = step_time(plan("fsdp2", gpus=8), gpu), step_time(plan("fsdp2", nodes=4), gpu)
    ring = (31 / 32) / (7 / 8)
    assert four_nodes.comm_s == pytest.approx(one_node.comm_s * ring * 300 / (8 * 25), rel=0.01)
    # Hybrid's replica all-reduce runs on each rank's own NIC.
    assert {p.link for p in comm_parts(plan("fsdp2", nodes=4, shard_group_size=8))} == {"intra", "nic"}


def test_memory_bound_kernels_cost_more_with_eager_attention_and_more_tokens():
    gpu = get_gpu("A100-80GB")
    sdpa, eager = memory_seconds(plan(seq=4096), gpu), memory_seconds(plan(seq=4096, attention="eager"), gpu)
    assert 0 < sdpa < eager
    assert memory_seconds(plan(micro=2), gpu) == pytest.approx(2 * memory_seconds(plan(micro=1), gpu), rel=0.01)
    assert memory_seconds(plan(ac="full"), gpu) > memory_seconds(plan(), gpu)  # recompute writes it again


def test_hybrid_keeps_parameter_traffic_inside_the_node():
    flat = comm_volume(plan("fsdp2", nodes=4))
    hybrid = comm_volume(plan("fsdp2", nodes=4, shard_group_size=8))
    assert set(flat) == {"inter"} and set(hybrid) == {"intra", "nic"}
    # Each NIC carries less than its share (one of 8) of the flat ring's node-boundary traffic.
    assert hybrid["nic"][0] < flat["inter"][0] / 8


def test_offload_costs_host_traffic_and_small_micro_batches_cost_efficiency():
    gpu = get_gpu("H100-80GB")
    assert offload_seconds(plan("zero3"), gpu) == 0
    opt = offload_seconds(plan("zero3+offload-opt"), gpu)
    both = offload_seconds(plan("zero3+offload"), gpu)
    nvme = offload_seconds(plan("zero3+offload-nvme"), gpu)
    assert 0 < opt < both < nvme
    assert step_time(plan("zero3+offload"), gpu).total_s > step_time(plan("zero3"), gpu).total_s
    assert efficiency(plan(micro=1, seq=512)) < efficiency(plan(micro=4, seq=2048)) == efficiency(plan(micro=1, seq=8192))


def _ds_plan(kind: str, model: str = "gpt2-xl", **strategy) -> Plan:
    return Plan(model=load_model_spec(model)).with_changes(
        strategy={"kind": kind, **strategy}, cluster={"nodes": 1, "gpus_per_node": 16, "gpu": "V100-32GB"},
        training={"micro_batch": 1, "seq_len": 1024, "precision": "fp16", "grad_accum": 2})


def test_deepspeed_hooks_cost_per_tensor_and_per_submodule():
    from shardfit.fit.engine_overhead import DS_GRAD_HOOK_S, DS_ZERO3_FETCH_S, fetch_units, trained_tensors

    gpu = get_gpu("V100-32GB")
    z1 = step_time(_ds_plan("zero1", overlap_comm=False), gpu)
    z2 = step_time(_ds_plan("zero2"), gpu)
    z3 = step_time(_ds_plan("zero3"), gpu)
    assert z1.host_s == 0.0  # no gradient hooks without overlap_comm (stage_1_and_2.py)
    plan = _ds_plan("zero2")
    assert trained_tensors(plan) == 48 * 12 + 4  # GPT-2 block: 4 linears + 2 LayerNorms, weight and bias each
    assert z2.host_s == pytest.approx(2 * trained_tensors(plan) * DS_GRAD_HOOK_S)  # per micro-batch
    assert z3.host_s == pytest.approx(z2.host_s + 2 * 2 * fetch_units(plan) * DS_ZERO3_FETCH_S)
    assert step_time(_ds_plan("fsdp2"), gpu).host_s == 0.0 and step_time(_ds_plan("ddp"), gpu).host_s == 0.0
    assert z3.total_s == pytest.approx(z3.compute_s + z3.exposed_comm_s + z3.offload_s + z3.optimizer_s + z3.host_s)


def test_zero3_all_gathers_coalesce_up_to_the_prefetch_bucket():
    from shardfit.fit.steptime import comm_parts

    def gathers(bucket: int) -> int:
        return comm_parts(_ds_plan("zero3", prefetch_bucket_size=bucket))[0].collectives

    n_params = load_model_spec("gpt2-xl").n_params
    # per forward and micro-batch: parameters / bucket coalesced all-gathers plus the first fetch
    assert gathers(50_000_000) == 2 * (-(-n_params // 50_000_000) + 1)
    # a bucket smaller than one MLP linear (1600 x 6400): one all-gather per such submodule at least
    assert gathers(1_000_000) >= 2 * 48 * 2
    assert gathers(1_000_000) > gathers(50_000_000)


def test_selective_dispatch_adds_on_cpu_and_hides_behind_big_kernels_on_a_gpu():
    from shardfit.estimate.selective import selective_block_ops
    from shardfit.fit.engine_overhead import SAC_DISPATCH_S, sac_dispatch_seconds

    def plan(model, ac, gpu="H100-80GB"):
        return Plan(model=load_model_spec(model)).with_changes(
            strategy={"kind": "fsdp2"}, cluster={"nodes": 1, "gpus_per_node": 8, "gpu": gpu},
            training={"micro_batch": 1, "seq_len": 4096 if model.startswith("llama") else 64, "precision": "bf16",
                      "activation_checkpointing": ac, "grad_accum": 2})

    h100 = get_gpu("H100-80GB")
    big = plan("llama-3.1-8b", "selective")
    assert step_time(big, h100).host_s == 0.0  # a block's kernels take far longer than its ~70 dispatches
    tiny = plan("tiny-llama", "selective")
    ops = selective_block_ops(tiny.model, "half", "sdpa")
    assert 60 <= ops <= 90
    exposed = step_time(tiny, h100).host_s
    assert 0 < exposed <= 2 * 4 * ops * SAC_DISPATCH_S * 2  # forward + recompute, 4 blocks, accumulation 2
    assert step_time(plan("tiny-llama", "full"), h100).host_s == 0.0
    # on a CPU device the dispatch runs on the cores that compute: all of it adds
    from shardfit.spec.gpus import MeasuredRates
    from dataclasses import replace as dc_replace
    rates = MeasuredRates(device="cpu", matmul=(("bf16", 64, 64, 1e-3),), memory_gbs=5.0, links=(("intra", 1.0, 1e-4),),
                          comm_overlap=0.0, host_link_gbs=None, optimizer_params_per_s=1e8, cpu_adam_params_per_s=1e8,
                          hooks=(("sac_dispatch_per_op", 40e-6),))
    cpu = dc_replace(h100, measured=rates)
    assert sac_dispatch_seconds(tiny, cpu, block_forward_s=1.0) == pytest.approx(2 * 4 * ops * 40e-6 * 2)


def _measured(device: str, **hooks):
    from shardfit.spec.gpus import MeasuredRates

    return replace(get_gpu("H100-80GB"), measured=MeasuredRates(
        device=device, matmul=(("bf16", 64, 64, 1e-3), ("fp32", 64, 64, 1e-3)), memory_gbs=5.0,
        links=(("intra", 1.0, 1e-4),), comm_overlap=0.0, host_link_gbs=None, optimizer_params_per_s=1e8,
        cpu_adam_params_per_s=1e8, hooks=tuple(hooks.items())))


def _tiny(strategy="ddp", ac="none", accum=1, **changes):
    return Plan(model=load_model_spec("tiny-llama")).with_changes(
        strategy=replace(parse_strategy(strategy), **changes), cluster={"nodes": 1, "gpus_per_node": 2},
        training={"micro_batch": 1, "seq_len": 64, "precision": "fp32", "activation_checkpointing": ac,
                  "grad_accum": accum})


def test_eager_host_work_scales_with_the_traced_ops_and_hides_behind_big_kernels_on_a_gpu():
    from shardfit.estimate.selective import selective_block_ops
    from shardfit.fit.engine_overhead import eager_seconds

    hooks = {"eager_forward_op": 5e-6, "eager_backward_op": 4e-6, "eager_recompute_op": 20e-6, "eager_head_ops": 50.0}
    cpu = _measured("cpu", **hooks)
    ops = selective_block_ops(load_model_spec("tiny-llama"), "fp32", "sdpa")
    none = eager_seconds(_tiny(), cpu, 1.0, 1.0)
    assert none == pytest.approx(4 * ops * 9e-6 + 50 * 9e-6)  # 4 blocks' forward + backward, and the head's
    assert eager_seconds(_tiny(ac="full"), cpu, 1.0, 1.0) == pytest.approx(none + 4 * ops * 20e-6)
    assert eager_seconds(_tiny(ac="every-2"), cpu, 1.0, 1.0) == pytest.approx(none + 2 * ops * 20e-6)
    assert eager_seconds(_tiny(accum=4), cpu, 1.0, 1.0) == pytest.approx(4 * none)
    # A GPU's host issues ahead: a block whose kernels outlast its dispatch exposes nothing of it.
    gpu = _measured("cuda", **hooks)
    assert eager_seconds(_tiny(), gpu, 1.0, 1.0) == pytest.approx(50 * 9e-6)
    assert eager_seconds(_tiny(), gpu, 0.0, 0.0) == pytest.approx(none)
    assert eager_seconds(_tiny(), get_gpu("H100-80GB"), 0.0, 0.0) == 0.0  # the catalog charges none


def test_wrapper_host_work_per_gradient_and_per_unit():
    from shardfit.fit.engine_overhead import trained_tensors, wrapper_seconds

    cpu = _measured("cpu", ddp_grad_hook=20e-6, fsdp2_unit_micro=3e-3, fsdp2_unit_step=2e-3,
                    fsdp2_no_reshard_unit_micro=2e-3, fsdp2_no_reshard_unit_step=1e-3,
                    fsdp_shard_grad_op_unit_micro=1e-3, fsdp_shard_grad_op_unit_step=0.5e-3)
    tensors = trained_tensors(_tiny())
    assert wrapper_seconds(_tiny(accum=2), cpu, 0.0) == pytest.approx(2 * tensors * 20e-6)
    units = 4 + 1  # the blocks and the root
    assert wrapper_seconds(_tiny("fsdp2", accum=2), cpu, 0.0) == pytest.approx(units * (2 * 3e-3 + 2e-3))
    kept = wrapper_seconds(_tiny("fsdp2", accum=2, reshard_after_forward=False), cpu, 0.0)
    assert kept == pytest.approx(units * (2 * 2e-3 + 1e-3))  # FSDP2 without resharding: its own figures
    assert wrapper_seconds(_tiny("fsdp:shard_grad_op"), cpu, 0.0) == pytest.approx(units * 1.5e-3)
    assert wrapper_seconds(_tiny("fsdp:full_shard"), cpu, 0.0) == 0.0  # not in this profile: nothing charged
    # A GPU's host issues ahead: a unit's host work under its block's kernels is hidden.
    gpu = _measured("cuda", fsdp2_unit_micro=3e-3, fsdp2_unit_step=2e-3)
    assert wrapper_seconds(_tiny("fsdp2"), gpu, 1.0) == 0.0
    assert wrapper_seconds(_tiny("fsdp2"), gpu, 1e-3) == pytest.approx(units * (2e-3 + 1e-3))
    assert wrapper_seconds(_tiny("fsdp2"), get_gpu("H100-80GB"), 0.0) == 0.0
