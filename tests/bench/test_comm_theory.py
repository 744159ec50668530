"""Communication accounting without processes: operator classification on real tensors and the
ZeRO-paper volumes per strategy."""
from __future__ import annotations

import dataclasses

import pytest

from shardfit.bench.comm import classify, theoretical_comm
from shardfit.spec.plan import parse_strategy

P = 1_000_000


def test_collectives_are_sized_by_their_full_buffer():
    torch = pytest.importorskip("torch")
    shard, full = torch.empty(250, dtype=torch.bfloat16), torch.empty(500, dtype=torch.bfloat16)
    assert classify("c10d", "_allgather_base_", (full, shard, None)) == ("all_gather", 1000)
    assert classify("c10d", "_reduce_scatter_base_", (shard, full, None)) == ("reduce_scatter", 1000)
    assert classify("c10d", "allreduce_", ([torch.empty(10), torch.empty(5)], None)) == ("all_reduce", 60)
    assert classify("c10d", "allgather_", ([[shard, shard]], [shard], None)) == ("all_gather", 1000)
    assert classify("_c10d_functional", "all_gather_into_tensor", (shard, 2, "g")) == ("all_gather", 1000)
    assert classify("c10d", "barrier", (torch.empty(1), None)) == ("barrier", 0)
    assert classify("aten", "add", (full, full)) is None


def test_zero_paper_volumes():
    def volume(label, **kw):
        # As at scale: a 1e9-element reuse distance is far below a multi-billion model's size.
        strategy = dataclasses.replace(parse_strategy(label), max_reuse_distance=0)
        return theoretical_comm(strategy, P, grad_bytes=2, param_bytes=2, **kw)["volume_bytes"]

    assert volume("ddp") == volume("zero1") == volume("zero2") == 2 * 2 * P  # 2P elements
    assert volume("zero3") == 3 * 2 * P  # one more parameter all-gather
    assert volume("zero3") / volume("zero2") == 1.5
    assert volume("fsdp:full_shard") == volume("fsdp2") == 3 * 2 * P
    assert volume("fsdp:shard_grad_op") == volume("fsdp2:no_reshard") == 2 * 2 * P
    # FSDP1 keeps its root unit gathered across the forward/backward turn.
    assert volume("fsdp:full_shard", root_params=P // 10) == 2 * (3 * P - P // 10)
    # ZeRO-3 parameters under the persistence threshold are all-reduced like DDP's, never gathered.
    persistent = theoretical_comm(dataclasses.replace(parse_strategy("zero3"), max_reuse_distance=0), P, grad_bytes=2, param_bytes=2, persistent_params=P)
    assert persistent["by_kind"]["all_gather"] == 0 and persistent["by_kind"]["all_reduce"] == 2 * P


def test_zero3_reuse_distance_decides_the_backward_gather():
    keep = parse_strategy("zero3")  # Strategy default: 1e9 elements
    release = dataclasses.replace(keep, max_reuse_distance=0)
    kept = theoretical_comm(keep, P, grad_bytes=4, param_bytes=4)
    released = theoretical_comm(release, P, grad_bytes=4, param_bytes=4)
    assert kept["by_kind"]["all_gather"] == 4 * P and released["by_kind"]["all_gather"] == 8 * P
