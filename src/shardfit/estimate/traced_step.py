"""The traced backward and forward instants (estimate/backward_timeline.py) scaled to the full depth
at a plan's (b, s): the blocks the reduced copy lacks are either all still ahead of the running one
or all done, and every gradient hook of the full model in backward order. No torch here."""
from __future__ import annotations

from functools import lru_cache
from typing import NamedTuple

from shardfit.estimate.backward_timeline import FORWARD_SERIES, SERIES, load_backward
from shardfit.estimate.derived import evaluate


class BackwardInstant(NamedTuple):
    """One traced backward instant at full depth, in bytes as one device holds them (every gradient in
    .grad). part: "post" (head and loss), "block", "pre" (embedding); inside a block, whether the full
    model has a block above it (backward already through it) and below it (still ahead); end: the
    part's last op."""
    part: str
    above: bool
    below: bool
    end: bool
    activations: int
    grads_current: int
    grads_done: int
    temporaries: int
    weight_copies: int
    grads_pending: int  # of those, in .grad with their post-accumulate-grad hook not yet finished
    grads_hooked: int   # made and hooked (DeepSpeed: copied into its buckets)
    hook: int = -1   # the k-th gradient hook moment of its part (the node that made it has released its inputs)
    layer: int = -1  # the full model's layer this block instant stands for (-1: head or embedding part)


class ForwardInstant(NamedTuple):
    part: str
    activations: int
    temporaries: int
    weight_copies: int


class TracedStep(NamedTuple):
    """The traced instants at full depth, and the gradient bytes the head, the embedding and the whole
    model make (what engines that move gradients need to split grads_done)."""
    backward: tuple
    forward: tuple
    head_grads: int
    embedding_grads: int
    all_grads: int
    hook_sequence: tuple = ()  # ((part, layer, k, elements), ...): every gradient hook of the full model, in order


@lru_cache(maxsize=1024)
def full_depth_instants(spec, regime: str, attention: str, lora, checkpointing: str, beyond_window: bool,
                        b: int, s: int, block_acts: int, block_casts: int, forward_casts: int) -> TracedStep:
    """The traced step scaled to the full depth at (b, s). block_acts / block_casts: what one block not
    yet reached holds in backward (its saved tensors, or its checkpointed input and what SAC kept; its
    autocast weight casts kept for backward); forward_casts: the casts one block adds to autocast's
    cache in forward."""
    traced = load_backward(spec, regime, attention, lora, checkpointing, beyond_window)
    reduced_kinds = traced["reduced_kinds"]
    full = [count for _, count, _ in spec.block_kinds]
    extra = [max(0, n - reduced_kinds.count(kind)) for kind, n in enumerate(full)]
    grads = traced["block_grads"]
    per_kind_grads = [sum(g for g, k in zip(grads, reduced_kinds) if k == kind) / max(reduced_kinds.count(kind), 1)
                      for kind in range(len(full))]
    ahead = (sum(extra) * block_acts, sum(extra) * block_casts)
    behind = int(sum(n * g for n, g in zip(extra, per_kind_grads)))
    backward = []
    top = len(reduced_kinds) - 1
    missing = sum(extra) > 0
    layer_kinds = [kind for kind, run in spec.layer_kinds for _ in range(run)] or [0] * sum(full)
    layers = len(layer_kinds)
    for instant in traced["instants"]:
        a, gc, gd, t, w, pending, hooked = (int(evaluate(instant[name], b, s)) for name in SERIES)
        part, end, index, hook = instant["part"], instant.get("end", False), instant["block"], instant["hook"]
        if part != "pre":  # the missing blocks still ahead (below this block): it is one of the top ones
            layer = layers - 1 - top + index if part == "block" else -1
            backward.append(BackwardInstant(part, 0 <= index < top, index > 0 or missing, end,
                                            a + ahead[0], gc, gd, t, w + ahead[1], pending, hooked, hook, layer))
        if part != "post" and (missing or part == "pre"):  # the missing blocks done (above it)
            backward.append(BackwardInstant(part, index < top or missing, index > 0, end, a, gc, gd + behind, t, w,
                                            pending, hooked + behind, hook, index if part == "block" else -1))
    forward = []
    for instant in traced["forward_instants"]:
        a, t, w = (int(evaluate(instant[name], b, s)) for name in FORWARD_SERIES)
        part = instant["part"]
        if part != "pre":  # the missing blocks already run
            forward.append(ForwardInstant(part, a + ahead[0], t, w + sum(extra) * forward_casts))
        if part != "post":  # the missing blocks still to run
            forward.append(ForwardInstant(part, a, t, w))
    head, embedding = int(traced["head_grads"]), int(traced["embedding_grads"])
    return TracedStep(tuple(backward), tuple(forward), head, embedding, head + embedding + int(sum(grads)) + behind,
                      _hook_sequence(traced.get("hook_sizes") or {}, reduced_kinds, layer_kinds))


def _hook_sequence(sizes: dict, reduced_kinds: list, layer_kinds: list) -> tuple:
    """Every gradient hook of the full model in backward order: the head's part, the layers from the top
    (each as the traced block of its kind), the embedding's part."""
    by_kind = {}
    for index, kind in enumerate(reduced_kinds):
        by_kind.setdefault(kind, sizes.get(str(index), []))
    out = [("post", -1, k, n) for k, n in enumerate(sizes.get("post", []))]
    for layer in range(len(layer_kinds) - 1, -1, -1):
        out += [("block", layer, k, n) for k, n in enumerate(by_kind.get(layer_kinds[layer], []))]
    out += [("pre", -1, k, n) for k, n in enumerate(sizes.get("pre", []))]
    return tuple(out)
