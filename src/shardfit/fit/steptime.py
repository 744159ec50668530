"""Step-time model: ranks plans by predicted seconds per optimizer step. Analytic; no torch.

time = compute + exposed communication + offload traffic + optimizer update, per rank. It ranks
plans against each other; it is not a promise of absolute speed (`fit --verify` measures that).
Every constant below says where it comes from.
"""
from __future__ import annotations

from dataclasses import dataclass

from shardfit.estimate.states import lora_adapter_params
from shardfit.spec.gpus import GPU, get_gpu
from shardfit.spec.plan import Plan, is_selective_ac, parse_activation_checkpointing

# Model FLOPs utilisation of a well-tuned dense decoder step at large micro-batch: published
# Llama/Megatron/torchtitan runs on A100/H100 report 35-55% MFU; 0.45 is the middle.
BASE_EFFICIENCY = 0.45
# Below this many tokens per micro-batch the matmuls get thin and efficiency falls (roughly with
# the square root of the shortfall); a 1x512 micro-batch runs at about half the rate of 1x8192.
EFFICIENCY_FULL_TOKENS = 8192
# fp32 runs on TF32 tensor cores at about half the 16-bit rate (A100/H100 datasheets).
FP32_RATE_FACTOR = 0.5
# Causal attention with FlashAttention/SDPA skips the masked upper triangle: about half the s² work.
CAUSAL_ATTENTION_FACTOR = 0.5
# Fraction of overlappable communication hidden behind compute when the engine overlaps
# (DDP buckets, ZeRO overlap_comm, FSDP prefetch). Measured overlap in the field is 60-90%.
OVERLAP = 0.8
# Collective launch latency: NCCL ring all-gather/reduce-scatter of a small message takes
# ~10-30 µs inside a node and ~30-60 µs across nodes.
LATENCY_INTRA_S = 20e-6
LATENCY_INTER_S = 40e-6
# Achieved bus bandwidth of NCCL rings is ~70-85% of the link's datasheet rate (nccl-tests).
LINK_EFFICIENCY = 0.8
# DeepSpeed CPU Adam updates ~1 billion parameters/s per rank with a few cores (DeepSpeed
# ZeRO-Offload paper, arXiv 2101.06840: ~1.2 B/s on 2 cores per GPU); torch's plain CPU Adam is ~5x slower.
CPU_ADAM_PARAMS_PER_S = 1.0e9
# A local NVMe drive per GPU: ~3 GB/s sequential (ZeRO-Infinity, arXiv 2104.07857, used 2-3 GB/s per GPU).
NVME_GBS = 3.0
# Pinned host copies reach ~80% of the PCIe rate.
HOST_LINK_EFFICIENCY = 0.8
# A fused Adam step on the GPU touches about 36 bytes per trained parameter (read p16, g, p32, m, v;
# write p32, m, v, p16) and is memory-bandwidth bound.
ADAM_BYTES_PER_PARAM = 36
GB = 1e9


@dataclass(frozen=True, kw_only=True)
class StepTime:
    """Seconds per optimizer step on one rank, split into the parts that add up to `total_s`."""
    compute_s: float
    comm_s: float  # all communication volume over its link, before overlap
    exposed_comm_s: float  # the part not hidden behind compute
    offload_s: float
    optimizer_s: float
    tokens: int  # tokens per rank per optimizer step
    flops: float  # per rank per optimizer step, including recompute
    model_flops: float  # per rank, without recompute (what MFU counts)
    comm_bytes: float
    efficiency: float

    @property
    def total_s(self) -> float:
        return self.compute_s + self.exposed_comm_s + self.offload_s + self.optimizer_s

    def tokens_per_s(self, world_size: int) -> float:
        return self.tokens * world_size / self.total_s if self.total_s > 0 else 0.0

    def mfu(self, gpu: GPU) -> float:
        return self.model_flops / (self.total_s * gpu.bf16_tflops * 1e12) if self.total_s > 0 else 0.0


def trained_params(plan: Plan) -> int:
    """Parameters with gradients and optimizer state: all of them, or the LoRA adapters."""
    lora = plan.training.lora
    if lora is None or not plan.model.has_shape:
        return plan.model.n_params
    return max(lora_adapter_params(plan.model, lora.rank, lora.target_modules), 1)


