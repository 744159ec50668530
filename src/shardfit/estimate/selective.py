"""What per-op selective activation checkpointing keeps per checkpointed block (shardfit/sac.py's
policy): traced from the model's own code (estimate/derived.py), shipped for the presets so their
analytic path stays torch-free (spec/presets/traced/selective.json, scripts/trace_presets.py)."""
from __future__ import annotations

import json
from functools import lru_cache
from importlib.util import find_spec

from shardfit.estimate.derived import load_coefficients, twin
from shardfit.spec.models import PRESETS_DIR


def selective_kept(model, regime: str, attention: str, lora, device: str = "cuda") -> tuple[float, float]:
    """(per token, per token x s) bytes that per-op selective checkpointing keeps in a checkpointed
    block beyond its input: the outputs of the matmuls it keeps (every other one) and of the
    attention kernel, traced under the same policy the engines run (shardfit/sac.py). A hand-written
    family's spec gets them from its derived twin (derived once, then cached like any config)."""
    key_lora = None if lora is None else (lora.rank, tuple(lora.target_modules), lora.base_dtype)
    return _selective_kept(model, regime, attention, key_lora)


@lru_cache(maxsize=256)
def _selective_kept(model, regime, attention, lora) -> tuple[float, float]:
    shipped = _shipped_selective().get(model.source) if not model.derived and lora is None else None
    if shipped is not None:
        return tuple(shipped[f"{regime}|{attention}"])
    derived = model if model.derived else twin(model)
    kinds = load_coefficients(derived, regime, attention, lora)["selective_kinds"]
    counts = [count for _, count, _ in derived.block_kinds]
    layers = max(sum(counts), 1)
    return (sum(n * k["per_token"] for n, k in zip(counts, kinds)) / layers,
            sum(n * k["per_token_s"] for n, k in zip(counts, kinds)) / layers)


def selective_block_ops(model, regime: str, attention: str) -> float:
    """Aten ops one block dispatches in forward (averaged over the block kinds): per-op selective
    checkpointing's policy runs for each, in the forward and again in the recompute. Shipped for the
    presets; a derived spec's come with its traced coefficients (0 where an old cache lacks them)."""
    return _selective_block_ops(model, regime, attention)


@lru_cache(maxsize=256)
def _selective_block_ops(model, regime, attention) -> float:
    shipped = _shipped_block_ops().get(model.source) if not model.derived else None
    if shipped is not None:
        return float(shipped[f"{regime}|{attention}"])
    derived = model if model.derived else twin(model)
    ops = load_coefficients(derived, regime, attention, None).get("block_ops") or []
    counts = [count for _, count, _ in derived.block_kinds]
    return sum(n * k for n, k in zip(counts, ops)) / max(sum(counts), 1) if ops else 0.0


def selective_available(model) -> bool:
    """Whether selective checkpointing can be estimated without an error: a shipped preset or a
    derived spec's cache, else a trace, which needs torch (checked without importing it)."""
    return model.source in _shipped_selective() or find_spec("torch") is not None


@lru_cache(maxsize=1)
def _shipped_block_ops() -> dict:
    try:
        return json.loads((PRESETS_DIR / "traced" / "selective.json").read_text()).get("block_ops", {})
    except (OSError, ValueError):
        return {}


@lru_cache(maxsize=1)
def _shipped_selective() -> dict:
    """The presets' selective-checkpointing terms, traced once and shipped (scripts/trace_presets.py),
    so a preset's plan stays torch-free; tests hold them equal to a fresh trace."""
    try:
        return json.loads((PRESETS_DIR / "traced" / "selective.json").read_text())["presets"]
    except (OSError, ValueError, KeyError):
        return {}
