"""The model one tensor / context-parallel rank trains, for a derived spec (any transformers config).

A hand-written family's rank is sliced by formula (model_parallel.local_model). A derived spec's is
the derived spec of the config that rank runs (spec/rank_config.py: heads, KV heads and the sliced
intermediate sizes / tp, head_dim pinned), checked against the model's own TP plan, so its traced
activations, temporaries and step instants are that rank's, from the model's own code. Then the
vocabulary: transformers' plans shard the embedding (`embedding_rowwise`) and the head (colwise) over
the vocabulary; the logits are gathered to the whole vocabulary (`colwise_gather_output`) unless the
loss is vocab-parallel. The sliced config is traced with the logits' width, and the embedding and
head rows this rank holds replace that width's in the parameter counts.

Context parallel alone is the unsliced model over seq / cp tokens (local_plan does that).
A pipeline rank holds some of the layers (their kinds from the spec's layer order), the embedding on
the first stage, the final norm, head and loss on the last (stage_model): the traced per-kind
coefficients scale to its layers; a stage without the head has no head terms (vocab_size 0, as the
hand-written ranks) and takes the assumed peak instants (the traced step runs the whole model).
Expert parallel (expert_sharded): the rank holds num_experts / ep of each MoE block's routed experts
(the `experts` tensors with one row per expert, as derived); the router and shared experts stay whole.
No torch on a cached spec.
"""
from __future__ import annotations

import math
from dataclasses import replace

from shardfit.errors import ShardfitError
from shardfit.estimate.derived import source_config
from shardfit.spec import rank_config
from shardfit.spec.model_spec import ModelSpec
from shardfit.spec.parallelism import chunk_layers, rank_chunks
from shardfit.spec.models import derived_spec
from shardfit.spec.spec_cache import read_entry


def check_layout(model: ModelSpec, layout) -> None:
    if layout.pp > 1 and not model.layer_kinds:
        raise ShardfitError(f"{model.name}: its cached spec predates pipeline estimates (no layer order): clear the "
                            f"cache (shardfit models --clear-cache) and plan it again")
    if layout.ep > 1 and not any(model.kind_expert_params):
        raise ShardfitError(f"{model.name}: no routed experts found (tensors under an `experts` module with one row per "
                            f"expert), so expert parallel has nothing to split: set ep to 1")
    if layout.tp > 1:
        rank_config.check_plan(model, layout.tp)


def _config(model: ModelSpec) -> dict:
    entry = read_entry(model.config_hash) if model.config_hash else None
    if entry is not None:
        return entry["config"]
    return source_config(model, "tensor parallel derives the config one rank runs")


