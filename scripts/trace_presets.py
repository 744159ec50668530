"""Write src/shardfit/spec/presets/traced/selective.json: what per-op selective checkpointing keeps per
block of every shipped preset, and the aten ops a block dispatches (what SAC's policy runs for), per
precision regime and attention kernel, traced from each preset's
derived twin (shardfit/estimate/derived.py). The presets' analytic path reads it, so `plan` and `fit`
of a preset stay torch-free with `--ac selective`; tests/estimate/test_selective.py holds it equal
to a fresh trace. Run after changing the tracer or the SAC policy:

    .venv/bin/python scripts/trace_presets.py
"""
from __future__ import annotations

import json
import sys
import time

from shardfit.estimate.derived import load_coefficients, twin
from shardfit.estimate.selective import twin_rank
from shardfit.spec.models import PRESETS_DIR, model_spec_for, preset_names

REGIMES = ("fp32", "half", "autocast")
ATTENTION = ("sdpa", "eager")
TARGET = PRESETS_DIR / "traced" / "selective.json"


TENSOR_PARALLEL = (2, 4, 8)


def kept(spec, regime: str, attention: str, tp: int = 1) -> list[float]:
    derived = twin_rank(spec, tp) if tp > 1 else twin(spec)
    kinds = load_coefficients(derived, regime, attention, None)["selective_kinds"]
    counts = [count for _, count, _ in derived.block_kinds]
    layers = max(sum(counts), 1)
    return [sum(n * k[term] for n, k in zip(counts, kinds)) / layers for term in ("per_token", "per_token_s")]


def block_ops(spec, regime: str, attention: str) -> float:
    derived = twin(spec)
    ops = load_coefficients(derived, regime, attention, None)["block_ops"]
    counts = [count for _, count, _ in derived.block_kinds]
    return sum(n * k for n, k in zip(counts, ops)) / max(sum(counts), 1)


def tp_degrees(spec) -> list[int]:
    """The tp degrees whose rank the model's own TP plan slices into a config (others: not shipped)."""
    kv = spec.num_kv_heads or spec.num_heads
    out = []
    for tp in TENSOR_PARALLEL:
        if spec.num_heads % tp or kv % tp or (spec.intermediate_size or 0) % tp:
            continue
        if twin_rank(spec, tp) is not twin(spec):
            out.append(tp)
    return out


def tp_table(names) -> dict:
    """{tp: {preset: terms}} of every preset's tensor-parallel ranks."""
    out: dict = {}
    for name in names:
        start = time.perf_counter()
        spec = model_spec_for(name)
        for tp in tp_degrees(spec):
            out.setdefault(str(tp), {})[name] = {f"{regime}|{attention}": kept(spec, regime, attention, tp)
                                                 for regime in REGIMES for attention in ATTENTION}
        print(f"{name} (tp): {time.perf_counter() - start:.1f} s", file=sys.stderr)
    return out


def sp_table(names) -> dict:
    """{preset: {regime: [per token per layer, final norm per token, extra gathers per layer]}}: what the
    norms between the TP regions save (sequence parallel shards them; estimate/sequence_parallel.py)."""
    from shardfit.estimate.sequence_parallel import sharded_norm_bytes

    out = {}
    for name in names:
        spec = model_spec_for(name)
        out[name] = {regime: list(sharded_norm_bytes(twin(spec), regime)) for regime in REGIMES}
    return out


def table(names) -> tuple[dict, dict]:
    out, ops = {}, {}
    for name in names:
        start = time.perf_counter()
        spec = model_spec_for(name)
        keys = [(regime, attention) for regime in REGIMES for attention in ATTENTION]
        out[name] = {f"{regime}|{attention}": kept(spec, regime, attention) for regime, attention in keys}
        ops[name] = {f"{regime}|{attention}": block_ops(spec, regime, attention) for regime, attention in keys}
        print(f"{name}: {time.perf_counter() - start:.1f} s", file=sys.stderr)
    return out, ops


if __name__ == "__main__":
    import transformers

    presets, ops = table(preset_names())
    data = {"transformers": transformers.__version__, "per_block_bytes": "[per token, per token x seq]",
            "presets": presets, "block_ops": ops, "tensor_parallel": tp_table(preset_names()),
            "sequence_parallel": sp_table(preset_names())}
    TARGET.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")
    print(f"wrote {TARGET}")
