"""The Plan's parallelism section: how the world of ranks is split beyond data parallelism.

world = dp_replicate x dp_shard x tp x cp x pp. The defaults (tp = cp = pp = ep = 1, dp left to the
strategy) are today's strategies exactly: a Plan without this section, or with the defaults, is the
same Plan it always was, and `Plan.to_dict` leaves the section out so old files and hashes stay as
they were.

dp_replicate / dp_shard: 0 means "derived": dp = world / (tp*cp*pp) ranks, split the way the strategy
splits them (ddp: all replicate; fsdp / fsdp2 / zero: all shard; hybrid: the shard group). Given
explicitly they must multiply with tp*cp*pp to the world size (accelerate's ParallelismConfig and
torchtitan's ParallelDims have the same rule).

Layers that do not divide the pipeline's chunks are split as evenly as possible with the extra
layers on the middle stages: the edge stages also hold the embedding and the head (what Llama 3 did
with 126 layers on 16 stages). No torch here.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from functools import cached_property

from shardfit.errors import ShardfitError

PP_SCHEDULES = ("gpipe", "1f1b", "interleaved", "zero-bubble", "zbv", "dualpipev")
# torch.distributed.pipelining's classes (and torchtitan's names) for them.
TORCH_SCHEDULES = {"gpipe": "ScheduleGPipe", "1f1b": "Schedule1F1B", "interleaved": "ScheduleInterleaved1F1B",
                   "zero-bubble": "ScheduleInterleavedZeroBubble", "zbv": "ScheduleZBVZeroBubble",
                   "dualpipev": "ScheduleDualPipeV"}
# Schedules that run several chunks per rank (a list of stages), and those of them that place the
# chunks in a V: rank r holds chunks r and 2p - 1 - r, so rank 0 holds the embedding and the head.
MULTI_CHUNK_SCHEDULES = ("interleaved", "zero-bubble", "zbv", "dualpipev")
V_SCHEDULES = ("zbv", "dualpipev")


def schedule_fixed_chunks(schedule: str) -> dict:
    """The pp_virtual_stages a schedule fixes, as plan fields: a V always runs two chunks per rank."""
    return {"pp_virtual_stages": 2} if schedule in V_SCHEDULES else {}
# Zero-bubble schedules split each backward into the input gradient (B) and the weight gradient (W),
# run later to fill the bubble; a micro-batch's saved activations live until its W.
SPLIT_BACKWARD_SCHEDULES = ("zero-bubble", "zbv", "dualpipev")
# Strategies the model-parallel engines compose with: torch's DeviceMesh composes DDP and FSDP2
# with TP / CP / PP (torchtitan, accelerate); DeepSpeed's pipeline engine takes ZeRO-1 at most and
# its AutoTP training ZeRO-0..2.
MESH_STRATEGIES = ("single", "ddp", "fsdp2")


@dataclass(frozen=True, kw_only=True)
class Parallelism:
    dp_replicate: int = 0  # 0 = derived from the strategy
    dp_shard: int = 0  # 0 = derived from the strategy
    tp: int = 1
    sequence_parallel: bool = False  # norms / dropout / residual sharded over the sequence in TP regions
    # The embedding is vocab-sharded either way (transformers' `embedding_rowwise`, Megatron's
    # VocabParallelEmbedding). True: the logits stay vocab-sharded into a vocab-parallel cross-entropy
    # (Megatron, torch's loss_parallel in torchtitan); False: the model's own transformers `_tp_plan`,
    # whose lm_head is `colwise_gather_output` (every rank holds the full logits).
    loss_parallel: bool = True
    cp: int = 1
    pp: int = 1
    pp_schedule: str = "1f1b"  # gpipe | 1f1b | interleaved | zero-bubble | zbv | dualpipev
    pp_virtual_stages: int = 1  # model chunks per pipeline rank (interleaved: 2 or more; zbv, dualpipev: 2)
    pp_microbatches: int = 0  # micro-batches per step through the pipeline; 0 = training.grad_accum
    ep: int = 1

    @cached_property
    def is_default(self) -> bool:
        # cached: estimate() asks it of every plan (a fresh instance and a 12-field compare each time).
        return self == Parallelism()

    @property
    def model_parallel(self) -> int:
        return self.tp * self.cp * self.pp


@dataclass(frozen=True, kw_only=True)
class Layout:
    """The resolved degrees of one plan: every number known, dp included."""
    world: int
    dp_replicate: int
    dp_shard: int
    tp: int
    cp: int
    pp: int
    ep: int
    virtual: int
    microbatches: int
    schedule: str
    sequence_parallel: bool
    loss_parallel: bool

    @property
    def dp(self) -> int:
        return self.dp_replicate * self.dp_shard

    def describe(self) -> str:
        parts = [f"dp_replicate={self.dp_replicate}", f"dp_shard={self.dp_shard}",
                 f"tp={self.tp}" + ("+sp" if self.sequence_parallel else ""), f"cp={self.cp}", f"pp={self.pp}"]
        if self.pp > 1:
            parts.append(f"{self.schedule}" + (f" v={self.virtual}" if self.virtual > 1 else "")
                         + f" m={self.microbatches}")
        if self.ep > 1:
            parts.append(f"ep={self.ep}")
        return " ".join(parts)


def drop_default(plan_data: dict) -> dict:
    """A plan's dict without the parallelism section when it holds only the defaults."""
    if plan_data.get("parallelism") == dataclasses.asdict(Parallelism()):
        del plan_data["parallelism"]
    return plan_data


