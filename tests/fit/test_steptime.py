"""The step-time model's terms, pinned: FLOPs, recompute, communication per strategy, offload."""
from dataclasses import replace

import pytest

from shardfit.fit.steptime import (CAUSAL_ATTENTION_FACTOR, comm_volume, efficiency, offload_seconds, step_flops,
                                   step_time)
from shardfit.spec.gpus import get_gpu
from shardfit.spec.models import load_model_spec
from shardfit.spec.plan import Cluster, LoRA, Plan, Training, parse_strategy

M = load_model_spec("llama-3.1-8b")


def plan(strategy="zero2", micro=1, accum=1, seq=4096, ac="none", nodes=1, gpus=8, lora=None, **changes):
    return Plan(model=M, strategy=replace(parse_strategy(strategy), **changes),
                training=Training(micro_batch=micro, grad_accum=accum, seq_len=seq, activation_checkpointing=ac, lora=lora),
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
    z2 = comm_volume(plan("zero2"))
    # DeepSpeed 0.19 all-reduces ZeRO-1/2 gradient buckets: 3P, as much as ZeRO-3 (shardfit bench measured it).
    assert z2["intra"][0] + z2["intra-tail"][0] == pytest.approx((2 * grads + weights) * ring)
    assert comm_volume(plan("zero3"))["intra"][0] == pytest.approx(3 * weights * ring)  # 1.5x the paper's ZeRO-2
    assert comm_volume(plan("fsdp:shard_grad_op"))["intra"][0] == pytest.approx(2 * weights * ring)
    # ZeRO-3 regathers for every micro-batch; ZeRO-1 reduces once per step.
    assert comm_volume(plan("zero3", accum=4))["intra"][0] == pytest.approx(4 * 3 * weights * ring)
    assert comm_volume(plan("zero1", accum=4))["intra"][0] == pytest.approx(2 * grads * ring)
    assert comm_volume(plan("zero3", gpus=1)) == {}


def test_a_reduction_held_to_the_boundary_hides_only_behind_the_last_backward():
    gpu = get_gpu("H100-80GB")
    assert comm_volume(plan("zero1", accum=8, nodes=4))["inter"][2] == "boundary"
    assert comm_volume(plan("zero2", accum=8, nodes=4))["inter"][2] == "step"
    assert comm_volume(plan("zero1", accum=8, nodes=4))["inter-tail"][2] is None
    # Same bytes on the wire, less compute to hide it behind: more of DDP's all-reduce is exposed.
    one, eight = step_time(plan("ddp", micro=1, nodes=4), gpu), step_time(plan("ddp", micro=1, accum=8, nodes=4), gpu)
    assert eight.comm_s == pytest.approx(one.comm_s)
    assert eight.exposed_comm_s > one.exposed_comm_s * 1.5


def test_hybrid_keeps_parameter_traffic_inside_the_node():
    flat = comm_volume(plan("fsdp2", nodes=4))
    hybrid = comm_volume(plan("fsdp2", nodes=4, shard_group_size=8))
    assert set(flat) == {"inter"} and set(hybrid) == {"intra", "inter"}
    assert hybrid["inter"][0] < flat["inter"][0] / 10
    gpu = get_gpu("H100-80GB")
    assert step_time(plan("fsdp2", nodes=4, shard_group_size=8), gpu).total_s < step_time(plan("fsdp2", nodes=4), gpu).total_s


def test_offload_costs_host_traffic_and_small_micro_batches_cost_efficiency():
    gpu = get_gpu("H100-80GB")
    assert offload_seconds(plan("zero3"), gpu) == 0
    opt = offload_seconds(plan("zero3+offload-opt"), gpu)
    both = offload_seconds(plan("zero3+offload"), gpu)
    nvme = offload_seconds(plan("zero3+offload-nvme"), gpu)
    assert 0 < opt < both < nvme
    assert step_time(plan("zero3+offload"), gpu).total_s > step_time(plan("zero3"), gpu).total_s
    assert efficiency(plan(micro=1, seq=512)) < efficiency(plan(micro=4, seq=2048)) == efficiency(plan(micro=1, seq=8192))
