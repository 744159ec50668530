"""Step-time model: ranks plans by predicted seconds per optimizer step. Analytic; no torch.

time = compute + exposed communication + offload traffic + optimizer update + the engine's hook
work, per rank. It ranks
plans against each other; it is not a promise of absolute speed (`fit --verify` measures that).
Every constant below says where it comes from.

Two kinds of device: a catalog GPU's datasheet figures, which GEMM_EFFICIENCY, MEMORY_EFFICIENCY,
LINK_EFFICIENCY, OVERLAP and the token ramp discount to what is achieved; and a calibrated device
profile (`shardfit calibrate`, GPU.measured), whose rates were achieved on the machine already: the
profile path uses them as they are and multiplies in none of those factors.
"""
from __future__ import annotations

from dataclasses import dataclass

from shardfit.errors import ShardfitError

from shardfit.estimate.states import lora_adapter_params, model_linears
from shardfit.estimate.traffic import micro_batch_traffic_bytes
from shardfit.fit.engine_overhead import eager_seconds, host_seconds, sac_dispatch_seconds, wrapper_seconds
from shardfit.fit.measured import measured_matmul_flops
from shardfit.spec.gpus import GPU, get_gpu
from shardfit.spec.plan import Plan, is_selective_ac, parse_activation_checkpointing

# Achieved rate of large 16-bit GEMMs as a fraction of the datasheet peak (cuBLAS on A100/H100/V100
# reaches 70-85% on LLM-sized shapes; the rest of a step's time is the memory-bound kernels, counted
# apart from the bytes they move, and the communication).
GEMM_EFFICIENCY = 0.75
# Below this many tokens per micro-batch the matmuls get thin and efficiency falls (roughly with
# the square root of the shortfall).
EFFICIENCY_FULL_TOKENS = 8192
# Memory-bound kernels (norms, activation functions, softmax, dropout, the loss) stream at about 80%
# of the HBM datasheet bandwidth (STREAM-like copy benchmarks on A100/H100).
MEMORY_EFFICIENCY = 0.8
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
    compute_s: float  # matmuls + memory-bound kernels
    memory_s: float  # of compute_s: the memory-bound kernels (activation bytes / bandwidth)
    comm_s: float  # all communication volume over its link, before overlap
    exposed_comm_s: float  # the part not hidden behind compute
    offload_s: float
    optimizer_s: float
    host_s: float  # engine hooks per tensor / submodule, SAC's per-op dispatch (fit/engine_overhead.py)
    tokens: int  # tokens per rank per optimizer step
    flops: float  # per rank per optimizer step, including recompute
    model_flops: float  # per rank, without recompute (what MFU counts)
    comm_bytes: float
    efficiency: float
    bubble_s: float = 0.0  # the pipeline schedule's idle time (fit/parallel_time.py)
    parts: tuple[tuple[str, float], ...] = ()  # exposed seconds of the tp / cp / p2p collectives and the bubble

    @property
    def total_s(self) -> float:
        return self.compute_s + self.exposed_comm_s + self.offload_s + self.optimizer_s + self.host_s + self.bubble_s

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
    Activation checkpointing re-runs the forward of the checkpointed blocks once more; the chunked
    loss re-runs the head's matmul (2·V·h per token).
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
    if t.loss == "chunked" and m.has_shape:
        # engines/chunked_loss.py recomputes each chunk's logits in backward: the head's matmul once more.
        flops += 2.0 * m.vocab_size * m.hidden_size * micro_tokens
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
    """Achieved fraction of the datasheet matmul rate at this micro-batch's token count."""
    tokens = plan.training.micro_batch * plan.training.seq_len
    return GEMM_EFFICIENCY * min(1.0, tokens / EFFICIENCY_FULL_TOKENS) ** 0.5


def matmul_rate(plan: Plan, gpu: GPU) -> tuple[float, float]:
    """(FLOP/s the step's matmuls run at, that rate as a fraction of the device's bf16 peak)."""
    t = plan.training
    if gpu.measured is not None:
        rate = measured_matmul_flops(gpu.measured, t.precision, t.micro_batch * t.seq_len, plan.model.hidden_size or 1)
        return rate, rate / (gpu.bf16_tflops * 1e12) if gpu.bf16_tflops else 1.0
    eff = efficiency(plan)
    return gpu.bf16_tflops * 1e12 * eff * (FP32_RATE_FACTOR if t.precision == "fp32" else 1.0), eff


