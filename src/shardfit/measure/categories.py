"""Which category a live storage belongs to, decided by the identity of the objects that own it.

A storage is first given the category of the moment it was created (forward -> activations,
anything else -> temporaries; outputs of collectives -> temporaries). Identity scans then move
the storages we can name: model parameters, their gradients, optimizer states and each engine's
known flat buffers and partitions. The engine rules live here so the tracker stays engine-agnostic.

Measured categories (what the estimator is held to):
- params: the parameters as they rest between steps (FSDP1 sharded FlatParameter, FSDP2 local
  shards, DeepSpeed 16-bit flat groups or ZeRO-3 partitions and persistent params), plus buffers.
- grads: `.grad` of those, DeepSpeed's 16-bit grad partitions and fp32 grad partitions.
- optimizer: optimizer state tensors and DeepSpeed's fp32 master partitions.
- activations: tensors created in forward that are still alive when backward starts (saved for
  backward, or the model output), and tensors recomputed by activation checkpointing in backward.
  Forward tensors freed before backward starts are temporaries.
- temporaries: gathered parameters (FSDP/ZeRO-3), low-precision copies of parameters (autocast's
  weight cache, mixed-precision casts), buckets, collective buffers, and whatever backward and the
  optimizer step allocate that is not named otherwise.
- host: offloaded states (DeepSpeed offload, FSDP2 CPUOffloadPolicy): not device memory.
"""
from __future__ import annotations

CATEGORIES = ("params", "grads", "optimizer", "activations", "temporaries")
HOST = "host"
ALL_CATEGORIES = CATEGORIES + (HOST,)

# DeepSpeed ZeRO optimizer attributes (stage_1_and_2.py, stage3.py of deepspeed 0.19) by category.
# Names not listed are walked only if they look like buffers (see _DS_TEMP_HINTS).
_DS_NAMED = {
    "bit16_groups_flat": "params",
    "fp16_partitioned_groups_flat": "params",
    "lp_param_buffer": "params",
    "parallel_partitioned_bit16_groups": "params",
    "single_partition_of_fp32_groups": "optimizer",
    "fp32_partitioned_groups_flat": "optimizer",
    "averaged_gradients": "grads",
    "grads_in_partition": "grads",
    "grad_partitions_flat_buffer": "grads",
    "param_buffer_of_bit16_for_cpu_offload_groups": "host",
    "temp_grad_buffer_for_cpu_offload": "host",
    "temp_grad_buffer_for_gpu_offload": "temporaries",
    "accumulated_grads_in_cpu": "host",
    "lp_param_contiguous_pin_buffer": "temporaries",
    "lp_grad_partitions_flat_pin_buffers": "temporaries",
}
_DS_TEMP_HINTS = ("ipg", "bucket", "buffer")


_PLAIN = None


def storages_of(tensor):
    """Untyped storages behind a tensor, looking through DTensor and other wrapper subclasses.
    Private torch helper, pinned by tests/measure/test_torch_private_api.py."""
    global _PLAIN
    if _PLAIN is None:
        import torch

        _PLAIN = (torch.Tensor, torch.nn.Parameter)
    if type(tensor) in _PLAIN:  # the common case, without the subclass walk
        return (tensor.untyped_storage(),)
    from torch.distributed._tools.common_utils import get_untyped_storages

    return get_untyped_storages(tensor)


def _tensors_in(obj, depth=0):
    """Tensors inside lists, tuples, dicts and small objects (DeepSpeed's bucket objects)."""
    import torch

    if isinstance(obj, torch.Tensor):
        yield obj
        return
    if depth > 3:
        return
    if isinstance(obj, dict):
        for value in obj.values():
            yield from _tensors_in(value, depth + 1)
    elif isinstance(obj, (list, tuple)):
        for value in obj:
            yield from _tensors_in(value, depth + 1)
    elif hasattr(obj, "__dict__") and type(obj).__module__.startswith("deepspeed") and depth > 0:
        for value in vars(obj).values():
            yield from _tensors_in(value, depth + 1)


def _is_deepspeed_zero(optimizer) -> bool:
    return type(optimizer).__module__.startswith("deepspeed.runtime.zero")


def deepspeed_rules(zero_optimizer):
    """(tensor, category) pairs for a DeepSpeed ZeRO optimizer's own buffers. Buffers matched only
    by a hint in their name come first, so that the named ones (which are exact) win. Offload moves
    states to the host: ZeRO-1/2 `cpu_offload` (fp32 master, its grad, Adam); ZeRO-3
    `offload_optimizer` (also the grad partition buffer) and `offload_param` (16-bit partitions)."""
    stage3 = hasattr(zero_optimizer, "fp32_partitioned_groups_flat")
    opt_offload = bool(getattr(zero_optimizer, "offload_optimizer", False) if stage3
                       else getattr(zero_optimizer, "cpu_offload", False))
    param_offload = stage3 and bool(getattr(zero_optimizer, "offload_param", False))
    moved = {"optimizer": opt_offload, "grads": stage3 and opt_offload, "params": param_offload}
    hinted, named = [], []
    for name, value in vars(zero_optimizer).items():
        # ZeRO-3 name-mangles private buffers: _DeepSpeedZeroOptimizer_Stage3__ipg_bucket_flat_buffer.
        tail = name.rsplit("__", 1)[-1].lstrip("_")
        category = _DS_NAMED.get(tail)
        if category is not None:
            named.append((value, category))
        elif any(hint in tail.lower() for hint in _DS_TEMP_HINTS):
            hinted.append((value, "temporaries"))
    for value, category in hinted + named:
        where = HOST if moved.get(category) else category
        for tensor in _tensors_in(value):
            yield tensor, where
            if category == "optimizer" and tensor.grad is not None:
                yield tensor.grad, HOST if opt_offload else "grads"
    if param_offload:
        for group in getattr(zero_optimizer, "fp16_groups", ()):
            for param in group:
                partition = getattr(param, "ds_tensor", None)
                if partition is not None:
                    yield partition, HOST
    inner = getattr(zero_optimizer, "optimizer", None)
    if inner is not None and hasattr(inner, "state"):
        for tensor in _optimizer_state_tensors(inner):
            yield tensor, HOST if opt_offload else "optimizer"


