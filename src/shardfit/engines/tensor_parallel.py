"""Tensor parallelism for the FSDP2 engine: a 2-D (dp, tp) DeviceMesh, the model's own transformers TP
plan applied with torch's `parallelize_module`, then FSDP2 over the dp dimension (torchtitan's and
accelerate's composition, FSDP2 x TP).

The plan is the model's `_tp_plan` (transformers >= 5 merges the config's `base_model_tp_plan` under
the base-model prefix with the head's own entry): "colwise" -> ColwiseParallel, "rowwise" ->
RowwiseParallel, "embedding_rowwise" -> RowwiseParallel over the vocabulary (input replicated),
"colwise_gather_output" -> ColwiseParallel with the logits gathered, or, under the plan's vocab-parallel
loss (parallelism.loss_parallel), left sharded over the vocabulary into torch's loss_parallel
cross-entropy. Attention reshapes with -1 heads, so each rank runs heads / tp of them unchanged.
Ranks are laid out tp-innermost (torchtitan's order): ranks r and r+1 share a TP group inside a
node, and `data_rank` says which batch a rank must read (the same within a TP group).
"""
from __future__ import annotations

from contextlib import contextmanager

import torch

from shardfit.engines import sequence_parallel
from shardfit.errors import ShardfitError


def data_rank(plan, rank: int) -> int:
    """The data-parallel index of a global rank: the TP ranks of one group, and the stages of one
    pipeline, read the same batch (pp is the outermost mesh dimension, tp the innermost)."""
    par = plan.parallelism
    return (rank % max(1, plan.cluster.world_size // par.pp)) // par.tp


def _styles():
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    return {
        "colwise": lambda: ColwiseParallel(),
        "rowwise": lambda: RowwiseParallel(),
        "embedding_rowwise": lambda: RowwiseParallel(input_layouts=Replicate()),
        "colwise_gather_output": lambda: ColwiseParallel(output_layouts=Replicate()),
    }


def model_tp_plan(model) -> dict:
    """{module path pattern: style name} from the transformers model itself."""
    plan = dict(getattr(model, "_tp_plan", None) or {})
    if not plan:
        base = getattr(model.config, "base_model_tp_plan", None) or {}
        prefix = getattr(model, "base_model_prefix", "")
        plan = {f"{prefix}.{key}" if prefix else key: style for key, style in base.items()}
    if not plan:
        raise ShardfitError(f"{type(model).__name__} has no tensor-parallel plan (transformers' base_model_tp_plan): "
                            "set parallelism.tp to 1")
    return plan


def apply(plan, model, ctx):
    """Shard `model` in place over the tp dimension; return the dp mesh FSDP2 shards over."""
    from torch.distributed.device_mesh import init_device_mesh

    par = plan.parallelism
    if par.cp > 1 or par.pp > 1 or par.ep > 1:
        raise ShardfitError("the FSDP2 engine runs tp (with or without sequence parallel) with dp only: pp runs in "
                            "the pipeline engine, ep without tp (engines/expert_parallel.py), cp on no engine here")
    if par.loss_parallel and plan.training.loss == "chunked":
        raise ShardfitError("the chunked loss computes its own head in chunks, which the vocab-parallel loss cannot "
                            "shard: set parallelism.loss_parallel false (--no-loss-parallel) or training.loss standard")
    tp = par.tp
    if ctx.world_size % tp:
        raise ShardfitError(f"tp = {tp} does not divide the {ctx.world_size} ranks: choose a divisor")
    mesh = init_device_mesh(ctx.device.type, (ctx.world_size // tp, tp), mesh_dim_names=("dp", "tp"))
    wanted = model_tp_plan(model)
    if par.sequence_parallel:
        sequence_parallel.check(model, wanted)
    parallelize(model, mesh["tp"], wanted, type(model).__name__, tp_styles(par.sequence_parallel, par.loss_parallel))
    if par.sequence_parallel:
        sequence_parallel.shard_between_regions(model, mesh["tp"], wanted)
    _retie(model)
    return mesh["dp"]


def tp_styles(sp: bool = False, vocab_sharded: bool = False) -> dict:
    """The torch style of each transformers style name: activations replicated between the TP regions
    or sequence-sharded (sp: engines/sequence_parallel.py); the head's logits gathered or vocab-sharded
    (the plan's loss_parallel)."""
    styles = sequence_parallel.sp_styles() if sp else _styles()
    if vocab_sharded:
        styles["colwise_gather_output"] = lambda: _vocab_parallel_head(sp)
    return styles


def _vocab_parallel_head(sp: bool):
    """The head with its logits left sharded over the vocabulary (a DTensor, Shard(-1)): the model's own
    loss then runs under torch's `loss_parallel()` (engines/native.py), a vocab-parallel cross-entropy
    that never gathers the V-wide logits (torchtitan's and Megatron's)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel

    return ColwiseParallel(input_layouts=Shard(1) if sp else Replicate(), output_layouts=Shard(-1),
                           use_local_output=False)


def vocab_parallel(plan) -> bool:
    """Whether the engine's head leaves the logits vocab-sharded (the loss runs under loss_parallel)."""
    return plan.parallelism.tp > 1 and plan.parallelism.loss_parallel


@contextmanager
def gathered_logits(model):
    """The head's vocab-sharded logits gathered whole while inside (held-out loss, generation)."""
    head = model.get_output_embeddings()
    handle = head.register_forward_hook(lambda module, args, out: out.full_tensor() if hasattr(out, "full_tensor") else out)
    try:
        yield
    finally:
        handle.remove()


# transformers' own styles that need no torch ParallelStyle: hooks on a module whose parameters stay
# replicated. Qwen3's / Gemma-3's per-head q_norm and k_norm see only this rank's heads, so their
# gradients are partial and all-reduced over tp; MLA's kv_a_proj output has a rotary part that
# bypasses the colwise kv_b_proj and needs its gradient all-reduced. transformers' classes do it.
HOOK_STYLES = ("replicated_with_grad_allreduce", "mla_kv_a_proj")


def parallelize(module, tp_mesh, wanted: dict, name: str, styles: dict | None = None) -> None:
    """`parallelize_module` with the torch style of each transformers style name in `wanted`
    ({module path pattern: style}, paths relative to `module`); `name` is the model's, for the error;
    styles: the style table (default: replicated activations between the TP regions). The hook-only
    styles (HOOK_STYLES) are installed with transformers' own layer classes."""
    from torch.distributed.tensor.parallel import parallelize_module

    styles = styles or _styles()
    unknown = sorted({style for style in wanted.values() if style not in styles and style not in HOOK_STYLES})
    if unknown:
        raise ShardfitError(f"{name}'s TP plan uses '{unknown[0]}', which shardfit does not map yet "
                            f"(it maps {', '.join(styles)}, {', '.join(HOOK_STYLES)}): set parallelism.tp to 1")
    parallelize_module(module, tp_mesh, {path: styles[style]() for path, style in wanted.items()
                                         if style not in HOOK_STYLES})
    hooked = {path: style for path, style in wanted.items() if style in HOOK_STYLES}
    if hooked:
        _install_hook_styles(module, tp_mesh, hooked)


def _install_hook_styles(module, tp_mesh, hooked: dict) -> None:
    import fnmatch

    from transformers.integrations.tensor_parallel import ALL_PARALLEL_STYLES

    config = getattr(module, "config", None)
    config = config.get_text_config() if hasattr(config, "get_text_config") else config
    for path, sub in module.named_modules():
        for pattern, style in hooked.items():
            # NOTE: "*" stands for one path segment (a layer index), as in parallelize_module.
            if fnmatch.fnmatchcase(path, pattern) and path.count(".") == pattern.count("."):
                ALL_PARALLEL_STYLES[style].install_forward(sub, tp_mesh, config=config)


def _retie(model) -> None:
    """parallelize_module gives the embedding and the head each a new DTensor parameter, which unties
    tied embeddings (two copies, two gradients). Both are Shard(0) over the vocabulary on the tp
    mesh (embedding_rowwise, colwise), so the head takes the embedding's parameter back."""
    if not getattr(model.config, "tie_word_embeddings", False):
        return
    inputs, outputs = model.get_input_embeddings(), model.get_output_embeddings()
    if inputs is None or outputs is None or outputs.weight is inputs.weight:
        return
    if outputs.weight.placements != inputs.weight.placements or outputs.weight.shape != inputs.weight.shape:
        raise ShardfitError(f"{type(model).__name__}: its tied embedding and head are sharded differently by its TP "
                            "plan: set parallelism.tp to 1")
    outputs.weight = inputs.weight


def clip_grad_norm(params, max_norm: float, holders: int | None = None) -> torch.Tensor:
    """clip_grad_norm_ over parameters on different meshes (2-D dp x tp DTensors next to 1-D ones,
    which torch.stack cannot mix), in one all-reduce: each rank adds the squares of its local shards,
    each divided by the number of ranks holding that same shard (Replicate dimensions, ranks outside
    its mesh), so the sum over the world counts every element once. (A DTensor norm per gradient
    would all-reduce once per mesh dimension per parameter.) `holders`: how many ranks hold this
    rank's set of parameters (the world, or under pipeline parallelism the ranks of one stage: the
    other stages hold other parameters, whose squares the same all-reduce adds)."""
    import math

    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    grads = [p.grad for p in params if p.grad is not None]
    device = grads[0].device if grads else torch.device("cpu")
    holders = holders or dist.get_world_size()
    squares = torch.zeros((), dtype=torch.float64, device=device)
    for grad in grads:
        if isinstance(grad, DTensor):
            if any(placement.is_partial() for placement in grad.placements):
                grad = grad.redistribute(placements=[p if not p.is_partial() else _replicate() for p in grad.placements])
            # Ranks outside the gradient's mesh hold copies too: a norm's weight lives on the 1-D dp
            # mesh, once per TP rank.
            copies = holders // grad.device_mesh.size() * math.prod(
                grad.device_mesh.size(dim) for dim, placement in enumerate(grad.placements) if placement.is_replicate())
            local = grad.to_local()
        else:  # a plain tensor: the same on every rank
            copies, local = holders, grad
        squares += torch.linalg.vector_norm(local, dtype=torch.float32).double() ** 2 / copies
    dist.all_reduce(squares)
    total = squares.sqrt().float()
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for grad in grads:
        (grad.to_local() if isinstance(grad, DTensor) else grad).mul_(coef.to(grad.device))
    return total


def _replicate():
    from torch.distributed.tensor import Replicate

    return Replicate()
