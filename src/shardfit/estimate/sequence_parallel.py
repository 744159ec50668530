"""What sequence parallelism shards: the tensors the norms between the TP regions save. No torch here.

Under torch's sequence parallel (engines/sequence_parallel.py) the norms between the attention and
MLP regions run on sequence shards, so what they save for backward (an RMSNorm: its input, the
normalised hidden states, the reciprocal RMS; a LayerNorm: its input, mean and rstd) is 1/tp of what
a TP-only rank saves. Everything else a TP-only rank keeps stays as it is: the inputs of the colwise
linears are the all-gathered sequence (the norm's full output under TP alone), the rowwise outputs
kept by per-op selective checkpointing are the full partial sums before the reduce-scatter. A
checkpointed block keeps its input, which is the sequence-sharded residual stream.

The bytes come from the model's own code: the trace counts what the between-region norms save
(estimate/derived.py, "sp_norm_kinds"; the final norm's "sp_norm_post"), shipped for the presets
(spec/presets/traced/selective.json, scripts/trace_presets.py) so their analytic path stays torch-free.
"""
from __future__ import annotations

from functools import lru_cache

from shardfit.estimate.derived import load_coefficients, twin
from shardfit.estimate.selective import shipped_section


@lru_cache(maxsize=256)
def sharded_norm_bytes(model, regime: str) -> tuple[float, float, float]:
    """(bytes per token per layer that the norms between the TP regions save, averaged over the layers'
    kinds; the final norm's per token; extra gathered copies per layer): the last, where two colwise
    owners read one normed input under TP alone (Cohere's parallel attention and MLP), each all-gathers
    its own copy under SP, which its linears save at full width."""
    shipped = _shipped().get(model.source) if not model.derived else None
    if shipped is not None and regime in shipped:
        return tuple(shipped[regime])
    derived = model if model.derived else twin(model)
    c = load_coefficients(derived, regime, "sdpa", None)
    counts = [count for _, count, _ in derived.block_kinds]
    layers = max(sum(counts), 1)
    per_layer = sum(n * k["per_token"] for n, k in zip(counts, c["sp_norm_kinds"])) / layers
    extra = sum(n * k for n, k in zip(counts, c["sp_extra_gathers"])) / layers
    return per_layer, c["sp_norm_post"]["per_token"], extra


def _shipped() -> dict:
    return shipped_section("sequence_parallel")
