"""The config of what one tensor-parallel rank runs, for a model without hand-written rules. No torch.

transformers' TP plans for attention and MLP (colwise q/k/v, gate/up; rowwise o/down) give each rank
heads / tp of the attention heads (whole heads: the reshapes take -1 heads) and intermediate / tp of
the MLP, with the residual stream, the norms between the regions and the per-head norms (Qwen3's
q_norm, `replicated_with_grad_allreduce`) at full width. That is the same model with fewer heads and
a narrower MLP: the config with num_heads / tp, num_kv_heads / tp, head_dim pinned and the
intermediate sizes the plan slices / tp. Its derived spec and traced activations are then one rank's,
from the model's own code, like any config (spec/derive.py, estimate/derived.py).

Checked, not assumed: the sliced config must build exactly the linears the plan leaves on a rank
(`check_sliced`); a model whose code does not take the pinned head_dim, or whose plan slices
something no config knob narrows (DeepSeek's shared experts), is refused with one line. Plans that
gather inside a block (`colwise_gather_output` on q/k/v: OLMo-2, Phi-3's fused projections;
`rowwise_split_input`) run the attention at full width on every rank: also refused for now.

The sliced spec's `source` names the base config and the overrides, so a cleared cache derives the
same sliced config again (decode_source).
"""
from __future__ import annotations

import json

from shardfit.errors import ShardfitError

HEAD_KEYS = ("num_attention_heads", "n_head", "num_heads", "n_heads")
KV_KEYS = ("num_key_value_heads", "num_kv_heads", "multi_query_group_num")
INTERMEDIATE_KEYS = ("intermediate_size", "n_inner", "ffn_dim", "d_ff", "ffn_hidden_size", "moe_intermediate_size",
                     "shared_expert_intermediate_size")
VOCAB_KEYS = ("vocab_size",)
# Styles inside a block a sliced config reproduces: linears split over whole heads or MLP columns,
# parameters kept whole with hooks on their gradients.
BLOCK_STYLES = ("colwise", "rowwise", "replicated_with_grad_allreduce", "mla_kv_a_proj")
SOURCE_MARK = "#rank-config:"


def leaf_styles(spec) -> dict:
    """{linear leaf name: style} of the plan's entries inside the blocks (patterns with a '*')."""
    return {path.rsplit(".", 1)[-1]: style for path, style in spec.tp_plan if "*" in path}


def embedding_sharded(spec) -> bool:
    return any(style == "embedding_rowwise" for _, style in spec.tp_plan)


def head_sharded(spec) -> bool:
    """The head (an entry outside the blocks, colwise): vocab-parallel, its logits gathered or not."""
    return any("*" not in path and style.startswith("colwise") for path, style in spec.tp_plan)


def check_plan(spec, tp: int) -> None:
    """One line when this model's TP plan is not one a sliced config reproduces."""
    if not spec.tp_plan:
        raise ShardfitError(f"{spec.name} ({spec.family}) has no tensor-parallel plan in transformers "
                            f"(base_model_tp_plan): set tp to 1, or shard it with fsdp2 / ZeRO-3")
    odd = sorted({style for path, style in spec.tp_plan if "*" in path and style not in BLOCK_STYLES})
    if odd:
        raise ShardfitError(f"{spec.name} ({spec.family}): its TP plan uses '{odd[0]}' inside the blocks, which runs "
                            f"part of every block at full width on each rank; per-rank activations of that plan are "
                            f"not modelled yet: set tp to 1")


def _text_part(cfg: dict) -> str | None:
    """The sub-config holding the text model's sizes (multimodal configs), or None for the top level."""
    text = cfg.get("text_config")
    return "text_config" if isinstance(text, dict) and any(k in text for k in HEAD_KEYS) else None


