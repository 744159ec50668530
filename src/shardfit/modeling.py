"""The torch side of model specs: build the nn.Module a ModelSpec describes.

torch and transformers are imported inside the functions, so importing this module is free.

    model = build_model("tiny-llama", device="cpu", dtype="fp32", seed=0)   # preset / config path
    model = build_model(spec, device="meta")                                # a ModelSpec
    model = build_model("mypkg.models:make_net")                           # factory: calls make_net()
    wrap = block_classes(model, spec)   # {LlamaDecoderLayer}: the FSDP auto-wrap / AC unit
"""
from __future__ import annotations

from shardfit.errors import ShardfitError
from shardfit.spec.derive import build_hf_model, find_blocks
from shardfit.spec.factory import call_factory, detect_block_class
from shardfit.spec.model_spec import ModelSpec
from shardfit.spec.models import is_factory_ref, load_hf_config

_DTYPES = {"fp32": "float32", "float32": "float32", "fp16": "float16", "float16": "float16",
           "bf16": "bfloat16", "bfloat16": "bfloat16"}


def torch_dtype(dtype):
    """torch.dtype from None (float32), a torch.dtype, or a name: fp32/fp16/bf16/float32/..."""
    import torch

    if dtype is None:
        return torch.float32
    if isinstance(dtype, torch.dtype):
        return dtype
    name = _DTYPES.get(str(dtype).lower().replace("torch.", ""))
    if name is None:
        raise ShardfitError(f"dtype '{dtype}' is not supported: use fp32, bf16 or fp16")
    return getattr(torch, name)


def _hf_model(cfg: dict, device: str, dtype, attn_implementation: str):
    # NOTE: one class resolution for every path (spec derivation, engines, tracing): spec/derive.py.
    return build_hf_model(cfg, device=device, dtype=torch_dtype(dtype), attn_implementation=attn_implementation)


def build_model(ref_or_spec, device: str = "cpu", dtype=None, seed: int | None = None,
                attn_implementation: str = "sdpa"):
    """Build the model for a preset name, config path, factory 'pkg.module:fn', or ModelSpec.

    device: "cpu", "cuda", "meta" (shapes only: no memory, for sharding then to_empty()).
    dtype: None (fp32), a torch.dtype, or "fp32"/"bf16"/"fp16".
    seed: seeds torch before construction, so the same seed gives the same initial weights on the
    same device type (CPU and CUDA generators differ: build on CPU when weights must match across
    device types). The HF model is built with use_cache=False and the given attention kernel
    ("sdpa" or "eager"; classes without SDPA, like Gemma-2, get eager); it is returned in train mode.
    """
    import torch

    if isinstance(ref_or_spec, ModelSpec):
        if ref_or_spec.family == "params":
            raise ShardfitError("a --params model has no architecture to build: give a preset, config path or factory")
        ref = ref_or_spec.source
    else:
        ref = str(ref_or_spec)
    if attn_implementation not in ("sdpa", "eager"):
        raise ShardfitError(f"attention '{attn_implementation}' is not supported: use sdpa or eager")
    if seed is not None:
        torch.manual_seed(seed)
    if is_factory_ref(ref):
        model = call_factory(ref, device)
        if dtype is not None:
            model = model.to(torch_dtype(dtype))
    else:
        model = _hf_model(load_hf_config(ref), device, dtype, attn_implementation)
    return model.train()


def block_classes(model, spec: ModelSpec | None = None) -> set:
    """The repeated block classes: the FSDP auto-wrap unit and the activation-checkpointing unit."""
    names = set((spec.block_class if spec is not None else "").split(",")) - {""}
    if names:
        found = {type(m) for m in model.modules() if type(m).__name__ in names}
        if found:
            return found
    if spec is not None and spec.derived:
        # Several block classes in one layer list (attention and Mamba layers): derive's own finder.
        found = {type(b) for b in find_blocks(model)}
        if found:
            return found
    detected = detect_block_class(model)
    if detected is None:
        raise ShardfitError(f"no repeated block found in {type(model).__name__}: it needs a ModuleList of layers to wrap")
    return {detected}
