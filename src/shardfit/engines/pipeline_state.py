"""The pipeline engine's state under the whole model's names: a rank holds some stages' layers, but
its checkpoints and exports use the names the unsplit transformers model has (model.embed_tokens,
model.layers.<index>, model.norm, lm_head), so a DCP checkpoint saved at pp = 2 loads at pp = 1,
under DDP or FSDP2, and the other way round; DCP plans which rank reads which tensor."""
from __future__ import annotations

import torch
import torch.distributed as dist

from shardfit.engines import base
from shardfit.spec.parallelism import chunk_rank


def named_root(model, modules) -> torch.nn.Module:
    """A module holding this rank's chunks' parameters (the same Parameter objects) under the full
    model's names; it is never run, only its state dict is read and loaded."""
    inner = base.unwrap(model)
    root, body = torch.nn.Module(), torch.nn.Module()
    root.config = inner.config  # export writes the model's config.json from it
    setattr(root, inner.base_model_prefix, body)
    body.layers = torch.nn.ModuleDict()
    for module in modules:
        for index, layer in zip(module.indices, module.layers):
            body.layers[str(index)] = layer
        if module.embed_tokens is not None:
            body.embed_tokens = module.embed_tokens
        if module.norm is not None:
            body.norm = module.norm
            root.lm_head = module.lm_head
    return root


def owner_rank(name: str, prefix: str, chunk_of_layer: dict, chunks: int, stages: int, schedule: str) -> int:
    """The pipeline rank holding tensor `name` of the full model."""
    virtual = chunks // stages
    if name.startswith(f"{prefix}.layers."):
        return chunk_rank(chunk_of_layer[int(name.split(".")[2])], stages, virtual, schedule)
    if name.startswith(f"{prefix}.embed_tokens."):
        return 0
    return chunk_rank(chunks - 1, stages, virtual, schedule)  # the final norm and the head


def full_state(model, root, ctx, stage_index: int, stage_ranks: int, counts: tuple, stages: int, schedule: str):
    """(name, tensor) for every tensor of the full model, in its state-dict order: the stage that holds
    it gathers it whole (a collective over that stage's dp x tp ranks), its first rank sends it to
    rank 0, which yields it (the other ranks get None). Every rank must iterate."""
    inner = base.unwrap(model)
    prefix = inner.base_model_prefix
    chunk_of_layer = {layer: k for k, count in enumerate(counts) for layer in range(sum(counts[:k]), sum(counts[:k + 1]))}
    local = root.state_dict()
    for name, reference in inner.state_dict().items():  # meta tensors for the other stages: names, shapes, dtypes
        owner = owner_rank(name, prefix, chunk_of_layer, len(counts), stages, schedule)
        tensor = None
        if owner == stage_index:
            tensor = local[name]
            tensor = tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor
            tensor = tensor.detach()
        if owner != 0:
            source = owner * stage_ranks  # that stage's first rank (its dp and tp index 0)
            if ctx.rank == source:
                dist.send(tensor.contiguous().to(ctx.device), dst=0)
            elif ctx.is_main:
                tensor = torch.empty(reference.shape, dtype=reference.dtype, device=ctx.device)
                dist.recv(tensor, src=source)
        yield name, (tensor.cpu() if ctx.is_main else None)
