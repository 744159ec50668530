"""FSDP1's flat shards as its optimizer sees them: with use_orig_params every original parameter
reaches the optimizer as a view of this rank's slice of its unit's flat parameter, so single-tensor
AdamW's scratch follows the largest slice of a parameter that lands on one rank, not the largest
parameter. No torch here: the layout comes from the derived spec's `param_order`.

Source (torch 2.13, fsdp/_flat_param.py, FlatParamHandle._init_flat_param_and_metadata): under
use_orig_params each parameter starts at a multiple of 16 bytes of the unsharded (forward) dtype
(padding before it), the whole is padded to a multiple of the shard count, and rank r holds the r-th
of that many equal contiguous chunks (`_get_unpadded_shard`).
"""
from __future__ import annotations

from functools import lru_cache

FSDP_ALIGNMENT_BYTES = 16  # _flat_param._get_aligned_numel: a TorchInductor alignment constraint


def _unit_layout(sizes: tuple, shard: int, aligned: int) -> tuple[tuple, int]:
    """(start offsets of the parameters, chunk size) of one flat parameter."""
    starts, total = [], 0
    for n in sizes:
        if total % aligned:
            total += aligned - total % aligned
        starts.append(total)
        total += n
    if total % shard:
        total += shard - total % shard
    return tuple(starts), total // shard


def _local(start: int, n: int, chunk: int, rank: int) -> int:
    """Elements of [start, start + n) inside rank's chunk."""
    return max(0, min(start + n, (rank + 1) * chunk) - max(start, rank * chunk))


def _root_layout(param_order: tuple, shard: int, aligned: int) -> tuple[tuple, tuple, int]:
    """(sizes, start offsets, chunk) of the root's one flat parameter: every "root" group of the order."""
    root = tuple(n for unit, sizes, _ in param_order if unit == "root" for n in sizes)
    starts, chunk = _unit_layout(root, shard, aligned) if root else ((), 1)
    return root, starts, chunk


def local_views(param_order: tuple, shard: int, param_bytes: int, rank: int) -> list[int]:
    """Elements of each parameter's view on `rank`, in the optimizer's order (every block expanded)."""
    aligned = max(1, FSDP_ALIGNMENT_BYTES // param_bytes)
    _, root_starts, root_chunk = _root_layout(param_order, shard, aligned)
    out, root_index = [], 0
    for unit, sizes, repeat in param_order:
        if unit == "root":
            out += [_local(root_starts[root_index + i], n, root_chunk, rank) for i, n in enumerate(sizes)]
            root_index += len(sizes)
        else:
            starts, chunk = _unit_layout(tuple(sizes), shard, aligned)
            out += [_local(start, n, chunk, rank) for start, n in zip(starts, sizes)] * repeat
    return out


def _views_by_rank(starts: tuple, sizes: tuple, chunk: int, shard: int) -> list[list[int]]:
    """For each rank, its non-empty views of one flat parameter, in order. Each parameter spans a
    contiguous range of ranks, so the work is the parameters plus the ranks, not their product."""
    by_rank: list[list[int]] = [[] for _ in range(shard)]
    for start, n in zip(starts, sizes):
        if n == 0:
            continue
        first, last = start // chunk, (start + n - 1) // chunk
        for rank in range(first, min(last, shard - 1) + 1):
            by_rank[rank].append(_local(start, n, chunk, rank))
    return by_rank


@lru_cache(maxsize=256)
def fsdp1_step_scratch(param_order: tuple, shard: int, param_bytes: int) -> tuple[int, int]:
    """(a view, the view before it) in elements, on the worst rank, such that 2*view + before is the
    largest `2*n_i + n_(i-1)` of single-tensor AdamW's loop there: its sqrt/div temporaries of one
    parameter beside the previous one's `denom`. A parameter with no elements on a rank has no
    gradient there, so the optimizer skips it (`_init_group`: `p.grad is not None`) and the `denom`
    beside it is the last non-empty view's.
    param_order: ModelSpec.param_order; shard: ranks sharing each flat parameter (1: whole views);
    param_bytes: bytes per element of the unsharded parameters (the gathered dtype)."""
    aligned = max(1, FSDP_ALIGNMENT_BYTES // param_bytes)
    root, root_starts, root_chunk = _root_layout(param_order, shard, aligned)
    # Each group of the order as the per-rank lists of its views; a block layout is built once.
    # NOTE: two copies of a repeated block stand for all of them: after the first, every copy meets the
    # same neighbour on each rank (the previous copy's last view) and gives the same pairs.
    groups, root_index, layouts = [], 0, {}
    for unit, sizes, repeat in param_order:
        if unit == "root":
            part = slice(root_index, root_index + len(sizes))
            groups.append(_views_by_rank(root_starts[part], root[part], root_chunk, shard))
            root_index += len(sizes)
            continue
        if sizes not in layouts:
            starts, chunk = _unit_layout(tuple(sizes), shard, aligned)
            layouts[sizes] = _views_by_rank(starts, tuple(sizes), chunk, shard)
        groups += [layouts[sizes]] * min(repeat, 2)
    best, pair = -1, (0, 0)
    for rank in range(shard):
        before = 0
        for group in groups:
            for n in group[rank]:
                if 2 * n + before > best:
                    best, pair = 2 * n + before, (n, before)
                before = n
    return pair