def _derived_shard(strategy, dp: int, gpus_per_node: int, tp: int, cp: int) -> int:
    """dp_shard as the strategy shards its dp ranks."""
    if strategy.kind in ("single", "ddp") or (strategy.kind == "fsdp" and strategy.sharding == "no_shard"):
        return 1
    if strategy.shard_group(gpus_per_node) is not None:
        # Hybrid: the shard group counts dp ranks; by default the dp ranks of one node.
        return min(dp, strategy.shard_group_size or max(1, gpus_per_node // (tp * cp)))
    return dp


def resolve(plan) -> Layout:
    """The plan's layout with dp derived; assumes validate_parallelism passed."""
    par, c = plan.parallelism, plan.cluster
    world = c.nodes * c.gpus_per_node
    dp = max(1, world // par.model_parallel)
    shard = par.dp_shard or (dp // par.dp_replicate if par.dp_replicate else
                             _derived_shard(plan.strategy, dp, c.gpus_per_node, par.tp, par.cp))
    return Layout(world=world, dp_replicate=max(1, dp // max(shard, 1)), dp_shard=max(shard, 1), tp=par.tp,
                  cp=par.cp, pp=par.pp, ep=par.ep, virtual=par.pp_virtual_stages,
                  microbatches=par.pp_microbatches or plan.training.grad_accum, schedule=par.pp_schedule,
                  sequence_parallel=par.sequence_parallel, loss_parallel=par.loss_parallel)


def chunk_layers(num_layers: int, chunks: int) -> tuple[int, ...]:
    """Layers of each pipeline chunk in model order: num_layers // chunks each, the remainder one each
    to the middle chunks, so the first and last chunks (embedding, head) stay the lightest."""
    base, extra = divmod(num_layers, chunks)
    sizes = [base] * chunks
    start = (chunks - extra) // 2
    for index in range(start, start + extra):
        sizes[index] += 1
    return tuple(sizes)


def rank_chunks(rank: int, pp: int, virtual: int = 1, schedule: str = "1f1b") -> tuple[int, ...]:
    """The chunks (of pp x virtual, in model order) pipeline rank `rank` runs: chunk k on rank k % pp
    (Megatron's and torch's interleaved placement), or under a V schedule chunks rank and 2p - 1 - rank
    (torch's generate_stage_to_rank_mapping style "v")."""
    if schedule in V_SCHEDULES:
        return (rank, 2 * pp - 1 - rank)
    return tuple(range(rank, pp * virtual, pp))


def chunk_rank(chunk: int, pp: int, virtual: int = 1, schedule: str = "1f1b") -> int:
    """The pipeline rank that runs chunk `chunk` (rank_chunks' inverse)."""
    if schedule in V_SCHEDULES:
        return chunk if chunk < pp else 2 * pp - 1 - chunk
    return chunk % pp


def holds_edges(rank: int, pp: int, virtual: int = 1, schedule: str = "1f1b") -> tuple[bool, bool]:
    """(holds the first chunk: the embedding, holds the last chunk: the final norm and the head)."""
    chunks = rank_chunks(rank, pp, virtual, schedule)
    return 0 in chunks, pp * virtual - 1 in chunks


def stage_layers(num_layers: int, pp: int, virtual: int = 1, schedule: str = "1f1b") -> tuple[int, ...]:
    """Layers held by each pipeline rank, summed over its chunks (chunk_layers, rank_chunks)."""
    sizes = chunk_layers(num_layers, pp * virtual)
    return tuple(sum(sizes[k] for k in rank_chunks(rank, pp, virtual, schedule)) for rank in range(pp))


def in_flight_microbatches(layout: Layout, stage: int) -> float:
    """Micro-batches whose activations a pipeline rank holds at its peak, in units of one
    micro-batch through all of that rank's layers (a chunk's micro-batch counts 1 / v). 1F1B: rank i
    holds min(m, p - i) (Narayanan et al. 2021); interleaved: its warm-up chunks
    ((p - i - 1)*2 + (v - 1)*p + 1) / v, which on the first rank is p * (1 + (p - 1)/(p*v))
    (Korthikanti et al. 2022 sec. 4.2.3; Megatron's interleaved_schedule_memory_penalty); GPipe: all m.
    The zero-bubble schedules keep a micro-batch's activations until its weight gradient (W): the most
    split_backward_points holds (ZB1P: min(m, p) on every rank, Qi et al. 2024's ZB-H1, 1F1B's
    first-stage peak everywhere; ZB-V p; DualPipeV p + 1/2). Each equals the peak of torch's own action
    lists (tests/spec/test_pipeline_schedules.py walks them)."""
    p, v, m = layout.pp, layout.virtual, layout.microbatches
    if p == 1:
        return 1.0
    if layout.schedule == "gpipe":
        return float(m)
    if layout.schedule == "interleaved":
        return min(((p - stage - 1) * 2 + (v - 1) * p + 1) / v, float(m))
    if layout.schedule == "zero-bubble":
        return float(min(m, p))
    if layout.schedule in SPLIT_BACKWARD_SCHEDULES:
        return max(alive for alive, _ in split_backward_points(layout, stage)) / v
    return float(min(m, p - stage))


def split_backward_points(layout: Layout, stage: int, phase: str = "backward") -> tuple[tuple[int, int], ...]:
    """Under a zero-bubble schedule, the instants that can set pipeline rank `stage`'s peak in `phase`
    (forward or backward), as (chunk micro-batches whose activations are alive, how many of those wait
    for their weight gradient): the frontier of torch's own action list for that rank (no instant of
    the phase holds more of both). Backward: ZB1P every rank min(m, p) x v alive with min(i + 1, m v)
    waiting; ZB-V (m >= 2p - 1) 2p alive with 1 waiting, or p + i alive with 2i + 1 waiting; DualPipeV
    (m >= 2p) 2p + 1 alive with none waiting, 2p with 1 on all but the last rank, p with i + 1.
    Forward: the most alive, with i - max(0, p - m) waiting under ZB1P and none under ZB-V and DualPipeV.
    tests/spec/test_pipeline_schedules.py holds these equal to the walk of torch's lists."""
    p, v, m, i = layout.pp, layout.virtual, layout.microbatches, stage
    if layout.schedule == "zero-bubble":
        if phase == "forward":  # the rank's first forwards run before any input gradient reaches it
            return ((min(m, p) * v, max(0, i - max(0, p - m))),)
        return ((min(m, p) * v, min(i + 1, m * v)),)
    if layout.schedule == "zbv":
        return ((2 * p, int(phase != "forward")),) + (((p + i, 2 * i + 1),) if i and phase != "forward" else ())
    if layout.schedule == "dualpipev":
        if phase == "forward":
            return ((2 * p + 1, 0),)
        return ((2 * p + 1, 0),) + (((2 * p, 1),) if i < p - 1 else ()) + (((p, i + 1),) if i else ())
    return ()


def validate_parallelism(plan) -> list[str]:
    """Raise ShardfitError (one line naming the fix) on a layout that cannot run; return warnings."""
    par, c, s, t, m = plan.parallelism, plan.cluster, plan.strategy, plan.training, plan.model
    warnings: list[str] = []

    def bad(message: str):
        raise ShardfitError(message)

    for name in ("tp", "cp", "pp", "ep", "pp_virtual_stages"):
        if getattr(par, name) < 1:
            bad(f"parallelism.{name} must be at least 1, got {getattr(par, name)}")
    for name in ("dp_replicate", "dp_shard", "pp_microbatches"):
        if getattr(par, name) < 0:
            bad(f"parallelism.{name} must be at least 1 (or 0: derived), got {getattr(par, name)}")
    if par.pp_schedule not in PP_SCHEDULES:
        bad(f"parallelism.pp_schedule '{par.pp_schedule}' is not known: use one of {', '.join(PP_SCHEDULES)}")
    if par.is_default:
        return warnings
    world = c.nodes * c.gpus_per_node
    mp = par.model_parallel
    if world % mp:
        bad(f"tp x cp x pp = {par.tp} x {par.cp} x {par.pp} = {mp} does not divide the world size {world} "
            f"({c.nodes} nodes x {c.gpus_per_node} GPUs): choose degrees whose product divides it")
    dp = world // mp
    if par.dp_replicate and par.dp_shard and par.dp_replicate * par.dp_shard != dp:
        bad(f"dp_replicate x dp_shard x tp x cp x pp = {par.dp_replicate * par.dp_shard * mp} but the world "
            f"size is {world}: make dp_replicate x dp_shard = {dp} (or leave one at 0 to derive it)")
    for name in ("dp_replicate", "dp_shard"):
        value = getattr(par, name)
        if value and dp % value:
            bad(f"parallelism.{name} = {value} does not divide the {dp} data-parallel ranks "
                f"(world {world} / tp x cp x pp {mp}): choose a divisor")
    if par.tp > c.gpus_per_node or c.gpus_per_node % par.tp:
        bad(f"tp = {par.tp} must divide the {c.gpus_per_node} GPUs of one node: tensor parallelism all-reduces "
            f"every layer and needs the intra-node link; put the rest in pp or dp")
    if mp > 1 and s.kind not in MESH_STRATEGIES and not (s.kind == "zero1" and par.cp == 1 and par.tp == 1):
        bad(f"strategy {s.label} does not compose with tp/cp/pp on one device mesh: use fsdp2 (sharded states) "
            f"or ddp{' (or zero1 for pp alone: DeepSpeed pipelines take ZeRO-1 at most)' if par.pp > 1 else ''}")
    if par.dp_shard > 1 and s.kind in ("ddp", "single"):
        bad(f"{s.kind} replicates every state: dp_shard must be 1 (or 0); use fsdp2 to shard over dp_shard ranks")
    if not m.has_shape:
        if mp > 1 or par.ep > 1:
            bad("tp/cp/pp/ep need the model's shapes: give a preset or config instead of --params")
        return warnings
    heads, kv = m.num_heads, m.num_kv_heads or m.num_heads
    if heads % par.tp or kv % par.tp:
        bad(f"tp = {par.tp} must divide the attention heads ({heads}) and the KV heads ({kv}) of {m.name}: "
            f"choose a tp that divides {_gcd(heads, kv)}")
    if m.intermediate_size and m.intermediate_size % par.tp:
        bad(f"tp = {par.tp} must divide {m.name}'s intermediate size {m.intermediate_size}: choose another tp")
    if par.sequence_parallel and par.tp == 1:
        bad("sequence_parallel shards the TP region's norms over the tp ranks: it needs tp > 1 (or turn it off)")
    if par.sequence_parallel and (t.seq_len // par.cp) % par.tp:
        bad(f"sequence parallel splits the sequence over tp: seq_len / cp = {t.seq_len // par.cp} must be "
            f"divisible by tp = {par.tp}")
    if par.cp > 1 and t.seq_len % (2 * par.cp):
        bad(f"context parallel splits the sequence into 2 x cp = {2 * par.cp} load-balanced chunks: seq_len "
            f"{t.seq_len} must be divisible by {2 * par.cp}")
    chunks = par.pp * par.pp_virtual_stages
    if m.num_layers < chunks:
        bad(f"pp x virtual stages = {chunks} chunks but {m.name} has {m.num_layers} layers: use fewer stages")
    if par.pp_schedule == "interleaved" and par.pp_virtual_stages < 2 and par.pp > 1:
        bad("the interleaved schedule needs pp_virtual_stages >= 2 (model chunks per rank): set it, or use 1f1b")
    if par.pp_schedule in V_SCHEDULES and par.pp_virtual_stages != 2 and par.pp > 1:
        bad(f"the {par.pp_schedule} schedule runs exactly 2 chunks per rank (a V): set pp_virtual_stages to 2")
    if par.pp_schedule not in MULTI_CHUNK_SCHEDULES and par.pp_virtual_stages > 1:
        bad(f"pp_virtual_stages = {par.pp_virtual_stages} needs a schedule with several chunks per rank: set "
            f"pp_schedule to {', '.join(MULTI_CHUNK_SCHEDULES)}")
    micro = par.pp_microbatches or t.grad_accum
    if par.pp > 1 and par.pp_schedule == "interleaved" and micro % par.pp:
        bad(f"the interleaved schedule runs micro-batches in groups of pp: {micro} micro-batches must be a "
            f"multiple of pp = {par.pp} (set pp_microbatches or grad_accum)")
    # torch's ZB1P runs max(1, m // p) rounds of equal size; with several chunks per rank shardfit also
    # asks for whole groups of pp (the in-flight count above holds there; torch's own grows with m % p).
    rounds = max(1, micro // par.pp)
    if par.pp > 1 and par.pp_schedule == "zero-bubble" and (micro % rounds or (par.pp_virtual_stages > 1 and micro % par.pp)):
        bad(f"the zero-bubble schedule runs micro-batches in rounds of pp: {micro} micro-batches on pp = {par.pp} "
            f"must be a multiple of pp (set pp_microbatches or grad_accum)")
    if par.pp > 1 and par.pp_schedule == "zbv" and micro < 2 * par.pp - 1:
        bad(f"ZB-V fills its V with 2 x pp - 1 = {2 * par.pp - 1} micro-batches (torch pads fewer to that many "
            f"slots and the estimate holds from there): {micro} micro-batches; set grad_accum (--grad-accum) or "
            f"pp_microbatches to at least {2 * par.pp - 1}")
    if par.pp > 1 and par.pp_schedule == "dualpipev" and micro < 2 * par.pp:
        bad(f"DualPipeV runs at least as many micro-batches as chunks (2 x pp = {2 * par.pp}; torch refuses fewer): "
            f"{micro} micro-batches; set grad_accum (--grad-accum) or pp_microbatches to at least {2 * par.pp}")
    if par.pp > 1 and par.pp_schedule == "1f1b" and micro < par.pp:
        bad(f"the 1F1B schedule runs at least as many micro-batches as stages (torch.distributed.pipelining's "
            f"Schedule1F1B refuses fewer): {micro} micro-batches on pp = {par.pp}; set grad_accum (--grad-accum) or "
            f"pp_microbatches to at least {par.pp}, ideally several times more")
    if par.pp > 1 and micro < par.pp:
        warnings.append(f"{micro} micro-batches on {par.pp} pipeline stages: the bubble is over half the step; "
                        f"use at least {par.pp} (pp_microbatches or grad_accum), ideally several times more")
    if m.num_layers % chunks and par.pp > 1:
        warnings.append(f"{m.num_layers} layers on {chunks} chunks: split "
                        f"{stage_layers(m.num_layers, par.pp, par.pp_virtual_stages, par.pp_schedule)} "
                        "per rank, the extra layers on the middle stages")
    if par.ep > 1:
        if not m.num_experts:
            bad(f"ep = {par.ep} shards experts, but {m.name} is a dense model: set ep to 1")
        if m.num_experts % par.ep:
            bad(f"ep = {par.ep} must divide the {m.num_experts} experts of {m.name}")
        shard = par.dp_shard or dp
        if (shard * par.cp) % par.ep:
            bad(f"ep = {par.ep} borrows its ranks from dp_shard x cp = {shard * par.cp}: choose an ep that divides it")
    return warnings


def _gcd(a: int, b: int) -> int:
    while b:
        a, b = b, a % b
    return a
