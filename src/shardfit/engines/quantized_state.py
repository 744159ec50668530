"""Model state dicts of a bitsandbytes (QLoRA) base for DCP checkpoints.

torch's get_state_dict / set_state_dict cannot carry them: bitsandbytes' layers add state-dict keys
that name no attribute (Linear8bitLt's `SCB` and `weight_format`: get_state_dict's FQN walk raises
AttributeError), and Linear4bit writes its QuantState (`weight.absmax`, `weight.quant_map`,
`weight.nested_absmax`, `weight.nested_quant_map`, `weight.quant_state.bitsandbytes__nf4`) but has no
_load_from_state_dict that reads it back (the strict load refuses them as unexpected). Under FSDP2
the sharded weight is a plain DTensor without its quant_state, so nothing of it would be saved at all.

So for a quantized base the model state is the module's own state_dict (under the names
get_state_dict gives: no DDP `module.`, no checkpoint-wrapper prefix), every Linear4bit's QuantState
added from the module (where bitsandbytes keeps it for FSDP), and on load the QuantState tensors are
copied back in place (absmax, code, nested absmax / code / offset) while Linear8bitLt's own
_load_from_state_dict restores SCB. Sources: bitsandbytes nn/modules.py (Linear4bit._save_to_state_dict,
fix_4bit_weight_quant_state_from_module, Linear8bitLt._load_from_state_dict), functional.py
(QuantState.as_dict / from_dict).
"""
from __future__ import annotations

from pathlib import Path

import torch

from shardfit.errors import ShardfitError

_CHECKPOINT_PREFIX = "_checkpoint_wrapped_module."


def is_quantized(plan) -> bool:
    lora = plan.training.lora
    return lora is not None and lora.base_dtype in ("int8", "nf4")


def _inner(model):
    return model.module if isinstance(model, torch.nn.parallel.DistributedDataParallel) else model


def _linear4bit(model) -> dict[str, torch.nn.Module]:
    """{state-dict prefix: Linear4bit module} under get_state_dict's names."""
    import bitsandbytes as bnb

    return {name.replace(_CHECKPOINT_PREFIX, "") + ".": module for name, module in _inner(model).named_modules()
            if isinstance(module, bnb.nn.Linear4bit)}


def _quant_state(module):
    state = getattr(module.weight, "quant_state", None)
    return state if state is not None else getattr(module, "quant_state", None)


def model_state_dict(model) -> dict:
    """The model's state dict for DCP, each Linear4bit's QuantState included (packed as bitsandbytes
    packs it into its own state dicts)."""
    state = {name.replace(_CHECKPOINT_PREFIX, ""): tensor for name, tensor in _inner(model).state_dict().items()}
    for prefix, module in _linear4bit(model).items():
        quant = _quant_state(module)
        if quant is None:
            raise ShardfitError(f"{prefix.rstrip('.')} has no bitsandbytes quant state: the 4-bit base was not quantized")
        for key, value in quant.as_dict(packed=True).items():
            state[f"{prefix}weight.{key}"] = value.detach()
    return state


def load_targets(model, directory: Path, reader) -> dict:
    """model_state_dict with each QuantState tensor replaced by an empty one of the size the checkpoint
    holds: the packed `quant_state.*` entry is JSON text whose length follows the numbers in it."""
    state = model_state_dict(model)
    saved = reader.read_metadata().state_dict_metadata
    for prefix in _linear4bit(model):
        for key in [k for k in state if k.startswith(f"{prefix}weight.")]:
            entry = saved.get(f"model.{key}")
            if entry is None:
                raise ShardfitError(f"checkpoint {directory} has no '{key}': it was not written from this "
                                    "4-bit (nf4) base; resume with the plan that wrote it")
            state[key] = torch.empty(tuple(entry.size), dtype=entry.properties.dtype)
    return state


def load_model_state_dict(model, state: dict) -> None:
    """Strict load of what load_targets received from DCP, then every Linear4bit's QuantState copied in
    place (the live tensors stay the ones forward and FSDP2's unsharded weight refer to)."""
    from bitsandbytes.functional import QuantState

    state = dict(state)
    layers = _linear4bit(model)
    loaded = {}
    for prefix in layers:
        keys = [k for k in state if k.startswith(f"{prefix}weight.")]
        loaded[prefix] = {k[len(prefix) + len("weight."):]: state.pop(k) for k in keys}
    inner = _inner(model)
    names = {name.replace(_CHECKPOINT_PREFIX, ""): name for name in inner.state_dict()}
    inner.load_state_dict({names.get(k, k): v for k, v in state.items()}, strict=True)
    for prefix, module in layers.items():
        live = _quant_state(module)
        saved = QuantState.from_dict(loaded[prefix], device=live.absmax.device)
        _copy_quant_state(prefix, live, saved)


def _copy_quant_state(prefix: str, live, saved) -> None:
    if (live.quant_type, live.blocksize, live.dtype, tuple(live.shape), live.nested) != \
            (saved.quant_type, saved.blocksize, saved.dtype, tuple(saved.shape), saved.nested):
        raise ShardfitError(f"{prefix}weight was quantized differently in the checkpoint "
                            f"({saved.quant_type}, block {saved.blocksize}, {tuple(saved.shape)}) than now "
                            f"({live.quant_type}, block {live.blocksize}, {tuple(live.shape)}): resume with the plan that wrote it")
    pairs = [(live.absmax, saved.absmax), (live.code, saved.code)]
    if live.nested:
        pairs += [(live.offset, saved.offset), (live.state2.absmax, saved.state2.absmax),
                  (live.state2.code, saved.state2.code)]
    for target, source in pairs:
        target.copy_(source)
