"""Expert parallelism in the per-rank estimate and the step time: a rank holds num_experts / ep experts
of each MoE block; under FSDP2 (experts sharded over dp_shard*cp/ep ranks) its states are those of the
plan without EP, what a unit gathers shrinks, the saved activations stay (balanced routing) and the
token dispatch adds its all-to-all buffer; a replicating strategy keeps E/ep experts' states."""
from __future__ import annotations

from dataclasses import replace

import pytest

from shardfit.estimate.estimator import estimate
from shardfit.estimate.expert_parallel import expert_weights
from shardfit.estimate.model_parallel import local_model
from shardfit.fit.parallel_time import step_time
from shardfit.spec.models import load_model_spec
from shardfit.spec.parallelism import Parallelism, resolve
from shardfit.spec.plan import Plan, Strategy

STATES = ("params", "grads", "optimizer")


def _plan(ep: int, kind: str = "fsdp2", cp: int = 1, nodes: int = 8):
    return Plan(model=load_model_spec("mixtral-8x7b")).with_changes(
        strategy=Strategy(kind=kind), cluster={"nodes": nodes, "gpus_per_node": 8},
        training={"micro_batch": 1, "seq_len": 4096, "precision": "bf16", "activation_checkpointing": "full"},
        parallelism=Parallelism(ep=ep, cp=cp))


def test_a_rank_holds_its_share_of_the_experts():
    model = load_model_spec("mixtral-8x7b")
    experts = expert_weights(model)
    assert experts == 3 * 4096 * 14336 * 8  # gate, up, down of 8 experts
    layout = resolve(_plan(8))
    whole, sharded = (local_model(model, layout, model.num_layers, True, True, ep=ep) for ep in (1, 8))
    assert whole.block_params - sharded.block_params == experts - experts // 8
    assert sharded.num_experts == 1 and sharded.experts_per_token == model.experts_per_token


@pytest.mark.parametrize("ep", [2, 8])
def test_fsdp2_expert_parallel_keeps_states_and_activations_and_shrinks_gathered_units(ep):
    base, est = estimate(_plan(1)), estimate(_plan(ep), explain=True)
    for phase, cats in est.phases.items():
        for category in STATES + ("activations",):
            assert cats[category] == base.phases[phase][category], (phase, category)
    a2a = est.term("parallel.ep_all_to_all").bytes
    assert a2a == 1 * 4096 * 2 * 4096 * 2  # b * s * top_k * h * bf16
    # The gathered block: 7/8 (ep 8) or 1/2 (ep 2) of a Mixtral block's experts fewer, in bf16.
    assert base.phases["backward"]["temporaries"] - (est.phases["backward"]["temporaries"] - a2a) > \
        (1 - 1 / ep) * expert_weights(load_model_spec("mixtral-8x7b")) * 2
    assert est.peak_bytes < base.peak_bytes
    assert any("balanced routing" in note for note in est.assumptions)


def test_a_replicating_strategy_keeps_only_its_experts_states():
    """DDP borrows the ep ranks from cp (it has no dp_shard): each rank keeps E/ep experts, unsharded."""
    model = load_model_spec("mixtral-8x7b")
    base, est = estimate(_plan(1, "ddp", cp=2, nodes=64)), estimate(_plan(2, "ddp", cp=2, nodes=64))
    removed = model.num_layers * (expert_weights(model) - expert_weights(model) // 2)
    ratio = base.phases["load"]["params"] / model.n_params
    assert base.phases["load"]["params"] - est.phases["load"]["params"] == pytest.approx(removed * ratio, rel=1e-6)
    assert est.phases["forward"]["activations"] == base.phases["forward"]["activations"]


def test_step_time_adds_the_dispatch_all_to_all_and_ep_across_nodes_costs_more():
    inside = step_time(_plan(8))
    assert dict(inside.parts)["ep"] > 0
    across = step_time(replace(_plan(8), parallelism=Parallelism(ep=8, tp=2)))  # ep peers 2 x 7 ranks apart: NICs
    assert dict(across.parts)["ep"] > dict(inside.parts)["ep"]
    assert "ep" not in dict(step_time(_plan(1)).parts or ())
