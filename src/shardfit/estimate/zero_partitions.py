"""DeepSpeed's gradient buffers as the parameter layout sizes them: ZeRO-1/2's partition buffer (whole
parameters, not the partition) and ZeRO-3's last bucket reductions. No torch here: the layout comes
from the derived spec's `param_order`.

Source (DeepSpeed 0.19, runtime/zero/stage_1_and_2.py): each parameter group's trainable parameters
are flattened in order and padded to a multiple of nccl_start_alignment_factor (2) x world
(`flatten_dense_tensors_aligned`); rank r's partition is the r-th of `world` equal slices
(`get_partition_info`), and a parameter belongs to it when it starts inside the slice or straddles its
start. `copy_grads_in_partition` then allocates `grads_in_partition` with the *whole* numel of every
parameter that belongs to the rank, so a rank whose slice cuts through a large tensor (an embedding
on two ranks) holds that tensor's whole gradient, beside the others: up to twice the partition.
"""
from __future__ import annotations

from functools import lru_cache

NCCL_START_ALIGNMENT_FACTOR = 2  # stage_1_and_2.py: 4-byte alignment / sizeof(fp16)


def _sizes(param_order: tuple) -> list[int]:
    return [n for _, sizes, repeat in param_order for _ in range(repeat) for n in sizes]


def covers(param_order: tuple, trained: int) -> bool:
    """Whether the layout is known and is what the optimizer trains (not LoRA, nothing frozen)."""
    return bool(param_order) and sum(n * repeat for _, sizes, repeat in param_order for n in sizes) == trained


@lru_cache(maxsize=256)
def rank_layouts(param_order: tuple, world: int) -> tuple[tuple[int, int], ...]:
    """Per rank: (elements of its `grads_in_partition` buffer, the largest piece of a parameter inside
    its slice). The pieces are the views `get_flat_partition` hands the gradient norm, one at a time."""
    sizes = _sizes(param_order)
    total = sum(sizes)
    align = NCCL_START_ALIGNMENT_FACTOR * world
    part = max(1, (total + (-total) % align) // world)
    owned, piece = [0] * world, [0] * world
    start = 0
    for n in sizes:
        if n:
            # The ranks whose slice this parameter starts in or straddles the start of.
            first, last = start // part, min((start + n - 1) // part, world - 1)
            for rank in range(first, last + 1):
                owned[rank] += n
                inside = min(start + n, (rank + 1) * part) - max(start, rank * part)
                piece[rank] = max(piece[rank], inside)
        start += n
    return tuple(zip(owned, piece))


def grads_in_partition_elements(param_order: tuple, world: int) -> int:
    """Elements of the largest `grads_in_partition` buffer over the ranks (the rank that peaks)."""
    return max((owned for owned, _ in rank_layouts(param_order, world)), default=0)


def step_instants(param_order: tuple, world: int, lp: int, part: int, adam_temps: int) -> tuple[int, int]:
    """(grads, temporaries) of the optimizer step's largest instant on the worst rank (DeepSpeed 0.19,
    `step`, no offload): the gradient norm, each piece upcast to fp64 in turn (`get_grad_norm_direct`,
    `get_norm_dtype`) beside the buffer; the flat partition built from the buffer (`flatten`, then its
    fp32 copy under bf16 / fp16); the update, with the buffer freed and only the fp32 flat partition
    left as gradient, beside the optimizer's scratch."""
    best = (4 * part, adam_temps)
    flat = lp * part + (4 * part if lp != 4 else 0)
    for owned, piece in rank_layouts(param_order, world):
        for candidate in ((lp * owned, 8 * piece), (lp * owned + flat, 0)):
            if sum(candidate) > sum(best):
                best = candidate
    return best


@lru_cache(maxsize=256)
def zero3_last_flushes(param_order: tuple, bucket: int) -> tuple[tuple[int, int], ...]:
    """(elements reduced, elements of the gradient waiting in .grad) of ZeRO-3's last two bucket
    reductions, when backward has freed every activation: the one the last hook triggers (its
    parameter does not fit beside the bucket's `elements`), and the epilogue's of what is left.
    Source (DeepSpeed 0.19, stage3.py): `reduce_independent_p_g_buckets_and_remove_grads` reduces the
    bucket first when `elements + ds_numel > reduce_bucket_size` (and it is not empty); the reduction
    (`__avg_scatter_grads` -> `reduce_scatter_coalesced`) holds a flat copy of the bucket's gradients
    (and gloo's reduce-scatter one more). The hooks run in backward order: the parameters in reverse,
    the embedding's last; the reductions before these are bucket_reductions' (the same rule)."""
    fill, flushes = 0, []
    for n in reversed(_sizes(param_order)):
        if fill + n > bucket and fill > 0:
            flushes.append((fill, n))
            fill = 0
        fill += n
    flushes.append((fill, 0))
    return tuple(flushes[-2:])


def bucket_reductions(hook_sequence: tuple, bucket: int) -> tuple[dict, int]:
    """({(part, layer, k): elements reduced} for every hook that finds its gradient does not fit beside
    the bucket's and reduces the bucket first, the elements hooked once the first reduction is done).
    ZeRO-1/2 (`reduce_independent_p_g_buckets_and_remove_grads`: `elements + numel > reduce_bucket_size`):
    the reduction (`average_tensor` -> `allreduce_bucket`) flattens the bucket's gradients into one new
    tensor while the hooked gradient waits in .grad; only then does `copy_grads_in_partition` allocate
    the gradient buffer, so the first reduction's copy and the buffer are never alive together."""
    fill, hooked, first, out = 0, 0, None, {}
    for part, layer, k, n in hook_sequence:
        if fill + n > bucket and fill > 0:
            out[(part, layer, k)] = fill
            fill = 0
            first = hooked + n if first is None else first
        fill += n
        hooked += n
    return out, first
