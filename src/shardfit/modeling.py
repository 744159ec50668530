"""The torch side of model specs: build the nn.Module a ModelSpec describes.

torch and transformers are imported inside the functions, so importing this module is free.

    model = build_model("tiny-llama", device="cpu", dtype="fp32", seed=0)   # preset / config path
    model = build_model(spec, device="meta")                                # a ModelSpec
    model = build_model("mypkg.models:make_net")                           # factory: calls make_net()
    wrap = block_classes(model, spec)   # {LlamaDecoderLayer}: the FSDP auto-wrap / AC unit
"""
from __future__ import annotations

import importlib
from collections import Counter

from shardfit.errors import ShardfitError
from shardfit.spec.derive import build_hf_model, find_blocks
from shardfit.spec.model_spec import ModelSpec

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


def _load_factory(ref: str):
    module_name, _, fn_name = ref.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ShardfitError(f"factory '{ref}': cannot import module '{module_name}' ({exc}): is it on PYTHONPATH?") from None
    fn = getattr(module, fn_name, None)
    if not callable(fn):
        raise ShardfitError(f"factory '{ref}': module '{module_name}' has no callable '{fn_name}'")
    return fn


def _call_factory(ref: str, device: str):
    import torch

    fn = _load_factory(ref)
    try:
        with torch.device(device):
            model = fn()
    except ShardfitError:
        raise
    except Exception as exc:  # noqa: BLE001 - user code: report it as one line
        raise ShardfitError(f"factory '{ref}' failed: {type(exc).__name__}: {exc}") from None
    if not isinstance(model, torch.nn.Module):
        raise ShardfitError(f"factory '{ref}' must return a torch.nn.Module, got {type(model).__name__}")
    return model


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

    from shardfit.spec.models import is_factory_ref, load_hf_config

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
        model = _call_factory(ref, device)
        if dtype is not None:
            model = model.to(torch_dtype(dtype))
    else:
        model = _hf_model(load_hf_config(ref), device, dtype, attn_implementation)
    return model.train()


def _param_count(module, seen: set | None = None, recurse: bool = True) -> int:
    seen = set() if seen is None else seen
    total = 0
    for p in module.parameters(recurse=recurse):
        if id(p) not in seen:
            seen.add(id(p))
            total += p.numel()
    return total


def detect_block_class(model):
    """The repeated block: children of the nn.ModuleList holding the most parameters (all of one
    class), else the most repeated non-torch.nn class that holds parameters. None if there is none."""
    import torch

    best, best_params = None, 0
    for module in model.modules():
        if isinstance(module, (torch.nn.ModuleList, torch.nn.Sequential)) and len(module) >= 2:
            classes = {type(child) for child in module}
            params = _param_count(module)
            if len(classes) == 1 and params > best_params:
                best, best_params = next(iter(classes)), params
    if best is not None:
        return best
    counts = Counter(type(m) for m in model.modules()
                     if not type(m).__module__.startswith("torch.nn") and _param_count(m) > 0 and m is not model)
    repeated = [(n * max(_param_count(m) for m in model.modules() if type(m) is cls), cls)
                for cls, n in counts.items() if n >= 2]
    return max(repeated, key=lambda item: item[0])[1] if repeated else None


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


def spec_from_module(model, name: str, source: str) -> ModelSpec:
    """Count a built module (usually on the meta device): shared parameters once."""
    n_params = _param_count(model)
    if n_params == 0:
        raise ShardfitError(f"model '{name}' has no parameters")
    largest = max(sum(p.numel() for p in m.parameters(recurse=False)) for m in model.modules())
    block_cls = detect_block_class(model)
    blocks = [m for m in model.modules() if type(m) is block_cls] if block_cls else []
    block_params = max((_param_count(b) for b in blocks), default=0)
    seen: set = set()  # a parameter shared between blocks counts once
    non_block = n_params - sum(_param_count(block, seen) for block in blocks)
    shape = {}
    config = getattr(model, "config", None)
    if config is not None:
        shape = {key: int(getattr(config, attr)) for key, attr in
                 (("hidden_size", "hidden_size"), ("num_heads", "num_attention_heads"),
                  ("num_kv_heads", "num_key_value_heads"), ("intermediate_size", "intermediate_size"),
                  ("vocab_size", "vocab_size"), ("max_position", "max_position_embeddings"))
                 if isinstance(getattr(config, attr, None), int)}
    return ModelSpec(name=name, family="module", source=source, n_params=n_params,
                     num_layers=len(blocks), block_class=block_cls.__name__ if block_cls else "",
                     block_params=block_params, largest_layer_params=largest, non_block_params=non_block,
                     **shape)


def spec_from_factory(ref: str) -> ModelSpec:
    """ModelSpec of an nn.Module factory 'pkg.module:fn', built on the meta device (no memory)."""
    model = _call_factory(ref, "meta")
    return spec_from_module(model, name=ref.partition(":")[2], source=ref)
