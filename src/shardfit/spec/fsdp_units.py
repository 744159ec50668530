"""Where FSDP2 puts the token embedding and the output head.

"root": in the root unit, gathered from the start of forward to the end of backward (FSDP2 does not
reshard the root after forward). "separate": units of their own, torchtitan's wrapping
(torchtitan/models/llama3/infra/parallelize.py apply_fsdp): the embedding is resharded after its forward
and gathered again for its backward at the very end; the head stays gathered from its forward through
its backward (reshard_after_forward=False: backward needs it at once) and its gradient is
reduce-scattered right after, not with the root's at the end. "auto": separate under fsdp2 when the
head is not tied to the embedding and the plan has no tensor parallelism, else root (under tp > 1 the
embedding and head are vocab-sharded DTensors kept in the root: the rank-local estimate models that
wrapping only). A tied head shares the embedding's one weight, which only
one unit can own: it stays in the root. FSDP1 wraps by class (ModuleWrapPolicy): root only.
"""
from __future__ import annotations

EMBEDDING_UNITS = ("auto", "root", "separate")


def separate_embedding_units(strategy, model) -> bool:
    """Whether FSDP2 wraps the token embedding and the output head as units of their own."""
    if strategy.kind != "fsdp2" or strategy.embedding_units == "root" or model.tie_embeddings:
        return False
    return bool(model.vocab_size and model.hidden_size and model.block_params)


def embedding_units_error(plan) -> str | None:
    """One line when the plan asks for separate units where they cannot be."""
    s = plan.strategy
    if s.embedding_units != "separate":
        return None
    if s.kind != "fsdp2":
        return (f"strategy.embedding_units separate is FSDP2's wrapping (torchtitan): {s.kind} keeps the embedding "
                "and head in its root unit; use fsdp2, or embedding_units auto")
    if plan.parallelism.tp > 1:
        return ("strategy.embedding_units separate is not modelled under tensor parallelism (tp > 1): the "
                "vocab-sharded embedding and head stay in FSDP2's root unit; use embedding_units auto or root")
    if plan.model.tie_embeddings:
        return (f"{plan.model.name} ties its head to the embedding (one weight): it cannot be split into two FSDP "
                "units; use strategy.embedding_units auto or root")
    return None
