"""Specs of an nn.Module factory 'pkg.module:fn': call it (on the meta device for a spec) and count
the module it returns. torch is imported inside the functions, as in spec/derive.py, so the spec
stage imports free; modeling.py builds models with the same calls."""
from __future__ import annotations

import importlib
from collections import Counter

from shardfit.errors import ShardfitError
from shardfit.spec.model_spec import ModelSpec


def load_factory(ref: str):
    module_name, _, fn_name = ref.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ShardfitError(f"factory '{ref}': cannot import module '{module_name}' ({exc}): is it on PYTHONPATH?") from None
    fn = getattr(module, fn_name, None)
    if not callable(fn):
        raise ShardfitError(f"factory '{ref}': module '{module_name}' has no callable '{fn_name}'")
    return fn


def call_factory(ref: str, device: str):
    import torch

    fn = load_factory(ref)
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


def param_count(module, seen: set | None = None, recurse: bool = True) -> int:
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
            params = param_count(module)
            if len(classes) == 1 and params > best_params:
                best, best_params = next(iter(classes)), params
    if best is not None:
        return best
    counts = Counter(type(m) for m in model.modules()
                     if not type(m).__module__.startswith("torch.nn") and param_count(m) > 0 and m is not model)
    repeated = [(n * max(param_count(m) for m in model.modules() if type(m) is cls), cls)
                for cls, n in counts.items() if n >= 2]
    return max(repeated, key=lambda item: item[0])[1] if repeated else None


def spec_from_module(model, name: str, source: str) -> ModelSpec:
    """Count a built module (usually on the meta device): shared parameters once."""
    n_params = param_count(model)
    if n_params == 0:
        raise ShardfitError(f"model '{name}' has no parameters")
    largest = max(sum(p.numel() for p in m.parameters(recurse=False)) for m in model.modules())
    block_cls = detect_block_class(model)
    blocks = [m for m in model.modules() if type(m) is block_cls] if block_cls else []
    block_params = max((param_count(b) for b in blocks), default=0)
    seen: set = set()  # a parameter shared between blocks counts once
    non_block = n_params - sum(param_count(block, seen) for block in blocks)
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
    model = call_factory(ref, "meta")
    return spec_from_module(model, name=ref.partition(":")[2], source=ref)
