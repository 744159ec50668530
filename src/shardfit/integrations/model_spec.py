"""The ModelSpec of a model a framework already built: from its Hugging Face config when it has one
(the same spec `shardfit plan MODEL` sizes), else counted from the module itself."""
from __future__ import annotations

from shardfit.errors import ShardfitError
from shardfit.spec.factory import spec_from_module
from shardfit.spec.models import spec_from_hf_config


def _unwrap(model):
    """The user's module under DDP / FSDP1 / DeepSpeed / Lightning wrappers."""
    for _ in range(4):
        inner = getattr(model, "module", None) or getattr(model, "_forward_module", None)
        if inner is None or inner is model:
            break
        model = inner
    return model


def spec_of_model(model):
    """The spec of a built (possibly wrapped) model: from its config, else counted from its tensors."""
    model = _unwrap(model)
    config = getattr(model, "config", None)
    if config is not None and hasattr(config, "to_dict"):
        data = config.to_dict()
        name = str(getattr(config, "_name_or_path", "") or data.get("model_type") or type(model).__name__)
        name = name.rstrip("/").rsplit("/", 1)[-1] or type(model).__name__
        try:
            return spec_from_hf_config(data, name=name, source=name)
        except ShardfitError:
            pass  # a config shardfit can't read: count the module instead
    return spec_from_module(model, name=type(model).__name__, source=type(model).__module__)