def tp_overrides(cfg: dict, spec, tp: int, vocab: int) -> dict:
    """{key: value} of the text config that one tp rank runs: heads, KV heads and the intermediate
    sizes the plan slices divided by tp, head_dim pinned, the vocabulary `vocab` (the rank's logits
    width: V/tp under a vocab-parallel loss, else V)."""
    part = cfg.get(_text_part(cfg)) if _text_part(cfg) else cfg
    # The MLP widths the plan slices: colwise outputs / rowwise inputs of its entries outside the
    # attention. NOTE: by the entry's path, not by width: a fused q/k/v or a MoE model's 3-D experts
    # (not linears) can be exactly as wide as the MLP.
    mlp = {path.rsplit(".", 1)[-1]: style for path, style in spec.tp_plan
           if "*" in path and not any(word in path.rsplit(".", 1)[0] for word in ("attn", "attention"))}
    widths = {o for name, _, o, _ in spec.linears if mlp.get(name) == "colwise"}
    widths |= {i for name, i, _, _ in spec.linears if mlp.get(name) == "rowwise"}
    out: dict = {}
    if tp > 1:
        for key in INTERMEDIATE_KEYS:
            value = part.get(key)
            if isinstance(value, int) and not isinstance(value, bool) and value in widths:
                if value % tp:
                    raise ShardfitError(f"tp = {tp} must divide {spec.name}'s {key} {value}: choose another tp")
                out[key] = value // tp
        for key in HEAD_KEYS + KV_KEYS:
            value = part.get(key)
            if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                out[key] = value // tp
        if spec.head_dim:
            out["head_dim"] = spec.head_dim
    for key in VOCAB_KEYS:
        if key in part:
            out[key] = vocab
    return out


def with_overrides(cfg: dict, overrides: dict) -> dict:
    part = _text_part(cfg)
    if part:
        return {**cfg, part: {**cfg[part], **overrides}}
    return {**cfg, **overrides}


def encode_source(source: str, overrides: dict) -> str:
    return f"{source}{SOURCE_MARK}{json.dumps(overrides, sort_keys=True)}"


def decode_source(source: str) -> tuple[str, dict]:
    """(the base config's reference, the overrides) of a sliced spec's source; ({}) for any other."""
    base, mark, rest = source.partition(SOURCE_MARK)
    return (base, json.loads(rest)) if mark else (source, {})


def expected_linears(spec, tp: int) -> tuple:
    """The block linears a tp rank holds under the plan: colwise out / tp, rowwise in / tp."""
    styles = leaf_styles(spec)
    out = []
    for name, i, o, n in spec.linears:
        style = styles.get(name)
        out.append((name, i, o // tp if style == "colwise" else o, n) if style != "rowwise" else (name, i // tp, o, n))
    return tuple(sorted(out))


def _outside_linears(spec) -> int:
    """Block parameters that are not linear weights (norms, biases, 3-D experts, routers' biases)."""
    return spec.n_params - spec.non_block_params - sum(i * o * n for _, i, o, n in spec.linears)


def check_sliced(spec, sliced, tp: int) -> None:
    """The sliced config must build what the plan leaves on a rank: its linears exactly, and every
    other block parameter whole but the biases of the colwise linears (at most their outputs
    (1 - 1/tp) fewer). One line otherwise (e.g. DeepSeek: its routed experts, outside the plan, are
    as wide as the shared experts it slices)."""
    want, got = expected_linears(spec, tp), tuple(sorted(sliced.linears))
    styles = leaf_styles(spec)
    biases = sum((o - o // tp) * n for name, _, o, n in spec.linears if styles.get(name) == "colwise")
    fewer = _outside_linears(spec) - _outside_linears(sliced)
    if want != got or not 0 <= fewer <= biases:
        diff = sorted(set(want) ^ set(got))[:2] or f"{fewer} fewer parameters outside the linears"
        raise ShardfitError(f"{spec.name} ({spec.family}): a config with heads and MLP / {tp} does not build what its TP "
                            f"plan leaves on a rank ({diff}): per-rank estimates of this architecture under tp are "
                            f"not modelled yet: set tp to 1")
