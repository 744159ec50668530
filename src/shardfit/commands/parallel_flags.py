"""The parallelism flags (--tp, --pp, --cp, --sp, ...), spelled the same wherever a command takes
them: each sets one field of the plan's `parallelism` section (spec/parallelism.py); a flag not given
keeps the plan file's value."""
from __future__ import annotations

from dataclasses import replace

from shardfit.spec.parallelism import schedule_fixed_chunks

# flag dest -> Parallelism field
_FIELDS = {"tp": "tp", "cp": "cp", "pp": "pp", "ep": "ep", "dp_replicate": "dp_replicate", "dp_shard": "dp_shard",
           "pp_schedule": "pp_schedule", "pp_virtual": "pp_virtual_stages", "pp_microbatches": "pp_microbatches"}


def add_parallel_arguments(parser) -> None:
    group = parser.add_argument_group("parallelism (per rank: world = dp_replicate x dp_shard x tp x cp x pp)")
    group.add_argument("--tp", type=int, default=None, help="tensor-parallel degree (inside a node)")
    group.add_argument("--sp", action="store_true", default=None, dest="sp",
                       help="sequence parallel in the TP regions (needs --tp > 1)")
    group.add_argument("--no-loss-parallel", action="store_false", default=None, dest="loss_parallel",
                       help="gather the logits on every TP rank (the model's own transformers TP plan, what "
                            "the engine runs) instead of a vocab-parallel loss (default, Megatron / torchtitan)")
    group.add_argument("--cp", type=int, default=None, help="context-parallel degree (ring attention over the sequence)")
    group.add_argument("--pp", type=int, default=None, help="pipeline stages")
    group.add_argument("--pp-schedule", default=None,
                       help="gpipe | 1f1b (default) | interleaved | zero-bubble (ZB1P) | zbv | dualpipev")
    group.add_argument("--pp-virtual", type=int, default=None,
                       help="model chunks per pipeline rank (interleaved, zero-bubble; zbv / dualpipev: 2, the default)")
    group.add_argument("--pp-microbatches", type=int, default=None,
                       help="micro-batches per step through the pipeline (default: --grad-accum)")
    group.add_argument("--ep", type=int, default=None, help="expert-parallel degree (MoE)")
    group.add_argument("--dp-replicate", type=int, default=None, help="replicated data-parallel degree (default: from the strategy)")
    group.add_argument("--dp-shard", type=int, default=None, help="sharded data-parallel degree (default: from the strategy)")


def parallelism_from_args(args, current):
    """The plan's Parallelism with the given flags applied."""
    changes = {name: getattr(args, dest) for dest, name in _FIELDS.items() if getattr(args, dest, None) is not None}
    if isinstance(changes.get("pp_schedule"), str):
        changes["pp_schedule"] = changes["pp_schedule"].strip().lower()
    if getattr(args, "sp", None):
        changes["sequence_parallel"] = True
    if getattr(args, "loss_parallel", None) is False:
        changes["loss_parallel"] = False
    if changes.get("pp_virtual_stages", 0) > 1 and "pp_schedule" not in changes:
        changes["pp_schedule"] = "interleaved"
    if "pp_virtual_stages" not in changes:
        changes.update(schedule_fixed_chunks(changes.get("pp_schedule", "")))
    return replace(current, **changes)
