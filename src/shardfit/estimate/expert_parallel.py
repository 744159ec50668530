"""Expert parallelism on one rank: which weights are the routed experts', and the rank's estimate
with num_experts / ep of them (balanced routing, stated in the estimate's assumptions)."""
from __future__ import annotations

from dataclasses import replace

from shardfit.estimate.result import Estimate, Term
from shardfit.estimate.states import block_linears
from shardfit.spec.model_spec import ModelSpec
from shardfit.spec.parallelism import Layout


def expert_weights(model: ModelSpec) -> int:
    """The routed experts' weights in one block (their MLP linears, one copy per expert)."""
    if not model.num_experts:
        return 0
    return sum(i * o * n for name, i, o, n in block_linears(model)
               if n == model.num_experts and name in ("gate_proj", "up_proj", "down_proj"))


def with_experts_sharded(plan, layout: Layout, est: Estimate, sharded: Estimate, tokens: int, d: int) -> Estimate:
    """Expert parallelism on a rank: it holds num_experts / ep experts per MoE block and computes on the
    b*s*top_k rows routed to them, which balanced routing makes as many as without EP, so the saved
    activations are unchanged. What a unit gathers in forward and backward is the sharded model's
    (temporaries). The states: FSDP2 shards the experts over dp_shard*cp/ep ranks (torchtitan's efsdp
    mesh), so a rank holds (E/ep) / (S/ep) = E/S of them, as without EP; a replicating strategy holds
    its E/ep. Plus one all-to-all's send buffer (the permuted rows, b*s*top_k*h) beside the received
    copy the experts save, inside a MoE block in forward and in backward."""
    states_from = est if plan.strategy.kind == "fsdp2" else sharded
    a2a = tokens * max(plan.model.experts_per_token, 1) * plan.model.hidden_size * d
    phases = {}
    for name, cats in est.phases.items():
        merged = {**states_from.phases[name], "activations": cats["activations"],
                  "temporaries": sharded.phases[name]["temporaries"]}
        if name in ("forward", "backward"):
            merged["temporaries"] += a2a
        phases[name] = merged
    term = Term(name="parallel.ep_all_to_all", bytes=a2a, formula="b*(s/cp)*top_k*h*d (the dispatch's send buffer)",
                inputs={"ep": layout.ep, "top_k": plan.model.experts_per_token},
                source="balanced routing; torchtitan / Megatron token dispatch (all-to-all)")
    note = (f"expert parallel: {plan.model.num_experts // layout.ep} of {plan.model.num_experts} experts per MoE "
            f"block on each of ep = {layout.ep} ranks; ASSUMED balanced routing (every expert gets "
            "b*s*top_k/num_experts rows); a real router's imbalance adds to the busiest rank's expert activations")
    return replace(est, phases=phases, terms=est.terms + (term,), assumptions=(note,) + est.assumptions)
