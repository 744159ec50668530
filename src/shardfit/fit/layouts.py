"""The model-parallel layouts `fit` searches beside the data-parallel families (issue 14, item 4).

In the field's order (Megatron-LM, torchtitan, Llama 3's 405B run): tensor parallelism inside a node
first (it all-reduces every layer: only NVLink keeps up), then pipeline stages across nodes (one p2p
send per micro-batch and stage boundary: the network is enough), then context parallelism for long
sequences (ring attention hides its K/V exchange behind the attention it feeds only when the chunks
are long). Each layout is a Family: FSDP2 over the dp_shard x cp ranks (torchtitan's composition),
sequence parallel on whenever tp > 1 (same bytes as TP's all-reduces, 1/tp of the norms'
activations), the vocab-parallel loss, 1F1B (torchtitan's default schedule). The search then runs
each layout through the same activation-checkpointing x micro-batch bisection as every family, and
the step-time model (fit/parallel_time.py) ranks them with the data-parallel plans.

Expert parallelism for MoE models: ep degrees inside a node (with tp), borrowed from dp_shard x cp.

Derived ("any model") specs: tp (where the model's own TP plan slices into a config one rank runs),
pp, cp and ep (their routed `experts` tensors).
Not searched (yet): DDP / ZeRO-1 x TP, the interleaved and zero-bubble schedules, LoRA under
tp / cp / pp / ep.
"""
from __future__ import annotations

from shardfit.errors import ShardfitError
from shardfit.estimate import derived_parallel
from shardfit.fit.families import Family
from shardfit.spec import rank_config
from shardfit.spec.parallelism import Parallelism
from shardfit.spec.plan import Strategy
from shardfit.units import fmt_bytes

# Context parallelism is searched from this sequence length up: below it the s / cp chunks are too
# short for the ring's K/V passes to hide behind attention, and activations at full checkpointing
# (2 s b h per layer, / tp) rarely decide a plan. (Llama 3 turned CP on only for its 128k phase;
# torchtitan's CP examples start at 32k.)
CP_MIN_SEQ = 16384
MAX_PP = 32
MAX_CP = 16
MAX_EP = 64
# Under a pipeline, a larger micro-batch buys no matmul efficiency once a micro-batch holds this many
# tokens (fit/steptime.py EFFICIENCY_FULL_TOKENS) and only lengthens the bubble: not searched beyond.
ORDER = 15  # after every data-parallel family (0-9): at equal step time the simpler plan wins
LAYOUT_PREFIX = "fsdp2 "  # a layout family's label: "fsdp2 tp=8 pp=8"


def _powers(limit: int) -> list[int]:
    out, n = [], 2
    while n <= limit:
        out.append(n)
        n *= 2
    return out


def _tp_degrees(model, gpus_per_node: int) -> list[int]:
    kv = model.num_kv_heads or model.num_heads
    return [t for t in _powers(gpus_per_node) if gpus_per_node % t == 0 and model.num_heads % t == 0
            and kv % t == 0 and (not model.intermediate_size or model.intermediate_size % t == 0)]