def _memory_bps(gpu: GPU) -> float:
    """Achievable memory bandwidth: the measured copy rate, or the datasheet figure discounted."""
    if gpu.measured is not None:
        return gpu.measured.memory_gbs * GB
    return gpu.memory_bandwidth_gbs * GB * MEMORY_EFFICIENCY


def memory_seconds(plan: Plan, gpu: GPU) -> float:
    """The memory-bound kernels of every micro-batch: the activation bytes they move over the
    achievable HBM bandwidth (estimate/traffic.py). They dominate small models and eager attention."""
    traffic = micro_batch_traffic_bytes(plan) * plan.training.grad_accum
    return traffic / _memory_bps(gpu)


def _param_bytes(plan: Plan) -> float:
    """Bytes per parameter of the copy that is gathered/communicated (16-bit unless fp32)."""
    t = plan.training
    if t.lora is not None and t.lora.base_dtype in ("int8", "nf4"):
        return 1.0 if t.lora.base_dtype == "int8" else 0.5
    return 4.0 if t.precision == "fp32" else 2.0


# What communication can hide behind: the forward of every micro-batch (parameter all-gathers ahead
# of the layer that needs them), the backward of every micro-batch (gradient reductions, backward
# all-gathers), only the last micro-batch's backward (a reduction held back to the accumulation
# boundary: DDP under no_sync, ZeRO-1), or nothing (the ZeRO-1/2 all-gather after the step).
# Gradients exist only in backward, so no gradient traffic hides behind a forward.
WINDOW_FORWARD, WINDOW_BACKWARD, WINDOW_BOUNDARY, WINDOW_NONE = "forward", "backward", "boundary", None


@dataclass(frozen=True)
class CommPart:
    """One stream of collectives of a step: bytes each rank sends over `link` per optimizer step."""
    # "intra": inside a node; "inter": one ring over every rank of several nodes, whose node-boundary
    # hops share the node's NICs; "nic": each rank's own NIC (hybrid sharding's replica all-reduce)
    link: str
    bytes: float
    collectives: int
    window: str | None  # WINDOW_*


def comm_parts(plan: Plan) -> list[CommPart]:
    """The collectives of one optimizer step per rank, each with the compute it can overlap. Ring
    collectives move (N-1)/N of the buffer per rank for all-gather and reduce-scatter, twice that for
    all-reduce (ZeRO paper sec. 7)."""
    s, t, c, m = plan.strategy, plan.training, plan.cluster, plan.model
    n = c.world_size
    if n == 1:
        return []
    accum = t.grad_accum
    weights = m.n_params * _param_bytes(plan)
    grads = trained_params(plan) * (4.0 if t.precision == "fp32" else 2.0)
    ring = (n - 1) / n
    link = "inter" if c.nodes > 1 else "intra"
    held = WINDOW_BOUNDARY if accum > 1 else WINDOW_BACKWARD
    if s.kind == "ddp" or (s.kind == "fsdp" and s.sharding == "no_shard"):
        # DDP: one bucketed all-reduce per optimizer step (no_sync during accumulation); FSDP1
        # NO_SHARD reduces every micro-batch.
        reductions = 1 if s.kind == "ddp" else accum
        buckets = max(1, int(grads / (s.ddp_bucket_cap_mb * 2**20))) if s.kind == "ddp" else (m.num_layers or 1) + 1
        return [CommPart(link, 2 * grads * ring * reductions, buckets * reductions,
                         held if reductions == 1 else WINDOW_BACKWARD)]
    if s.kind in ("zero1", "zero2"):
        # ZeRO-1 reduces at the boundary; ZeRO-2 every micro-batch (it can't keep full grads). DeepSpeed
        # 0.19 reduces each bucket with an all-reduce (average_tensor -> allreduce_and_scatter, since
        # use_multi_rank_bucket_allreduce defaults on), not the paper's reduce-scatter: 2x the gradient
        # bytes, so ZeRO-1/2 move 3P per step, not 2P (measured 1.5x by `shardfit bench`; docs/bench.md).
        # The updated 16-bit partitions are all-gathered after the step: nothing to hide behind.
        reductions = 1 if s.kind == "zero1" else accum
        buckets = max(1, int(grads / 2 / max(s.reduce_bucket_size, 1)))
        return [CommPart(link, 2 * grads * ring * reductions, reductions * buckets,
                         held if reductions == 1 else WINDOW_BACKWARD),
                CommPart(link, weights * ring, max(1, int(weights / 2 / max(s.allgather_bucket_size, 1))), WINDOW_NONE)]
    # Sharded parameters (ZeRO-3, FSDP, FSDP2): all-gather ahead of each unit's forward, again in
    # backward unless kept gathered, and reduce-scatter the gradients, for every micro-batch.
    regather = s.regathers_in_backward(m.n_params)
    gathers, reductions = _gather_collectives(plan), _reduce_collectives(plan)
    group = _shard_group(plan)
    if group < n:
        # Hybrid: shard inside the group over fast links, all-reduce the shards across groups.
        inner = (group - 1) / group
        replicas = n // group
        return [CommPart("intra", weights * inner * accum, gathers * accum, WINDOW_FORWARD),
                CommPart("intra", (weights * regather + grads) * inner * accum, (gathers * regather + reductions) * accum,
                         WINDOW_BACKWARD),
                CommPart("nic", 2 * grads / group * (replicas - 1) / replicas * accum, reductions * accum, WINDOW_BACKWARD)]
    return [CommPart(link, weights * ring * accum, gathers * accum, WINDOW_FORWARD),
            CommPart(link, (weights * regather + grads) * ring * accum, (gathers * regather + reductions) * accum,
                     WINDOW_BACKWARD)]


