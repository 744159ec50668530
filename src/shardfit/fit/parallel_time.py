"""Step time of one rank of a tp x cp x pp layout (issue 14, item 3). Analytic; no torch.

A rank of the layout trains a smaller model (estimate/model_parallel.py: its stage's layers, each
linear 1/tp, seq/cp tokens per sequence). Its data-parallel part (compute, FSDP / DDP collectives over
the dp x cp ranks that hold the same slice, optimizer, engine hooks) is fit/steptime.py's step time of
that rank-local plan, on the links its dp group really uses; on top come:

- attention: a rank computes its heads / tp for its seq / cp queries against the whole sequence
  (load-balanced causal CP), so cp / tp of the full layer's attention, where the rank-local plan
  would count 1 / cp² (its sequence is only s / cp long);
- TP: per layer, two all-reduces in forward (attention and MLP outputs of the rowwise linears) and two
  in backward (the colwise inputs' gradients), each 2 (t-1)/t x b x (s/cp) x h x d bytes per rank on
  the intra-node link; under sequence parallel each is an all-gather + reduce-scatter pair moving the
  same bytes (Korthikanti et al. 2022 sec. 4.2.2). A recomputed block runs its forward's two again.
  Exposed: eager TP collectives sit between the matmuls that need their result (TP_OVERLAP);
- CP: ring attention passes the K/V chunk (cp - 1) times per layer in forward and K/V + dK/dV in
  backward, hidden behind the attention it feeds (Liu et al. 2023; torch context_parallel); only what
  exceeds the attention's time is exposed;
- PP: the schedule's bubble, (p - 1) / v micro-batch times of the slowest stage (Narayanan et al.
  2021: (p-1)/m of the step for 1F1B and GPipe, (p-1)/(v m) interleaved; a third of that under the
  zero-bubble schedules: bubble_fraction), plus the p2p activation /
  gradient sends, whose pipeline fill (p - 1 hops) is exposed and the rest overlapped;
- EP: a MoE layer's token dispatch and combine, an all-to-all each way in forward and backward, each
  b x (s/cp) x top_k x h x d x (ep-1)/ep per rank, exposed; the rank gathers and updates its experts / ep;
- the slowest pipeline stage sets the pace (every stage waits for it).
"""
from __future__ import annotations

from dataclasses import replace

from shardfit.estimate.model_parallel import local_model, local_plan
from shardfit.fit import steptime
from shardfit.spec.gpus import get_gpu
from shardfit.spec.parallelism import (MULTI_CHUNK_SCHEDULES, SPLIT_BACKWARD_SCHEDULES, holds_edges, resolve,
                                       stage_layers)
from shardfit.spec.plan import Cluster, is_selective_ac, parse_activation_checkpointing

# Fraction of TP collective time hidden behind compute. Eager Megatron-style TP runs each all-reduce
# between the matmul that produces its input and the one that consumes its output: nothing overlaps.
# (Async TP, torchtitan's `enable_async_tensor_parallel` with torch.compile, or Megatron's
# --tp-comm-overlap with Transformer Engine hide a part; not assumed.)
TP_OVERLAP = 0.0


def _recomputed_share(ac: str) -> float:
    """Fraction of blocks whose forward (and its TP collectives) runs again in backward. Per-op
    selective recompute keeps the matmul outputs, so their collectives are not repeated."""
    every = parse_activation_checkpointing(ac)
    if not every or is_selective_ac(ac):
        return 0.0
    return 1.0 / every


