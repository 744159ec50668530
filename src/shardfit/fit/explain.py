"""Why each family lost to the best plan. Words, not numbers alone (fit/suggest.py: when nothing fits)."""
from __future__ import annotations

from dataclasses import dataclass

from shardfit.fit.families import TIE, engine_of
from shardfit.fit.steptime import comm_volume
from shardfit.units import fmt_bytes


@dataclass(frozen=True, kw_only=True)
class Rejection:
    """Why a family did not win: one line of `fit`'s "why not the others"."""
    family: str
    reason: str


def _inter_bytes(plan) -> float:
    """Bytes per step that leave a node: a ring over the nodes sends one rank's volume across each
    node boundary; a per-rank NIC collective (hybrid's replica all-reduce) sends every rank's."""
    per_node = {"inter": 1, "nic": plan.cluster.gpus_per_node}
    return sum(volume * per_node.get(link, 0) for link, (volume, _) in comm_volume(plan).items())


def _why(cause: str, c, best) -> str:
    t, b = c.time, best.time
    ct, bt = c.plan.training, best.plan.training
    if cause == "comm":
        inter_c, inter_b = _inter_bytes(c.plan), _inter_bytes(best.plan)
        if c.plan.cluster.nodes > 1 and inter_c > inter_b * 1.05:
            why = (f"{inter_c / 1e9:,.0f} GB per step cross the inter-node network vs {inter_b / 1e9:,.0f} GB for "
                   f"{best.family}")
            if best.plan.strategy.shard_group_size:
                why += " (hybrid sharding keeps parameter all-gathers inside a node)"
            return why
        if b.comm_bytes > 0:
            more = t.comm_bytes / b.comm_bytes - 1
            why = f"{more:.0%} more communication per step" if more > 0.005 else "less of its communication overlaps compute"
        else:
            why = "it communicates where the winner does not"
        if c.plan.strategy.shards_params and not best.plan.strategy.shards_params:
            why += " (parameters are gathered again for every micro-batch)"
        return why
    if cause == "compute":
        if ct.activation_checkpointing != bt.activation_checkpointing and ct.activation_checkpointing != "none":
            return f"activation checkpointing ({ct.activation_checkpointing}) recomputes the forward"
        if ct.micro_batch < bt.micro_batch:
            return f"it only fits micro-batch {ct.micro_batch} (vs {bt.micro_batch}), which runs the GPU less efficiently"
        return "more compute per step"
    if cause == "offload":
        return "host-link traffic and CPU optimizer steps every step"
    if cause == "host":
        return (f"DeepSpeed's per-tensor / per-submodule hooks take {t.host_s * 1000:,.0f} ms per step vs "
                f"{b.host_s * 1000:,.0f} ms (ZeRO-3 fetches each partitioned submodule in forward and backward)")
    return "a slower optimizer update"


def slower_reason(c, best) -> str:
    """One line: how `c` fits and what makes it slower than `best`: every part of the step that adds at
    least a quarter of the difference, largest first."""
    t, b = c.time, best.time
    ratio = t.total_s / b.total_s if b.total_s else 1.0
    ct = c.plan.training
    head = f"fits (micro-batch {ct.micro_batch}, AC {ct.activation_checkpointing})"
    if best.family == "single" and ratio <= 1 + TIE:
        if engine_of(c.plan.strategy) == "ddp":
            return (f"{head}, but on one GPU DDP only adds its reducer's bucket copy of every gradient: single "
                    "runs the same step without it")
        return (f"{head}, but on one GPU it shards nothing: single runs the step with no wrapper, launcher or "
                "collectives")
    if ratio <= 1 + TIE:
        return f"{head} and is about as fast (x{ratio:.2f}), but {best.family} comes first in the field's order"
    deltas = {"comm": t.exposed_comm_s - b.exposed_comm_s, "compute": t.compute_s - b.compute_s,
              "offload": t.offload_s - b.offload_s, "optimizer": t.optimizer_s - b.optimizer_s,
              "host": t.host_s - b.host_s}
    worse = sum(d for d in deltas.values() if d > 0)
    causes = [k for k in sorted(deltas, key=deltas.get, reverse=True) if deltas[k] > 0 and deltas[k] >= 0.25 * worse]
    return f"{head} but a step takes x{ratio:.2f} as long: " + "; ".join(_why(k, c, best) for k in causes[:2])


def explain_rejections(best, found, smallest, all_families, searched_tiers, search) -> list:

    out = []
    for fam in all_families:
        if best is not None and fam.label == best.family:
            continue
        if fam.tier not in searched_tiers:
            what = "offload" if fam.tier == 1 else "NVMe offload"
            rung = f" (with {best.rung})" if best.rung else ""
            out.append(Rejection(family=fam.label, reason=f"not needed: {best.family} fits without {what}{rung}; "
                                 "offload is the last resort (host-link traffic every step)"))
        elif found.get(fam.label):
            out.append(Rejection(family=fam.label, reason=slower_reason(found[fam.label][0], best)))
        elif fam.label in smallest:
            peak, plan = smallest[fam.label]
            est = search.run(plan)
            if not search.host_ok(plan):
                out.append(Rejection(family=fam.label, reason=(
                    f"does not fit in host RAM: {fmt_bytes(search.host_bytes(plan))} per node at micro-batch 1 > "
                    f"{search.request.base.cluster.host_memory_gib:g} GiB (--host-memory-gib)")))
                continue
            out.append(Rejection(family=fam.label, reason=(
                f"does not fit: {fmt_bytes(peak)} at micro-batch 1 with AC {plan.training.activation_checkpointing}"
                f"{' and the chunked loss' if plan.training.loss == 'chunked' else ''} > {fmt_bytes(search.usable)} usable "
                f"({est.peak_category} is the largest part, at the {est.peak_phase} peak)")))
    return out
