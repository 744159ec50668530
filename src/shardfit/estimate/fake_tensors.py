"""What the two fake-tensor tracers share (estimate/derived.py derives activation coefficients,
measure/traced.py traces a whole step): storage identity, fake CPU parameters from a meta model,
and transformers' eager masking decisions. torch and transformers are imported inside the
functions: importing this module is free."""
from __future__ import annotations

from contextlib import contextmanager


def storage_key(tensor):
    # NOTE: the StorageImpl pointer identifies a storage for real, fake and meta tensors alike
    # (data_ptr() is 0 for fake/meta tensors, so it cannot).
    return tensor.untyped_storage()._cdata


@contextmanager
def torch_linear():
    """NOTE: DeepSpeed's zero.Init (run by ZeRO-3's initialize) replaces torch.nn.functional.linear
    process-wide with its own autograd Function, and leaves it so. A derivation that runs in such a
    process (the profiler's workers estimate after the engine is up) would trace that Function and
    cache what it saves as the model's own: the trace runs torch's linear, whatever is installed."""
    import torch
    import torch.nn.functional as functional

    installed = functional.linear
    functional.linear = torch._C._nn.linear
    try:
        yield
    finally:
        functional.linear = installed


@contextmanager
def masks_as_in_eager():
    """NOTE: transformers treats a FakeTensor as "tracing" and then always materialises the causal
    mask (b x 1 x s x s), which also turns off SDPA's native GQA: the trace would save a mask and
    repeated k/v that a real step never allocates. Our traced inputs are single unpadded sequences,
    so the eager decisions need no data: no packed sequences, and with no sliding window shorter
    than the sequence SDPA's is_causal replaces the mask."""
    try:
        import inspect

        import transformers.masking_utils as masking
        original = masking._ignore_causal_mask_sdpa
        original_packed = masking.find_packed_sequence_indices
        signature = inspect.signature(original)
    except (ImportError, AttributeError):
        yield
        return

    def ignore(*args, **kwargs):
        a = signature.bind(*args, **kwargs).arguments
        window = a.get("local_attention_size")
        if (a.get("padding_mask") is None and (window is None or a["kv_length"] < window)
                and (a["q_length"] == 1 or a["kv_length"] == a["q_length"])):
            return True
        return original(*args, **kwargs)

    masking._ignore_causal_mask_sdpa = ignore
    masking.find_packed_sequence_indices = lambda position_ids: None
    try:
        yield
    finally:
        masking._ignore_causal_mask_sdpa = original
        masking.find_packed_sequence_indices = original_packed


def materialize(model) -> None:
    """Meta -> (fake) CPU tensors, keeping shared parameters shared. NOTE: Module.to_empty()
    gives each use of a tied weight its own tensor, which would count the LM head twice."""
    import torch

    memo: dict = {}
    for module in model.modules():
        for table in (module._parameters, module._buffers):
            for name, tensor in list(table.items()):
                if tensor is None:
                    continue
                if id(tensor) not in memo:
                    fresh = torch.empty_like(tensor, device="cpu")
                    if isinstance(tensor, torch.nn.Parameter):
                        fresh = torch.nn.Parameter(fresh, requires_grad=tensor.requires_grad)
                    memo[id(tensor)] = fresh
                table[name] = memo[id(tensor)]