def _dp_cluster(plan, layout) -> Cluster:
    """The cluster the rank-local plan's data-parallel collectives run on: the dp x cp ranks that hold
    the same slice. Ranks are laid out pp, dp, cp, tp from outermost to innermost (torchtitan's mesh
    order), so one node holds gpus_per_node / tp of them and the group spans the rest over nodes."""
    c = plan.cluster
    ranks = layout.dp * layout.cp
    per_node = max(1, min(ranks, c.gpus_per_node // layout.tp))
    return Cluster(nodes=max(1, ranks // per_node), gpus_per_node=per_node, gpu=c.gpu, host_memory_gib=c.host_memory_gib)


def _peer_link(plan, stride: int) -> str:
    """The link between a rank and the peer `stride` ranks away: inside the node while the stride is
    within it, else each rank's own NIC (every rank of the node talks to its own peer at once)."""
    return "intra" if stride < plan.cluster.gpus_per_node else "nic"


def _seconds(link: str, volume: float, collectives: int, gpu, gpus_per_node: int) -> float:
    bandwidth, latency = steptime._link(link, gpu, gpus_per_node)
    return volume / bandwidth + collectives * latency


def _stage_time(plan, layout, gpu, layers: int, first: bool, last: bool):
    """(StepTime of this pipeline rank without the bubble, one micro-batch's compute + TP seconds)."""
    m, t = plan.model, plan.training
    # Under ep the rank gathers, reduces and updates its experts / ep only (FSDP over the efsdp ranks).
    rank = local_plan(plan, layout, local_model(m, layout, layers, first, last, ep=layout.ep))
    rank = replace(rank, cluster=_dp_cluster(plan, layout))
    base = steptime.step_time(rank, gpu)
    micro = layout.microbatches
    if layout.pp > 1 and plan.strategy.kind == "fsdp2":
        # torch.distributed.pipelining runs every micro-batch but the last without resharding after
        # backward or reducing gradients (stage.py: set_reshard_after_backward / set_requires_gradient_sync
        # False), and torchtitan turns reshard_after_forward off under PP: the stage is gathered and its
        # gradients reduce-scattered once per step (the memory side: estimate/model_parallel.py).
        once = steptime.step_time(replace(rank, training=replace(rank.training, grad_accum=1)), gpu)
        base = replace(base, comm_s=once.comm_s, exposed_comm_s=once.exposed_comm_s, comm_bytes=once.comm_bytes)
    if layout.sequence_parallel:
        # Under SP the norms, residuals and dropout run on s / tp tokens: the memory-bound kernels of
        # the unsliced stage, split over tp (without SP every TP rank runs them on the whole sequence).
        unsliced = local_plan(plan, layout, local_model(m, layout, layers, first, last, tp=1))
        memory = steptime.memory_seconds(unsliced, gpu) / layout.tp
        base = replace(base, compute_s=base.compute_s - base.memory_s + memory, memory_s=memory)
    d = 4 if t.precision == "fp32" else 2
    b, s = t.micro_batch, t.seq_len // layout.cp
    rate, _ = steptime.matmul_rate(rank, gpu)
    factor = base.flops / base.model_flops if base.model_flops else 1.0
    backward = 1.0 if t.lora is not None else 2.0
    causal = steptime.CAUSAL_ATTENTION_FACTOR if m.causal_lm else 1.0
    # What step_flops counted for attention on the rank-local plan, and what the rank really computes.
    counted = 4.0 * layers * m.hidden_size * s * b * s * causal * (1 + backward) * micro
    attention_model = counted * layout.cp / layout.tp
    extra_flops = (attention_model - counted) * factor
    compute = base.compute_s + extra_flops / rate
    attention_s = attention_model * factor / rate
    parts: dict[str, tuple[float, float, float]] = {}  # name -> (seconds, exposed seconds, bytes)
    if layout.tp > 1:
        tp = layout.tp
        per_layer = 4 + 2 * _recomputed_share(t.activation_checkpointing)
        volume = per_layer * layers * micro * 2 * (tp - 1) / tp * b * s * m.hidden_size * d
        count = int(per_layer * layers * micro * (2 if layout.sequence_parallel else 1))
        sec = _seconds("intra", volume, count, gpu, plan.cluster.gpus_per_node)
        parts["tp"] = (sec, sec * (1 - TP_OVERLAP), volume)
    if layout.cp > 1:
        head_dim = m.head_dim or m.hidden_size // m.num_heads
        kv = (m.num_kv_heads or m.num_heads) // layout.tp * head_dim
        passes = 3 + _recomputed_share(t.activation_checkpointing)  # forward K/V; backward K/V + dK/dV
        volume = passes * (layout.cp - 1) * 2 * b * s * kv * d * layers * micro
        count = int(passes * (layout.cp - 1) * layers * micro)
        sec = _seconds(_peer_link(plan, layout.tp), volume, count, gpu, plan.cluster.gpus_per_node)
        parts["cp"] = (sec, max(0.0, sec - attention_s), volume)
    if layout.pp > 1:
        hop = b * s * m.hidden_size * d / (layout.tp if layout.sequence_parallel else 1)
        sends = 2 * micro * layout.virtual  # activation forward, its gradient backward, per chunk
        link = _peer_link(plan, plan.cluster.world_size // layout.pp)
        sec = _seconds(link, hop * sends, sends, gpu, plan.cluster.gpus_per_node)
        fill = _seconds(link, hop * 2 * (layout.pp - 1), 2 * (layout.pp - 1), gpu, plan.cluster.gpus_per_node)
        parts["p2p"] = (sec, min(sec, fill + (1 - base_overlap(gpu)) * max(0.0, sec - fill)), hop * sends)
    if layout.ep > 1 and m.num_experts:
        # Token dispatch and combine: an all-to-all each way per MoE layer in forward, their gradients in
        # backward (+ the recomputed forward's), each moving b*s*top_k*h*d (ep-1)/ep per rank, on the
        # critical path (no overlap assumed). The ep ranks are dp_shard x cp ranks, tp apart.
        calls = (2 + 2 + 2 * _recomputed_share(t.activation_checkpointing)) * layers * micro
        volume = calls * (layout.ep - 1) / layout.ep * b * s * max(m.experts_per_token, 1) * m.hidden_size * d
        sec = _seconds(_peer_link(plan, layout.tp * (layout.ep - 1)), volume, int(calls), gpu, plan.cluster.gpus_per_node)
        parts["ep"] = (sec, sec, volume)
    exposed = sum(e for _, e, _ in parts.values())
    per_micro = (compute + parts.get("tp", (0, 0, 0))[1]) / micro
    st = replace(base, compute_s=compute, comm_s=base.comm_s + sum(s_ for s_, _, _ in parts.values()),
                 exposed_comm_s=base.exposed_comm_s + exposed,
                 comm_bytes=base.comm_bytes + sum(v for _, _, v in parts.values()),
                 flops=base.flops + extra_flops, model_flops=base.model_flops + attention_model - counted,
                 tokens=base.tokens / (layout.tp * layout.pp),
                 parts=tuple((name, e) for name, (_, e, _) in parts.items()))
    return st, per_micro


def base_overlap(gpu) -> float:
    return gpu.measured.comm_overlap if gpu.measured is not None else steptime.OVERLAP


def bubble_fraction(layout) -> float:
    """The pipeline bubble as a fraction of the ideal step: (p - 1) / (v m) (Narayanan et al. 2021).
    The zero-bubble schedules fill it with the deferred weight gradients: ZB-H1's bubble is
    (p - 1)(T_F + T_B - T_W), a third of 1F1B's when forward, input-gradient and weight-gradient times
    are equal (Qi et al. 2024, sec. 3), so (p - 1) / (3 v m) for torch's ZB1P over v chunks; ZB-V and
    DualPipeV are only bubble-free when those three times are equal (torch's docstring), which real
    blocks are not: counted as ZB1P over their two chunks. An assumption, not a measurement."""
    if layout.pp == 1:
        return 0.0
    virtual = layout.virtual if layout.schedule in MULTI_CHUNK_SCHEDULES else 1
    split = 3 if layout.schedule in SPLIT_BACKWARD_SCHEDULES else 1
    return (layout.pp - 1) / (split * virtual * layout.microbatches)


def parallel_step_time(plan, gpu):
    """Predicted seconds per optimizer step of the slowest rank of a tp x cp x pp plan."""
    layout = resolve(plan)
    layers = stage_layers(plan.model.num_layers, layout.pp, layout.virtual, layout.schedule)
    keys = {(count, *holds_edges(stage, layout.pp, layout.virtual, layout.schedule))
            for stage, count in enumerate(layers)}
    worst, per_micro = None, 0.0
    for count, first, last in sorted(keys):
        st, micro_s = _stage_time(plan, layout, gpu, count, first, last)
        if worst is None or st.total_s > worst.total_s:
            worst = st
        per_micro = max(per_micro, micro_s)
    bubble = bubble_fraction(layout) * per_micro * layout.microbatches
    return replace(worst, bubble_s=bubble, parts=worst.parts + ((("bubble", bubble),) if bubble else ()))


def step_time(plan, gpu=None):
    """Predicted seconds per optimizer step for one rank of any plan: data parallel (fit/steptime.py) or
    a tp x cp x pp layout (the rank-local plan plus its collectives and bubble)."""
    gpu = gpu or get_gpu(plan.cluster.gpu)
    if plan.parallelism.is_default:
        return steptime.step_time(plan, gpu)
    return parallel_step_time(plan, gpu)