def layouts(model, cluster, seq_len: int) -> list[Parallelism]:
    """The tp x pp x cp layouts worth searching, in the field's order; [] where only data parallelism
    applies (one GPU, a model without shapes). A derived spec ("any model"): tp where its own TP plan
    slices into a config one rank runs (estimate/derived_parallel.py)."""
    world = cluster.world_size
    if world == 1 or not model.has_shape or not model.num_layers:
        return []
    tps = [1] + [t for t in _tp_degrees(model, cluster.gpus_per_node) if not model.derived or _derived_tp(model, t)]
    # PP across nodes: stages of whole nodes (pp divides the nodes), at least two layers each.
    pps = [1] + [p for p in _powers(min(cluster.nodes, MAX_PP)) if cluster.nodes % p == 0 and 2 * p <= model.num_layers]
    cps = [1] + ([c for c in _powers(MAX_CP) if seq_len % (2 * c) == 0] if seq_len >= CP_MIN_SEQ else [])
    out = []
    for cp in cps:
        for pp in pps:
            for tp in tps:
                if world % (tp * pp * cp):
                    continue
                if tp == 1 and pp > 1:
                    continue  # PP before TP is not the field's order (and DeepSpeed's pipeline is not searched)
                sp = tp > 1 and (seq_len // cp) % tp == 0
                for ep in _ep_degrees(model, world // (tp * pp), tp, cluster.gpus_per_node):
                    if tp * pp * cp * ep == 1:
                        continue  # plain data parallelism: the 1-D families
                    out.append(Parallelism(tp=tp, sequence_parallel=sp, pp=pp, cp=cp, ep=ep))
    return out


def _ep_degrees(model, shard_cp: int, tp: int, gpus_per_node: int) -> list[int]:
    """1, and for an MoE model the expert-parallel degrees that divide its experts and the dp_shard x cp
    ranks they borrow, inside a node with tp (the token all-to-all of every MoE layer, each way, in
    forward and backward, needs the node's links: Mixtral's and Qwen-MoE's EP runs inside a node)."""
    if not model.num_experts or (model.derived and not any(model.kind_expert_params)):
        return [1]
    return [1] + [e for e in _powers(min(model.num_experts, MAX_EP)) if model.num_experts % e == 0
                  and shard_cp % e == 0 and tp * e <= gpus_per_node]


def _derived_tp(model, tp: int) -> bool:
    """Whether a derived spec's tp rank can be estimated: its plan slices into a config (the first
    time derived with torch, then cached like any spec)."""
    try:
        rank_config.check_plan(model, tp)
        derived_parallel.local_model(model, tp, loss_parallel=True)
    except ShardfitError:
        return False
    return True


def layout_label(par: Parallelism) -> str:
    parts = [f"tp={par.tp}" if par.tp > 1 else "", f"pp={par.pp}" if par.pp > 1 else "",
             f"cp={par.cp}" if par.cp > 1 else "", f"ep={par.ep}" if par.ep > 1 else ""]
    return LAYOUT_PREFIX + " ".join(p for p in parts if p)


def parallel_families(model, cluster, seq_len: int) -> list[Family]:
    """One Family per layout. FSDP2 reshards after forward except under a pipeline, where torchtitan
    keeps the stage gathered (torch's pipelining would regather it for every micro-batch otherwise)."""
    out = []
    for index, par in enumerate(layouts(model, cluster, seq_len)):
        strategy = Strategy(kind="fsdp2", reshard_after_forward=par.pp == 1)
        out.append(Family(layout_label(par), strategy, ORDER + index, 0, parallelism=par))
    return out


def micro_options_for(par: Parallelism | None, options: list[int], seq_len: int, full_tokens: int) -> list[int]:
    """A family's micro-batches: all of them, or under a pipeline those up to the first that fills the
    matmuls (a larger one only lengthens the bubble)."""
    if par is None or par.pp == 1:
        return options
    out = []
    for micro in options:
        out.append(micro)
        if micro * seq_len // par.cp >= full_tokens:
            break
    return out


def layout_notes(best, found: dict, smallest: dict, families: list[Family], usable: int, cluster, gpu) -> list[str]:
    """Why fit picked the layout it did: does data parallelism alone fit, and each degree's reason."""
    if not any(f.parallelism for f in families):
        return []
    dp = [c for f in families if f.parallelism is None and f.tier == 0 for c in found.get(f.label, [])]
    dp_best = min(dp, key=lambda c: c.time.total_s, default=None)
    notes = []
    if best is None or best.plan.parallelism.is_default:
        mp = [c for f in families if f.parallelism is not None for c in found.get(f.label, [])]
        mp_best = min(mp, key=lambda c: c.time.total_s, default=None)
        if best is not None and mp_best is not None:
            ratio = mp_best.time.total_s / best.time.total_s
            notes.append(f"data parallel fits and is fastest: the best model-parallel layout ({mp_best.family}) takes "
                         f"x{ratio:.2f} as long (its collectives cost more than sharding the states over dp alone)")
        elif best is not None:
            notes.append("data parallel fits; no model-parallel layout fits with margin")
        return notes
    if dp_best is None:
        leanest = min((peak for f in families if f.parallelism is None and f.tier == 0
                       for peak, _ in [smallest.get(f.label, (None, None))] if peak is not None), default=None)
        what = f"the leanest 1-D plan needs {fmt_bytes(leanest)} > {fmt_bytes(usable)} usable" if leanest else "no 1-D plan fits"
        notes.append(f"data parallel alone does not fit: {what} (micro-batch 1, full checkpointing)")
    else:
        ratio = dp_best.time.total_s / best.time.total_s
        notes.append(f"data parallel alone fits ({dp_best.label}, {fmt_bytes(dp_best.peak_bytes)}) but takes "
                     f"x{ratio:.2f} as long as {best.family}")
    par, t = best.plan.parallelism, best.plan.training
    if par.tp > 1:
        notes.append(f"tp={par.tp} inside the node ({cluster.gpus_per_node} GPUs, {gpu.intra_node_gbs:g} GB/s links): "
                     f"each linear 1/{par.tp}, sequence parallel {'on' if par.sequence_parallel else 'off'}, "
                     f"{dict(best.time.parts).get('tp', 0):.2f} s/step of TP collectives exposed")
    if par.pp > 1:
        m = par.pp_microbatches or t.grad_accum
        notes.append(f"pp={par.pp} across nodes ({cluster.nodes // par.pp} node(s) per stage): {par.pp_schedule} with "
                     f"{m} micro-batches, bubble (p-1)/m = {(par.pp - 1) / m:.0%} of the ideal step "
                     f"({dict(best.time.parts).get('bubble', 0):.2f} s)")
    if par.cp > 1:
        notes.append(f"cp={par.cp} for the {t.seq_len}-token sequence: {t.seq_len // par.cp} tokens per rank, ring "
                     f"K/V exchange behind attention ({dict(best.time.parts).get('cp', 0):.2f} s/step exposed)")
    if par.ep > 1:
        m = best.plan.model
        notes.append(f"ep={par.ep}: {m.num_experts // par.ep} of {m.num_experts} experts per rank, so a unit gathers "
                     f"1/{par.ep} of its experts; token all-to-all {dict(best.time.parts).get('ep', 0):.2f} s/step "
                     "exposed (balanced routing assumed)")
    dp_ranks = cluster.world_size // par.model_parallel
    notes.append(f"dp={dp_ranks}: fsdp2 shards the states over dp x cp = {dp_ranks * par.cp} ranks "
                 f"(world {cluster.world_size} = dp {dp_ranks} x tp {par.tp} x pp {par.pp} x cp {par.cp})")
    return notes
