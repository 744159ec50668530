"""Pins of the private torch / DeepSpeed internals the tracker relies on: if an upgrade moves one,
this file names it instead of the profile silently drifting."""
from __future__ import annotations

import gc
import re
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")


def test_dispatch_mode_sees_outputs_and_storages_are_preserved_python_objects():
    from torch.utils._python_dispatch import TorchDispatchMode

    seen = []

    class Mode(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            seen.append(func.namespace)
            return out

    with Mode():
        x = torch.ones(4)
        y = x * 2
    assert seen and "aten" in seen
    # Our records are keyed by the storage's Python object: it must be one object per storage.
    assert y.untyped_storage() is y.untyped_storage()


def test_storage_weakref_fires_when_the_memory_is_released():
    import weakref

    fired = []
    tensor = torch.empty(1024)
    ref = weakref.ref(tensor.untyped_storage(), lambda _r: fired.append(True))
    view = tensor[10:]
    del tensor
    gc.collect()
    assert not fired and ref() is not None  # a view keeps the storage alive
    del view
    gc.collect()
    assert fired


def test_graph_task_id_tells_backward_from_forward():
    inside = []
    x = torch.ones(3, requires_grad=True)
    y = x * 2
    y.register_hook(lambda g: inside.append(torch._C._current_graph_task_id()) or g)
    assert torch._C._current_graph_task_id() == -1
    y.sum().backward()
    assert inside and inside[0] != -1


def test_current_autograd_node_is_a_stable_object_within_a_node():
    same = []

    def hook(grad):
        same.append(torch._C._current_autograd_node() is torch._C._current_autograd_node())
        return grad

    x = torch.ones(3, requires_grad=True)
    y = x * 2
    y.register_hook(hook)
    y.sin().sum().backward()
    assert same == [True]


def test_untyped_storages_helper_and_resize_are_patchable():
    from torch.distributed._tools.common_utils import get_untyped_storages

    tensor = torch.zeros(8)
    assert get_untyped_storages(tensor) == {tensor.untyped_storage()}
    original = torch.UntypedStorage.resize_
    calls = []

    def patched(storage, size):
        calls.append(size)
        return original(storage, size)

    torch.UntypedStorage.resize_ = patched
    try:
        tensor.untyped_storage().resize_(0)
    finally:
        torch.UntypedStorage.resize_ = original
    assert calls == [0] and tensor.untyped_storage().nbytes() == 0


def test_global_hooks_and_oom_type_exist():
    from torch.nn.modules.module import register_module_forward_hook, register_module_forward_pre_hook
    from torch.optim.optimizer import register_optimizer_step_pre_hook
    from torch.utils.weak import WeakIdKeyDictionary

    assert issubclass(torch.OutOfMemoryError, RuntimeError)
    for register in (register_module_forward_pre_hook, register_module_forward_hook, register_optimizer_step_pre_hook):
        handle = register(lambda *a: None)
        handle.remove()
    assert WeakIdKeyDictionary() is not None


def test_fsdp_internal_attribute_names_still_exist():
    """categories.py reads these FSDP1 / FSDP2 attributes by name."""
    import torch.distributed.fsdp._flat_param as flat_param
    import torch.distributed.fsdp._fully_shard._fsdp_param as fsdp_param

    flat_src = Path(flat_param.__file__).read_text()
    for name in ("_full_param_padded", "_mp_shard", "_saved_grad_shard", "_local_shard"):
        assert name in flat_src, f"FSDP1 FlatParameter.{name} is gone"
    fsdp2_src = Path(fsdp_param.__file__).read_text()
    for name in ("all_gather_outputs", "_unsharded_param", "_sharded_param_data", "offload_to_cpu"):
        assert name in fsdp2_src, f"FSDP2 FSDPParam.{name} is gone"


def test_deepspeed_buffer_names_still_exist():
    """categories.py classifies DeepSpeed's buffers by these attribute names."""
    pytest.importorskip("deepspeed")
    import deepspeed.runtime.zero.stage3 as stage3
    import deepspeed.runtime.zero.stage_1_and_2 as stage12

    from shardfit.measure.categories import _DS_NAMED

    source = Path(stage12.__file__).read_text() + Path(stage3.__file__).read_text()
    for name in ("bit16_groups_flat", "single_partition_of_fp32_groups", "fp32_partitioned_groups_flat",
                 "averaged_gradients", "grads_in_partition", "grad_partitions_flat_buffer", "ipg_buckets",
                 "lp_param_buffer", "fp16_partitioned_groups_flat"):
        assert name in _DS_NAMED or name == "ipg_buckets"
        assert re.search(rf"self\.{name}\b", source), f"DeepSpeed attribute {name} is gone"