def step_flops(plan: Plan) -> tuple[float, float]:
    """(FLOPs with recompute, model FLOPs) per rank per optimizer step.

    Dense matmuls: 2·P per token forward and 4·P backward (6·P·tokens, Kaplan et al. 2020); with
    LoRA the frozen base skips its weight gradients, so backward is ~2·P. Attention scores and
    values: 4·s·h per token per layer forward (2·s²·h each for QKᵀ and AV per sequence), three
    times that for forward + backward (the "12·L·h·s²·b" rule), halved for causal kernels.
    Activation checkpointing re-runs the forward of the checkpointed blocks once more.
    """
    m, t = plan.model, plan.training
    micro_tokens = t.micro_batch * t.seq_len
    attention_fwd = 0.0
    if m.has_shape:
        causal = CAUSAL_ATTENTION_FACTOR if m.causal_lm else 1.0
        attention_fwd = 4.0 * m.num_layers * m.hidden_size * t.seq_len * micro_tokens * causal
    dense_fwd = 2.0 * m.n_params * micro_tokens
    if m.num_experts and m.experts_per_token and m.has_shape:
        # Only the routed experts run per token: scale the expert share of the parameters.
        expert_share = m.num_layers * m.num_experts * 3 * m.hidden_size * (m.intermediate_size or 4 * m.hidden_size)
        active = m.n_params - expert_share * (1 - m.experts_per_token / m.num_experts)
        dense_fwd = 2.0 * max(active, m.n_params * 0.05) * micro_tokens
    forward = dense_fwd + attention_fwd
    backward_factor = 1.0 if t.lora is not None else 2.0
    every = parse_activation_checkpointing(t.activation_checkpointing)
    model_flops = forward * (1.0 + backward_factor)
    if every and is_selective_ac(t.activation_checkpointing):
        # Per-op SAC recomputes every other matmul and the cheap elementwise ops; attention is kept.
        flops = model_flops + 0.5 * dense_fwd
    else:
        flops = model_flops + (forward / every if every else 0.0)
    return flops * t.grad_accum, model_flops * t.grad_accum


def backward_share(plan: Plan) -> float:
    """Backward's share of a micro-batch's compute (recompute under AC runs in backward): what a
    reduction issued from the last micro-batch's backward hooks can overlap."""
    backward = 1.0 if plan.training.lora is not None else 2.0
    ac = plan.training.activation_checkpointing
    every = parse_activation_checkpointing(ac)
    recompute = (0.5 if is_selective_ac(ac) else 1.0 / every) if every else 0.0
    return (backward + recompute) / (1.0 + backward + recompute)


def efficiency(plan: Plan) -> float:
    tokens = plan.training.micro_batch * plan.training.seq_len
    return BASE_EFFICIENCY * min(1.0, tokens / EFFICIENCY_FULL_TOKENS) ** 0.5


def _param_bytes(plan: Plan) -> float:
    """Bytes per parameter of the copy that is gathered/communicated (16-bit unless fp32)."""
    t = plan.training
    if t.lora is not None and t.lora.base_dtype in ("int8", "nf4"):
        return 1.0 if t.lora.base_dtype == "int8" else 0.5
    return 4.0 if t.precision == "fp32" else 2.0


# What communication can hide behind: the whole step's compute (traffic spread over every
# micro-batch), only the last micro-batch's backward (a reduction held back to the accumulation
# boundary: DDP under no_sync, ZeRO-1), or nothing (the ZeRO-1/2 all-gather after the step).
WINDOW_STEP, WINDOW_BOUNDARY, WINDOW_NONE = "step", "boundary", None


def comm_volume(plan: Plan) -> dict[str, tuple[float, int, str | None]]:
    """Bytes each rank sends per optimizer step, per link: {"intra"|"inter": (bytes, collectives,
    window)}, window being the compute that traffic can overlap (WINDOW_*). Ring collectives move
    (N-1)/N of the buffer per rank for all-gather and reduce-scatter, twice that for all-reduce
    (ZeRO paper §7)."""
    s, t, c, m = plan.strategy, plan.training, plan.cluster, plan.model
    n = c.world_size
    if n == 1:
        return {}
    accum = t.grad_accum
    weights = m.n_params * _param_bytes(plan)
    grads = trained_params(plan) * (4.0 if t.precision == "fp32" else 2.0)
    ring = (n - 1) / n
    units = (m.num_layers or 1) + 1
    volume = 0.0
    collectives = 0
    tail = 0.0  # ZeRO-1/2 parameter all-gather after the optimizer step: nothing left to overlap with
    window = WINDOW_STEP
    if s.kind == "ddp":
        # Gradient all-reduce once per optimizer step (no_sync during accumulation), in buckets.
        volume = 2 * grads * ring
        collectives = max(1, int(grads / (s.ddp_bucket_cap_mb * 2**20)))
        window = WINDOW_BOUNDARY if accum > 1 else WINDOW_STEP
    elif s.kind in ("zero1", "zero2"):
        # ZeRO-1 reduces at the boundary; ZeRO-2 every micro-batch (it can't keep full grads). DeepSpeed
        # 0.19 reduces each bucket with an all-reduce (average_tensor -> allreduce_and_scatter, since
        # use_multi_rank_bucket_allreduce defaults on), not the paper's reduce-scatter: 2x the gradient
        # bytes, so ZeRO-1/2 move 3P per step, not 2P (measured 1.5x by `shardfit bench`; README, bench section).
        reductions = 1 if s.kind == "zero1" else accum
        volume = 2 * grads * ring * reductions
        window = WINDOW_BOUNDARY if reductions == 1 and accum > 1 else WINDOW_STEP
        collectives = reductions * max(1, int(grads / 2 / max(s.reduce_bucket_size, 1)))
        tail = weights * ring
        collectives += max(1, int(weights / 2 / max(s.allgather_bucket_size, 1)))
    elif s.kind == "zero3" or (s.kind in ("fsdp", "fsdp2")):
        regather = s.kind == "zero3" or (s.kind == "fsdp" and s.sharding in ("full_shard", "hybrid_shard")) or (
            s.kind == "fsdp2" and s.reshard_after_forward)
        if s.kind == "fsdp" and s.sharding == "no_shard":
            volume, collectives = 2 * grads * ring * accum, units * accum
        else:
            gathers = 2 if regather else 1
            group = _shard_group(plan)
            if group < n:
                # Hybrid: shard inside the group over fast links, all-reduce the shards across groups.
                intra = (weights * gathers + grads) * (group - 1) / group * accum
                replicas = n // group
                inter = 2 * grads / group * (replicas - 1) / replicas * accum
                return {"intra": (intra, units * (gathers + 1) * accum, WINDOW_STEP),
                        "inter": (inter, units * accum, WINDOW_STEP)}
            volume = (weights * gathers + grads) * ring * accum
            collectives = units * (gathers + 1) * accum
    link = "inter" if c.nodes > 1 else "intra"
    out = {link: (volume, collectives, window)}
    if tail:
        out[link + "-tail"] = (tail, 1, WINDOW_NONE)
    return out


