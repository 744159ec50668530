"""Sequence parallelism on top of the model's own TP plan (Korthikanti et al. 2022; torch's
SequenceParallel, as torchtitan composes it): between the TP regions the activations are sharded
over the sequence on the tp ranks instead of replicated.

From the model's transformers TP plan: each rowwise linear (o_proj, down_proj) reduce-scatters its
output over the sequence (Shard(1), kept a DTensor so the residual adds stay sharded), the vocab-
parallel embedding does the same, the head all-gathers its sequence-sharded input; the norms run on
their sequence shard (SequenceParallel); and each module that owns the colwise linears (attention,
MLP) all-gathers its sequence-sharded input once on entry, which is the tensor its backward keeps.
"""
from __future__ import annotations

from shardfit.errors import ShardfitError
from shardfit.spec.tp_modules import between_region_norms, colwise_owners


def sp_styles() -> dict:
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    return {
        "colwise": lambda: ColwiseParallel(),
        "rowwise": lambda: RowwiseParallel(output_layouts=Shard(1), use_local_output=False),
        "embedding_rowwise": lambda: RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1),
                                                     use_local_output=False),
        "colwise_gather_output": lambda: ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate()),
    }


def _gather_sequence(module, args, kwargs):
    """Forward pre-hook of a module owning colwise linears: its hidden states (first positional
    argument or `hidden_states=`), sequence-sharded, all-gathered to a replicated local tensor (the
    backward reduce-scatters the gradient)."""
    from torch.distributed.tensor import DTensor, Replicate

    def gather(x):
        return x.redistribute(placements=[Replicate()]).to_local() if isinstance(x, DTensor) else x

    if args:
        args = (gather(args[0]), *args[1:])
    if "hidden_states" in kwargs:
        kwargs = {**kwargs, "hidden_states": gather(kwargs["hidden_states"])}
    return args, kwargs


def check(model, wanted: dict) -> None:
    if "embedding_rowwise" not in wanted.values() or "colwise_gather_output" not in wanted.values():
        raise ShardfitError(f"{type(model).__name__}'s TP plan has no vocab-parallel embedding and gathered head, "
                            "which sequence parallel starts and ends at: set parallelism.sequence_parallel false")


def shard_between_regions(model, tp_mesh, wanted: dict) -> None:
    """After the linears have their sequence-parallel styles (sp_styles): the norms on sequence shards
    and the all-gather on entry to each module that owns colwise linears. `wanted`: the model's TP plan."""
    from torch.distributed.tensor.parallel import SequenceParallel, parallelize_module

    modules = dict(model.named_modules())
    for name in colwise_owners(model, wanted):
        modules[name].register_forward_pre_hook(_gather_sequence, with_kwargs=True)
    # The same norms the estimator's trace counts as sharded (spec/tp_modules.py).
    norms = {name: SequenceParallel() for name in between_region_norms(model, wanted)}
    if not norms:
        raise ShardfitError(f"{type(model).__name__} has no RMSNorm / LayerNorm modules to run on sequence shards: "
                            "set parallelism.sequence_parallel false")
    parallelize_module(model, tp_mesh, norms)
