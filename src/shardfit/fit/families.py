"""The plan space `fit` searches, in the order the field recommends trying it.

Order (the tie-break when two plans are about as fast): on one GPU, single (no wrapper); plain DDP, ZeRO-1, ZeRO-2 (shard optimizer
state, then gradients), parameter sharding (ZeRO-3 / FSDP), hybrid sharding across nodes, and
offload last. At equal sharding, DeepSpeed comes first (the field's ZeRO naming), then FSDP2, then
FSDP1 (deprecated in torch and transformers). Activation checkpointing and micro-batch/accumulation are searched inside each family.
"""
from __future__ import annotations

from dataclasses import dataclass

from shardfit.spec.parallelism import Parallelism
from shardfit.spec.plan import Strategy

# DeepSpeed buffer variants. "default" is DeepSpeed's own (5e8 elements: ~1 GB per bucket in
# 16-bit, which is what makes ZeRO sometimes need more memory than the model). "auto" is what HF's
# integration derives from the hidden size (transformers/integrations/deepspeed.py:
# reduce_bucket_size = h², stage3_prefetch_bucket_size = 0.9·h², persistence threshold = 10·h).
BUCKET_VARIANTS = ("default", "auto")
# The field's order: no recompute, then per-op selective (keeps matmul and attention outputs, recomputes
# the cheap ops), per-layer (every other block), full.
AC_OPTIONS = ("none", "selective", "every-2", "full")
# Two plans within this fraction of each other's step time count as a tie: the field's order decides.
TIE = 0.02


@dataclass(frozen=True)
class Family:
    label: str
    strategy: Strategy
    order: int
    tier: int  # 0 = no offload, 1 = CPU offload, 2 = NVMe offload: searched only if the tier before found nothing
    multi_node_only: bool = False
    parallelism: Parallelism | None = None  # a tp x pp x cp layout (fit/layouts.py); None: data parallel only


# Memory and time don't depend on where the NVMe is mounted; a plan that is written out must
# name the real mount (`fit --nvme-path`), which the fit command checks before writing.
NVME_PLACEHOLDER = "/local_nvme"


def families(gpus_per_node: int, nodes: int, hidden_size: int, nvme_path: str | None = None) -> list[Family]:
    """Every strategy family that makes sense for this cluster, in the field's order."""
    group = gpus_per_node
    # One GPU in all: the plain loop comes first (DDP there only adds its reducer's bucket copy).
    out = [Family("single", Strategy(kind="single"), -1, 0)] if gpus_per_node * nodes == 1 else []
    out += [
        Family("ddp", Strategy(kind="ddp"), 0, 0),
        Family("zero1", Strategy(kind="zero1"), 1, 0),
        Family("zero2", Strategy(kind="zero2"), 2, 0),
        Family("fsdp2:no_reshard", Strategy(kind="fsdp2", reshard_after_forward=False), 3, 0),
        Family("fsdp:shard_grad_op", Strategy(kind="fsdp", sharding="shard_grad_op"), 4, 0),
        Family("zero3", Strategy(kind="zero3"), 5, 0),
        Family("fsdp2", Strategy(kind="fsdp2"), 6, 0),
        Family("fsdp:full_shard", Strategy(kind="fsdp", sharding="full_shard"), 7, 0),
    ]
    if nodes > 1:
        out.append(Family("fsdp2:hybrid", Strategy(kind="fsdp2", shard_group_size=group), 8, 0, True))
    if nodes > 1 and group >= 2:
        # FSDP1 hybrid with a shard group of 1 silently never syncs replicas (engines-on-cpu.md):
        # only offered with 2+ GPUs per node.
        out.append(Family("fsdp:hybrid_shard", Strategy(kind="fsdp", sharding="hybrid_shard",
                                                        shard_group_size=group), 9, 0, True))
    out += [
        Family("zero2+offload", Strategy(kind="zero2", offload_optimizer="cpu"), 10, 1),
        Family("zero3+offload-opt", Strategy(kind="zero3", offload_optimizer="cpu"), 11, 1),
        Family("fsdp2+offload", Strategy(kind="fsdp2", offload_params="cpu"), 12, 1),
        Family("zero3+offload", Strategy(kind="zero3", offload_optimizer="cpu", offload_params="cpu"), 13, 1),
        Family("zero3+offload-nvme", Strategy(kind="zero3", offload_optimizer="nvme", offload_params="nvme",
                                              nvme_path=nvme_path or NVME_PLACEHOLDER), 14, 2),
    ]
    return out


def engine_of(strategy: Strategy) -> str:
    if strategy.kind in ("single", "ddp"):
        return strategy.kind
    return "deepspeed" if strategy.is_deepspeed else "fsdp"


def bucket_changes(variant: str, hidden_size: int) -> dict:
    """Strategy field changes for a DeepSpeed buffer variant."""
    if variant == "default" or not hidden_size:
        return {}
    h2 = hidden_size * hidden_size
    return {"reduce_bucket_size": h2, "allgather_bucket_size": h2, "prefetch_bucket_size": int(0.9 * h2),
            "param_persistence_threshold": 10 * hidden_size}
