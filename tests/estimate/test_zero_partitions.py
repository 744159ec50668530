"""ZeRO-1/2's gradient buffer (estimate/zero_partitions.py): the torch-free layout against DeepSpeed's own
partitioning functions on the derived specs' parameter lists, and against a hand-checked layout."""
from __future__ import annotations

import json

import pytest

from shardfit.estimate.zero_partitions import bucket_reductions, grads_in_partition_elements, zero3_last_flushes
from shardfit.spec.models import load_model_spec
from shardfit.spec.tiny import tiny_config


def test_a_straddling_parameter_counts_whole_on_every_rank_it_touches():
    # 10 + 40 + 30 + 20 = 100 elements; 2 ranks, padded to a multiple of 4: slices of 50.
    # Rank 0: [0, 50) holds 10 and 40 (60 would not: 40 ends at 50). Rank 1: 30 and 20.
    assert grads_in_partition_elements((("root", (10, 40, 30, 20), 1),), 2) == 50
    # 3 ranks: 100 padded to 102, slices of 34: rank 0 [0, 34) holds 10 and 40 (starts at 10);
    # rank 1 [34, 68) holds 40 (straddles 34) and 30 (starts at 50): 70, the worst;
    # rank 2 [68, 102) holds 30 (straddles 68) and 20: 50.
    assert grads_in_partition_elements((("root", (10, 40, 30, 20), 1),), 3) == 70
    # Blocks repeat: (("block", (5, 5), 3)) is six tensors of 5; one rank holds all 30.
    assert grads_in_partition_elements((("block", (5, 5), 3),), 1) == 30


def test_zero3_last_reductions_follow_the_backward_order():
    # Hooks in reverse order: 20, 30, 40 fill a bucket of 100 (90); 50 does not fit: reduce 90 with
    # 50 waiting; then 50 and 10 (60) go at the epilogue with nothing waiting.
    assert zero3_last_flushes((("root", (10, 50, 40, 30, 20), 1),), 100) == ((90, 50), (60, 0))
    # A parameter larger than the bucket is reduced alone; an empty bucket is not reduced first.
    assert zero3_last_flushes((("root", (250,), 1),), 100) == ((250, 0),)
    assert zero3_last_flushes((("root", (250, 30), 1),), 100) == ((30, 250), (250, 0))


def test_zero12_reductions_happen_at_the_hook_that_overflows_the_bucket():
    hooks = (("post", -1, 0, 60), ("block", 1, 0, 30), ("block", 1, 1, 20), ("block", 0, 0, 90),
             ("block", 0, 1, 5), ("pre", -1, 0, 250), ("pre", -1, 1, 1))
    reductions, first = bucket_reductions(hooks, 100)
    # 60 + 30 fit (90); 20 does not: reduce 90 there. 20 + 90 > 100: reduce 20. 90 + 5 fit; 250 does
    # not: reduce 95. The next hook reduces the 250 alone (a parameter larger than the bucket).
    assert reductions == {("block", 1, 1): 90, ("block", 0, 0): 20, ("pre", -1, 0): 95, ("pre", -1, 1): 250}
    # The gradient buffer exists once the first reduction's hook is done: 60 + 30 + 20 hooked.
    assert first == 110
    assert bucket_reductions((("post", -1, 0, 10),), 100) == ({}, None)


ARCHS = ("opt", "qwen3", "gemma3_text", "bloom", "granitemoe")


@pytest.mark.parametrize("arch", ARCHS)
def test_equals_deepspeeds_own_partitioning(tmp_path, monkeypatch, arch):
    torch = pytest.importorskip("torch")
    pytest.importorskip("deepspeed")
    from deepspeed.runtime.utils import align_dense_tensors
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    monkeypatch.setenv("SHARDFIT_CACHE_DIR", str(tmp_path / "cache"))
    (tmp_path / arch).mkdir()
    (tmp_path / arch / "config.json").write_text(json.dumps(tiny_config(arch)))
    spec = load_model_spec(str(tmp_path / arch))
    sizes = [n for _, group, repeat in spec.param_order for _ in range(repeat) for n in group]
    assert sum(sizes) == spec.n_params
    tensors = [torch.empty(n, device="meta") for n in sizes]
    for world in (2, 3, 4, 8):
        # As DeepSpeedZeroOptimizer.__init__: the group flattened with its padding, split in `world`.
        # (its alignment: self.nccl_start_alignment_factor = 2, times the ranks)
        padded = sum(t.numel() for t in align_dense_tensors(tensors, 2 * world))
        part = padded // world
        owned = [sum(t.numel() for t in DeepSpeedZeroOptimizer.get_partition_info(None, tensors, part, rank)[0])
                 for rank in range(world)]
        assert grads_in_partition_elements(spec.param_order, world) == max(owned), (arch, world, owned)