def local_model(model: ModelSpec, tp: int, loss_parallel: bool) -> ModelSpec:
    """The spec one rank of a tp group trains (the whole model at tp 1)."""
    if tp == 1:
        return model
    h, vocab = model.hidden_size, model.vocab_size
    shard = -(-vocab // tp)
    embed_rows = shard if rank_config.embedding_sharded(model) else vocab
    head_rows = shard if rank_config.head_sharded(model) else vocab
    logits = head_rows if loss_parallel else vocab
    cfg = _config(model)
    overrides = rank_config.tp_overrides(cfg, model, tp, logits)
    sliced = derived_spec(rank_config.with_overrides(cfg, overrides), f"{model.name}[rank]",
                          rank_config.encode_source(model.source, overrides))
    rank_config.check_sliced(model, sliced, tp)
    return _with_vocab_rows(sliced, embed_rows, head_rows)


def _with_vocab_rows(spec: ModelSpec, embed_rows: int, head_rows: int) -> ModelSpec:
    """The spec with its embedding and (untied) head holding these rows instead of the config's
    vocabulary (the logits' width the config was traced with)."""
    h, rows = spec.hidden_size, spec.vocab_size
    if embed_rows == rows and (spec.tie_embeddings or head_rows == rows):
        return spec
    new = [embed_rows] + ([] if spec.tie_embeddings else [head_rows])
    delta = sum(r - rows for r in new) * h
    shapes = dict(spec.tensor_shapes)
    shapes[(rows, h)] = shapes.get((rows, h), 0) - len(new)
    for r in new:
        shapes[(r, h)] = shapes.get((r, h), 0) + 1
    order = _swap_sizes(spec.param_order, rows * h, [r * h for r in new])
    sizes = [n for _, group, repeat in order for _ in range(repeat) for n in group]
    return replace(spec, n_params=spec.n_params + delta, non_block_params=spec.non_block_params + delta,
                   tensor_shapes=tuple(sorted((s, n) for s, n in shapes.items() if n > 0)), param_order=order,
                   largest_layer_params=max(math.prod(s) for s, n in shapes.items() if n > 0),
                   single_adam_peak=max(2 * n + (sizes[i - 1] if i else 0) for i, n in enumerate(sizes)))


def _swap_sizes(order: tuple, old: int, new: list) -> tuple:
    """param_order with the root groups' first len(new) tensors of `old` elements replaced, in order."""
    left = list(new)
    out = []
    for unit, group, repeat in order:
        if unit == "root":
            group = list(group)
            for i, n in enumerate(group):
                if left and n == old:
                    group[i] = left.pop(0)
            group = tuple(group)
        out.append((unit, group, repeat))
    if left:
        raise ShardfitError(f"cannot place the vocabulary-parallel embedding / head in the parameter order "
                            f"({len(left)} of {len(new)} tensors of {old} elements not found)")
    return tuple(out)


def rank_layer_indices(num_layers: int, pp: int, virtual: int, stage: int, schedule: str = "1f1b") -> list[int]:
    """The layers pipeline rank `stage` holds, in model order: its chunks of pp x virtual (chunk_layers,
    placed by spec/parallelism.rank_chunks)."""
    sizes = chunk_layers(num_layers, pp * virtual)
    starts = [sum(sizes[:k]) for k in range(len(sizes))]
    return sorted(i for k in rank_chunks(stage, pp, virtual, schedule) for i in range(starts[k], starts[k] + sizes[k]))


def _layer_kinds(model: ModelSpec) -> list[int]:
    return [kind for kind, run in model.layer_kinds for _ in range(run)]


def stage_model(model: ModelSpec, rank: ModelSpec, layers: list[int], first: bool, last: bool) -> ModelSpec:
    """The spec of a pipeline rank holding `layers` of `rank` (the tp rank's spec, or the model):
    the embedding if first, the final norm and head if last."""
    if first and last and len(layers) == rank.num_layers:
        return rank
    kinds = _layer_kinds(model)
    counts = [sum(1 for i in layers if kinds[i] == k) for k in range(len(rank.block_kinds))]
    block_kinds = tuple((name, n, params) for (name, _, params), n in zip(rank.block_kinds, counts))
    h, rows = rank.hidden_size, rank.vocab_size
    roots = [group for unit, group, _ in rank.param_order if unit == "root"]
    before = list(roots[0]) if rank.param_order and rank.param_order[0][0] == "root" else []
    after = list(roots[-1]) if rank.param_order and rank.param_order[-1][0] == "root" else []
    # The tied head is the embedding's tensor; a last stage without the embedding holds its own copy
    # (the rows of `before`'s embedding), as Megatron does.
    if rank.tie_embeddings and last and not first:
        after = after + [before[0]] if before else after
    held_roots = (before if first else []) + (after if last else [])
    non_block = sum(held_roots)
    blocks = [group for unit, group, repeat in rank.param_order if unit == "block" for _ in range(repeat)]
    sizes = (before if first else []) + [n for i in layers for n in blocks[i]] + (after if last else [])
    # Tensor shapes (the largest tensor, Adafactor's factors): the embedding and untied head where held,
    # the rest (blocks, norms) in proportion to the layers held.
    shapes = dict(rank.tensor_shapes)
    taken = []
    for numel in before[:1] + ([] if rank.tie_embeddings else after[-1:]):  # the embedding, the untied head
        shape = next((s for s, n in shapes.items() if n > 0 and math.prod(s) == numel), None)
        if shape is not None:
            shapes[shape] -= 1
            taken.append(shape)
    shapes = {s: -(-n * len(layers) // rank.num_layers) for s, n in shapes.items() if n > 0}
    for shape in (taken[:1] if first else []) + ((taken[-1:]) if last else []):
        shapes[shape] = shapes.get(shape, 0) + 1
    return replace(rank, name=f"{model.name}[stage]", num_layers=len(layers), block_kinds=block_kinds,
                   n_params=sum(n * p for _, n, p in block_kinds) + non_block, non_block_params=non_block,
                   block_params=max((p for _, n, p in block_kinds if n), default=0),
                   vocab_size=rows if last else 0, tensor_shapes=tuple(sorted(shapes.items())), param_order=(),
                   largest_layer_params=max((math.prod(s) for s in shapes), default=0),
                   single_adam_peak=max((2 * n + (sizes[i - 1] if i else 0) for i, n in enumerate(sizes)), default=0))


def expert_sharded(rank: ModelSpec, ep: int) -> ModelSpec:
    """The spec of a rank holding num_experts / ep of every MoE block's routed experts: the states
    expert parallel leaves it (estimate/expert_parallel.with_experts_sharded takes the activations from
    the unsharded rank: balanced routing keeps the rows per rank)."""
    experts = rank.num_experts
    if experts % ep:
        raise ShardfitError(f"ep = {ep} must divide {rank.name}'s {experts} experts: choose a divisor")
    kinds = tuple((name, n, params - routed + routed // ep)
                  for (name, n, params), routed in zip(rank.block_kinds, rank.kind_expert_params))
    cut = sum(n * (routed - routed // ep) for (_, n, _), routed in zip(rank.block_kinds, rank.kind_expert_params))
    shapes = {}
    for shape, n in rank.tensor_shapes:
        key = (shape[0] // ep,) + tuple(shape[1:]) if len(shape) >= 3 and shape[0] == experts else shape
        shapes[key] = shapes.get(key, 0) + n
    return replace(rank, num_experts=experts // ep, block_kinds=kinds, n_params=rank.n_params - cut,
                   block_params=max((p for _, n, p in kinds if n), default=0),
                   kind_expert_params=tuple(routed // ep for routed in rank.kind_expert_params),
                   tensor_shapes=tuple(sorted(shapes.items())), param_order=(), single_adam_peak=0)