def comm_volume(plan: Plan) -> dict[str, tuple[float, int]]:
    """Bytes and collectives each rank sends per optimizer step, per link ("intra" | "inter" | "nic")."""
    out: dict[str, tuple[float, int]] = {}
    for part in comm_parts(plan):
        volume, collectives = out.get(part.link, (0.0, 0))
        out[part.link] = (volume + part.bytes, collectives + part.collectives)
    return out


def _gather_collectives(plan: Plan) -> int:
    """All-gathers per gather pass. FSDP gathers one wrapped block at a time (plus the root). DeepSpeed
    ZeRO-3 fetches submodule by submodule but coalesces: each fetch also prefetches the next
    submodules' parameters up to stage3_prefetch_bucket_size elements in one all_gather_coalesced
    (partitioned_param_coordinator.fetch_sub_module), so a pass issues about parameters / bucket
    all-gathers, or one per submodule where a submodule alone exceeds the bucket."""
    m, s = plan.model, plan.strategy
    if s.kind != "zero3":
        return (m.num_layers or 1) + 1
    bucket = max(s.prefetch_bucket_size, 1)
    oversized = sum(n for _, i, o, n in model_linears(m) if i * o >= bucket) if m.has_shape else 0
    return max(-(-m.n_params // bucket), oversized, 1) + 1


def _reduce_collectives(plan: Plan) -> int:
    """Gradient reductions per backward: one per FSDP unit; ZeRO-3 fills reduce_bucket_size-element
    buckets (stage3.py __reduce_and_partition_ipg_grads)."""
    s = plan.strategy
    if s.kind != "zero3":
        return (plan.model.num_layers or 1) + 1
    return max(-(-trained_params(plan) // max(s.reduce_bucket_size, 1)), 1)


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
    measured = gpu.measured
    if measured is not None:
        # A CPU device is the host: the offload copies are copies inside RAM, at the measured copy rate.
        host_bps = (measured.host_link_gbs or measured.memory_gbs) * GB
        adam_rate = measured.cpu_adam_params_per_s
    else:
        host_bps = gpu.host_link_gbs * GB * HOST_LINK_EFFICIENCY
        adam_rate = CPU_ADAM_PARAMS_PER_S
    trained = trained_params(plan) / n
    seconds = 0.0
    optimizer_device = s.offload_optimizer or (s.offload_params if s.kind in ("fsdp", "fsdp2") else None)
    if optimizer_device:
        # Gradients down (fp32 on the host side: 4 B) and updated 16-bit parameters back up (2 B).
        moved = trained * 6
        seconds += moved / host_bps + trained / adam_rate
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
    if gpu.measured is not None:
        return trained_params(plan) / shard / gpu.measured.optimizer_params_per_s
    return trained_params(plan) / shard * ADAM_BYTES_PER_PARAM / (gpu.memory_bandwidth_gbs * GB)


def _link_gbs(link: str, gpu: GPU, gpus_per_node: int) -> float:
    """Bandwidth per rank of a link. The catalog's inter-node rate is one NIC per GPU. A ring over
    several nodes sends each rank's bytes to its neighbour over NVLink, and only the node-boundary
    hops over the network: NCCL runs one ring per NIC, so a node's outgoing bytes equal one rank's
    and spread over all its NICs (why nccl-tests' multi-node bus bandwidth is ~NICs x NIC rate)."""
    if link == "intra":
        return gpu.intra_node_gbs
    if link == "inter":
        return min(gpu.intra_node_gbs, gpu.inter_node_gbs * gpus_per_node)
    return gpu.inter_node_gbs


def _link(link: str, gpu: GPU, gpus_per_node: int) -> tuple[float, float]:
    """(achievable bytes/s per rank, seconds of latency per collective) of a link."""
    if gpu.measured is not None:
        found = gpu.measured.link(link)
        if found is None:
            raise ShardfitError(f"the device profile has no '{link}' link (calibrate measured "
                                f"{', '.join(name for name, *_ in gpu.measured.links) or 'none'}): plan one node, "
                                "or drop --device-profile")
        return found[0] * GB, found[1]
    latency = LATENCY_INTRA_S if link == "intra" else LATENCY_INTER_S
    return _link_gbs(link, gpu, gpus_per_node) * GB * LINK_EFFICIENCY, latency


def step_time(plan: Plan, gpu: GPU | None = None) -> StepTime:
    """Predicted seconds per optimizer step for one rank of a data-parallel `plan` (tp / cp / pp plans:
    fit/parallel_time.py's step_time, which builds on this one)."""
    gpu = gpu or get_gpu(plan.cluster.gpu)
    t = plan.training
    flops, model_flops = step_flops(plan)
    rate, eff = matmul_rate(plan, gpu)
    memory = memory_seconds(plan, gpu)
    compute = flops / rate + memory
    backward = compute * backward_share(plan)
    block_forward = (compute - backward) / t.grad_accum / max(plan.model.num_layers, 1)
    block_backward = backward / t.grad_accum / max(plan.model.num_layers, 1)
    hide_behind = {WINDOW_FORWARD: compute - backward, WINDOW_BACKWARD: backward,
                   WINDOW_BOUNDARY: backward / t.grad_accum, WINDOW_NONE: 0.0}
    comm_total = exposed = comm_bytes = 0.0
    overlap_fraction = gpu.measured.comm_overlap if gpu.measured is not None else OVERLAP
    for part in comm_parts(plan):
        bandwidth, latency = _link(part.link, gpu, plan.cluster.gpus_per_node)
        seconds = part.bytes / bandwidth + part.collectives * latency
        comm_total += seconds
        comm_bytes += part.bytes
        # The first unit's all-gather of every forward has no earlier layer to hide behind.
        fill = seconds / max(part.collectives, 1) * t.grad_accum if part.window == WINDOW_FORWARD else 0.0
        overlap = overlap_fraction if (part.window and plan.strategy.overlap_comm) else 0.0
        rest = seconds - fill
        exposed += fill + max(rest - overlap * hide_behind[part.window], (1 - overlap) * rest)
    return StepTime(compute_s=compute, memory_s=memory, comm_s=comm_total, exposed_comm_s=exposed,
                    offload_s=offload_seconds(plan, gpu), optimizer_s=optimizer_seconds(plan, gpu),
                    host_s=(host_seconds(plan, gpu) + sac_dispatch_seconds(plan, gpu, block_forward)
                            + eager_seconds(plan, gpu, block_forward, block_backward)
                            + wrapper_seconds(plan, gpu, block_forward + block_backward)),
                    tokens=t.micro_batch * t.seq_len * t.grad_accum,
                    flops=flops, model_flops=model_flops, comm_bytes=comm_bytes, efficiency=eff)
