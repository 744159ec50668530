"""The calibrate worker's FSDP figures, measured through shardfit's own engines on a transformers model:
the host work FSDP1 / FSDP2 add per unit, per micro-batch and per step, beyond DDP's.

A unit's host work is more than its collectives' latency: the pre-forward hook's all-gather with its
copy-in / copy-out, the recompute's forward hooks under checkpointing, the pre-backward unshard, the
post-backward reduce-scatter and its copies, FSDP2's gradient clipping and optimizer step through
DTensor. Bare linears, one to a unit, miss the checkpointing and a real block's per-parameter work
(they left FSDP plans ~25 ms under in the oracle), so the engines run tiny-llama (each block a unit) at
1 x 8 tokens, with full checkpointing, at accumulation 1 and 3, against DDP on the same model: the
difference over the units, less DDP's gradient hooks and the extra collectives' latency (the step-time
model charges those apart), is what fit/engine_overhead.py charges per unit.
"""
from __future__ import annotations

from functools import partial

from shardfit import engines
from shardfit.bench.calibrate_hooks import round_robin
from shardfit.fit.engine_overhead import trained_tensors
from shardfit.modeling import build_model
from shardfit.spec.models import load_model_spec
from shardfit.spec.plan import Plan, parse_strategy

ENGINE_MODEL = "tiny-llama"
ENGINE_KINDS = ("ddp", "fsdp2", "fsdp2:no_reshard", "fsdp:full_shard", "fsdp:shard_grad_op")
ENGINE_WARMUP = 3
ENGINE_ROUNDS = 30
ACCUMS = (1, 3)  # two accumulation lengths: their difference is the per-micro-batch work


def _plan(kind: str, accum: int, ranks: int):
    return Plan(model=load_model_spec(ENGINE_MODEL)).with_changes(
        strategy=parse_strategy(kind), cluster={"nodes": 1, "gpus_per_node": ranks},
        training={"micro_batch": 1, "seq_len": 8, "grad_accum": accum, "precision": "fp32",
                  "activation_checkpointing": "full"})


def fsdp_units(ctx, device: str, sync, latency_s: float, ddp_hook_s: float) -> dict:
    """{"<kind>_unit_micro": s, "<kind>_unit_step": s} for each FSDP strategy: host seconds per unit per
    micro-batch and per unit per optimizer step, beyond DDP's."""
    import torch

    def one_step(engine, accum: int, ids):
        batch = {"input_ids": ids, "labels": ids, "attention_mask": torch.ones_like(ids)}
        for micro in range(accum):
            engine.forward_backward(batch, micro == accum - 1)
        engine.step()

    ids = torch.randint(0, 320, (1, 8))
    runs = {}
    for kind in ENGINE_KINDS:
        for accum in ACCUMS:
            plan = _plan(kind, accum, ctx.world_size)
            model = build_model(plan.model, device="cpu", dtype="fp32", seed=0, attn_implementation="sdpa")
            engine = engines.setup(plan, model, ctx)
            for _ in range(ENGINE_WARMUP):
                one_step(engine, accum, ids)
            runs[(kind, accum)] = engine
    seconds = round_robin({key: partial(one_step, engine, key[1], ids) for key, engine in runs.items()}, sync,
                          ENGINE_ROUNDS)
    reference = _plan("ddp", 1, ctx.world_size)
    units = reference.model.num_layers + 1  # the blocks and the root
    ddp_micro = trained_tensors(reference) * ddp_hook_s  # DDP's hooks, in its own micro-batch
    figures = {}
    for kind in ENGINE_KINDS[1:]:
        reshards = kind in ("fsdp2", "fsdp:full_shard")
        # Collectives beyond DDP's one all-reduce: per unit a forward all-gather per micro-batch (and a
        # backward one where it reshards), one reduce-scatter per step.
        micro_collectives = units * (2 if reshards else 1)
        low, high = ACCUMS
        extra = (seconds[(kind, high)] - seconds[(kind, low)]) - (seconds[("ddp", high)] - seconds[("ddp", low)])
        per_micro = (extra / (high - low) + ddp_micro - micro_collectives * latency_s) / units
        per_step = (seconds[(kind, low)] - seconds[("ddp", low)] + low * ddp_micro + latency_s
                    - (low * micro_collectives + units) * latency_s) / units - low * per_micro
        name = kind.replace(":", "_")
        figures[f"{name}_unit_micro"], figures[f"{name}_unit_step"] = max(0.0, per_micro), max(0.0, per_step)
    if ctx.rank == 0:
        parts = ", ".join(f"{kind} {figures[kind.replace(':', '_') + '_unit_micro'] * 1e6:.0f} + "
                          f"{figures[kind.replace(':', '_') + '_unit_step'] * 1e6:.0f}" for kind in ENGINE_KINDS[1:])
        print(f"calibrate: FSDP engines ({ENGINE_MODEL}, full checkpointing): us per unit per micro-batch + per step: "
              f"{parts} (DDP step {seconds[('ddp', 1)] * 1e3:.1f} ms)", flush=True)
    return figures