def _shard_group(plan: Plan) -> int:
    s, c = plan.strategy, plan.cluster
    if s.kind in ("fsdp", "fsdp2") and (s.sharding == "hybrid_shard" or s.shard_group_size):
        return s.shard_group_size or c.gpus_per_node
    return c.world_size


def offload_seconds(plan: Plan, gpu: GPU) -> float:
    """Host-link (and NVMe) traffic plus CPU Adam, per optimizer step, not overlapped: DeepSpeed
    and FSDP run the offloaded optimizer step after backward (ZeRO-Offload's one-step delay is off
    by default)."""
    s, t, c = plan.strategy, plan.training, plan.cluster
    if not (s.offload_optimizer or s.offload_params):
        return 0.0
    n = c.world_size
    host_bps = gpu.host_link_gbs * GB * HOST_LINK_EFFICIENCY
    trained = trained_params(plan) / n
    seconds = 0.0
    optimizer_device = s.offload_optimizer or (s.offload_params if s.kind in ("fsdp", "fsdp2") else None)
    if optimizer_device:
        # Gradients down (fp32 on the host side: 4 B) and updated 16-bit parameters back up (2 B).
        moved = trained * 6
        seconds += moved / host_bps + trained / CPU_ADAM_PARAMS_PER_S
        if optimizer_device == "nvme":
            # Optimizer state (12 B/param fp32 master + moments) read and written every step.
            seconds += trained * 24 / (NVME_GBS * GB)
    if s.offload_params:
        # Parameter shards uploaded for the forward and again for the backward of every micro-batch.
        moved = plan.model.n_params / n * _param_bytes(plan) * 2 * t.grad_accum
        seconds += moved / host_bps
        if s.offload_params == "nvme":
            seconds += moved / (NVME_GBS * GB)
    return seconds


def optimizer_seconds(plan: Plan, gpu: GPU) -> float:
    s = plan.strategy
    if s.offload_optimizer or (s.kind in ("fsdp", "fsdp2") and s.offload_params):
        return 0.0  # counted with the offload traffic (CPU Adam)
    shard = plan.cluster.world_size if s.kind in ("zero1", "zero2", "zero3", "fsdp", "fsdp2") else 1
    return trained_params(plan) / shard * ADAM_BYTES_PER_PARAM / (gpu.memory_bandwidth_gbs * GB)


def step_time(plan: Plan, gpu: GPU | None = None) -> StepTime:
    """Predicted seconds per optimizer step for one rank of `plan`."""
    gpu = gpu or get_gpu(plan.cluster.gpu)
    flops, model_flops = step_flops(plan)
    eff = efficiency(plan)
    rate = gpu.bf16_tflops * 1e12 * eff * (FP32_RATE_FACTOR if plan.training.precision == "fp32" else 1.0)
    compute = flops / rate
    comm_total = exposed = comm_bytes = 0.0
    for link, (volume, collectives, window) in comm_volume(plan).items():
        inter = link.startswith("inter")
        bandwidth = (gpu.inter_node_gbs if inter else gpu.intra_node_gbs) * GB * LINK_EFFICIENCY
        seconds = volume / bandwidth + collectives * (LATENCY_INTER_S if inter else LATENCY_INTRA_S)
        comm_total += seconds
        comm_bytes += volume
        overlap = OVERLAP if (window and plan.strategy.overlap_comm) else 0.0
        hide = compute if window == WINDOW_STEP else compute / plan.training.grad_accum * backward_share(plan)
        exposed += max(seconds - overlap * hide, (1 - overlap) * seconds)
    return StepTime(compute_s=compute, comm_s=comm_total, exposed_comm_s=exposed,
                    offload_s=offload_seconds(plan, gpu), optimizer_s=optimizer_seconds(plan, gpu),
                    tokens=plan.training.micro_batch * plan.training.seq_len * plan.training.grad_accum,
                    flops=flops, model_flops=model_flops, comm_bytes=comm_bytes, efficiency=eff)
