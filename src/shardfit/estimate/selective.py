"""What per-op selective activation checkpointing keeps per checkpointed block (shardfit/sac.py's
policy): traced from the model's own code (estimate/derived.py), shipped for the presets so their
analytic path stays torch-free (spec/presets/traced/selective.json, scripts/trace_presets.py). A
tensor-parallel rank keeps the outputs of its sliced matmuls: traced from the config that rank runs
(estimate/derived_parallel.py), shipped for the presets' tp 2, 4 and 8 ranks."""
from __future__ import annotations

import json
from functools import lru_cache
from importlib.util import find_spec

from shardfit.errors import ShardfitError
from shardfit.estimate import derived_parallel
from shardfit.estimate.derived import load_coefficients, twin
from shardfit.spec.models import PRESETS_DIR, model_spec_for


def selective_kept(model, regime: str, attention: str, lora, device: str = "cuda") -> tuple[float, float]:
    """(per token, per token x s) bytes that per-op selective checkpointing keeps in a checkpointed
    block beyond its input: the outputs of the matmuls it keeps (every other one) and of the
    attention kernel, traced under the same policy the engines run (shardfit/sac.py). A hand-written
    family's spec gets them from its derived twin (derived once, then cached like any config)."""
    key_lora = None if lora is None else (lora.rank, tuple(lora.target_modules), lora.base_dtype)
    return _selective_kept(model, regime, attention, key_lora)


@lru_cache(maxsize=256)
def _selective_kept(model, regime, attention, lora) -> tuple[float, float]:
    tp = tensor_parallel_degree(model)
    shipped = None
    if not model.derived and lora is None:
        table = _shipped_selective() if tp == 1 else _shipped_selective_tp().get(str(tp), {})
        shipped = table.get(model.source)
    if shipped is not None:
        return tuple(shipped[f"{regime}|{attention}"])
    derived = model if model.derived else twin_rank(model, tp)
    kinds = load_coefficients(derived, regime, attention, lora)["selective_kinds"]
    counts = [count for _, count, _ in derived.block_kinds]
    layers = max(sum(counts), 1)
    return (sum(n * k["per_token"] for n, k in zip(counts, kinds)) / layers,
            sum(n * k["per_token_s"] for n, k in zip(counts, kinds)) / layers)


def tensor_parallel_degree(model) -> int:
    """The tp of a hand-written family's tensor-parallel rank (model_parallel.local_model: heads / tp,
    the whole model's source), 1 for anything else."""
    if model.derived or not model.name.endswith("[rank]") or not model.num_heads:
        return 1
    return max(1, model_spec_for(model.source).num_heads // model.num_heads)


def twin_rank(model, tp: int):
    """The derived spec of what a hand-written family's tp rank runs: its twin sliced by the model's
    own TP plan (estimate/derived_parallel.py); the unsliced twin where the plan cannot be sliced."""
    whole = twin(model)
    if tp == 1:
        return whole
    try:
        return derived_parallel.local_model(whole, tp, loss_parallel=True)
    except ShardfitError:
        return whole


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
def _shipped_file() -> dict:
    """The presets' traced terms (spec/presets/traced/selective.json, scripts/trace_presets.py), read
    once, so a preset's plan stays torch-free; tests hold each section equal to a fresh trace."""
    try:
        return json.loads((PRESETS_DIR / "traced" / "selective.json").read_text())
    except (OSError, ValueError):
        return {}


def shipped_section(name: str) -> dict:
    """One section of the shipped file: presets, block_ops, tensor_parallel, sequence_parallel."""
    section = _shipped_file().get(name)
    return section if isinstance(section, dict) else {}


def _shipped_block_ops() -> dict:
    return shipped_section("block_ops")


def _shipped_selective_tp() -> dict:
    """{tp: {preset: terms}}: the presets' tensor-parallel ranks (their sliced twins)."""
    return shipped_section("tensor_parallel")


def _shipped_selective() -> dict:
    """The presets' selective-checkpointing terms."""
    return shipped_section("presets")