def _optimizer_state_tensors(optimizer):
    import torch

    state = getattr(optimizer, "state", None)
    if not isinstance(state, dict):
        return
    for per_param in state.values():
        if isinstance(per_param, dict):
            for value in per_param.values():
                if isinstance(value, torch.Tensor):
                    yield value


def fsdp_units(module) -> tuple[list, list]:
    """FSDP1 flat-parameter handles and FSDP2 parameter groups of a wrapped model (walked once per
    scan target: the module tree does not change after wrapping)."""
    handles, groups = [], []
    for sub in module.modules():
        handle = getattr(sub, "_handle", None)
        if handle is not None and hasattr(handle, "flat_param"):
            handles.append(handle)
        get_state = getattr(sub, "_get_fsdp_state", None)
        if get_state is not None:
            try:
                group = get_state()._fsdp_param_group
            except Exception:  # noqa: BLE001 - not an FSDP2 module after all
                group = None
            if group is not None:
                groups.append(group)
    return handles, groups


def _fsdp1_rules(handles):
    """FSDP1: the gathered flat parameter, its low-precision shard and its unsharded gradient are
    temporaries; the saved gradient shard is a gradient."""
    for handle in handles:
        flat = handle.flat_param
        for name in ("_full_param_padded", "_mp_shard", "_full_prec_full_param_padded"):
            tensor = getattr(flat, name, None)
            if tensor is not None:
                yield tensor, "temporaries"
        for name in ("_saved_grad_shard", "_cpu_grad"):
            tensor = getattr(flat, name, None)
            if tensor is not None:
                yield tensor, "grads"
        local = getattr(flat, "_local_shard", None)
        if local is not None:
            yield local, "params"
        # NOTE: in backward the unit's unsharded gradient is the flat parameter's .grad, and the original
        # parameters' .grad are views of it; whichever scan runs before the reduce-scatter frees it would
        # file it as gradients (a race between ranks). Larger than the local shard: the unsharded buffer.
        grad = flat.grad
        if grad is not None and local is not None and grad.numel() > local.numel():
            yield grad, "temporaries"


def _fsdp2_rules(groups):
    """FSDP2: unsharded parameters, their gradients before the reduce-scatter and all-gather outputs are
    temporaries; sharded data is params (host with CPUOffloadPolicy)."""
    for group in groups:
        for fsdp_param in group.fsdp_params:
            offload = getattr(fsdp_param, "offload_to_cpu", False)
            for name in ("_sharded_param_data", "_sharded_post_forward_param_data"):
                tensor = getattr(fsdp_param, name, None)
                if tensor is not None:
                    yield tensor, HOST if offload and name == "_sharded_param_data" else "params"
            if offload:
                sharded = fsdp_param.sharded_param
                yield sharded, HOST
                if sharded.grad is not None:
                    yield sharded.grad, HOST
            for tensor in getattr(fsdp_param, "all_gather_outputs", None) or ():
                yield tensor, "temporaries"
            unsharded = getattr(fsdp_param, "_unsharded_param", None)
            if unsharded is not None:
                yield unsharded, "temporaries"
                # NOTE: while a unit computes, FSDP2 registers the unsharded parameters on its modules,
                # so model.parameters() yields them and their .grad would be filed as gradients by
                # whichever scan runs before the reduce-scatter frees them (a race between ranks);
                # they are the unit's unsharded gradient buffers, like FSDP1's: temporaries.
                if unsharded.grad is not None:
                    yield unsharded.grad, "temporaries"


def engine_rules(model, optimizers, units=None):
    """(tensor, category) pairs from the engines' known buffers; evaluated at every scan.
    units: fsdp_units(model), cached by the caller."""
    if model is not None:
        handles, groups = units if units is not None else fsdp_units(model)
        yield from _fsdp1_rules(handles)
        yield from _fsdp2_rules(groups)
    for optimizer in optimizers:
        if _is_deepspeed_zero(optimizer):
            yield from deepspeed_rules(optimizer)


def parameter_rules(model, optimizers):
    """(tensor, category) pairs for parameters, their gradients and optimizer states."""
    if model is not None:
        for param in model.parameters():
            status = getattr(param, "ds_status", None)
            if status is not None:
                # ZeRO-3: the partition is the resting parameter; a gathered copy is a temporary
                # unless DeepSpeed keeps it (persistent small parameters).
                partition = getattr(param, "ds_tensor", None)
                if partition is not None:
                    yield partition, "params"
                if param.numel() > 0:
                    yield param, "params" if getattr(param, "ds_persist", False) else "temporaries"
            else:
                yield param, "params"
            if param.grad is not None:
                yield param.grad, "grads"
        for buffer in model.buffers():
            yield buffer, "params"
    for optimizer in optimizers:
        if _is_deepspeed_zero(optimizer):
            continue
        for tensor in _optimizer_state_tensors(optimizer):
            yield tensor, "optimizer"
        for group in getattr(optimizer, "param_groups", ()):
            for param in group.get("params", ()):
                yield param, "params"
                if param.grad is not None:
                    yield param.grad, "grads"
