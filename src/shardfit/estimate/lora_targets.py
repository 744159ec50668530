"""Which linears LoRA adapts when no --lora-targets is given: the model's own attention projections.

The names come from the spec's linears (hand-written families' shapes, or what a meta-device build
listed for a derived spec), never from one architecture's naming: GPT-2 has `c_attn`, BERT
`query/key/value`, Bloom `query_key_value`, Llama `q_proj..o_proj`. A model with none of the known
attention names gets `all-linear`.
"""
from __future__ import annotations

from dataclasses import replace

from shardfit.estimate.states import model_linears
from shardfit.spec.model_spec import ModelSpec
from shardfit.spec.models import model_spec_for
from shardfit.spec.plan import LoRA

# Attention projections by the leaf names transformers gives them. `c_proj` (GPT-2) and `dense`
# (BERT, Bloom) are left out: the same name is the MLP's output too, so targeting it adapts both.
ATTENTION_NAMES = ("q_proj", "k_proj", "v_proj", "o_proj", "c_attn", "query", "key", "value",
                   "query_key_value", "qkv_proj", "Wqkv", "out_proj")
DEFAULT_RANK = 16


def linear_names(model) -> tuple[str, ...]:
    """The model's block-linear leaf names, in the spec's order, each once."""
    return tuple(dict.fromkeys(name for name, *_ in model_linears(model)))


def default_lora_targets(model) -> tuple[str, ...]:
    attention = tuple(name for name in linear_names(model) if name in ATTENTION_NAMES)
    return attention or ("all-linear",)


def lora_for(model, rank: int | None = None, base_dtype: str | None = None,
             targets: tuple[str, ...] | None = None, lora: LoRA | None = None) -> LoRA:
    """A LoRA for `model`: the given fields over `lora` (or the defaults), with the model's own attention
    projections as targets when none were named (LoRA()'s default names are Llama's)."""
    out = lora or LoRA(rank=DEFAULT_RANK, target_modules=default_lora_targets(model))
    changes = {k: v for k, v in (("rank", rank), ("base_dtype", base_dtype), ("target_modules", targets))
               if v is not None}
    return replace(out, **changes) if changes else out


def with_default_targets(lora: dict | None, model_ref) -> dict | None:
    """A plan mapping's training.lora with the model's own attention projections filled in when it names
    no target_modules (train / profile flags): `model_ref` is the plan's model, a reference or a mapping."""
    if lora is None or lora.get("target_modules"):
        return lora

    model = ModelSpec.from_dict(model_ref) if isinstance(model_ref, dict) else model_spec_for(str(model_ref))
    return {**lora, "target_modules": list(default_lora_targets(model))}
