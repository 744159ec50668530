"""Model references -> ModelSpec: shipped presets, local HF config.json files, nn.Module factories.

For the seven hand-written families parameter counts are derived analytically from the config,
module by module, the way transformers builds the model (tests/spec/test_models.py pins every preset
against the real model built on the meta device). Every other model type is derived from
transformers itself (spec/derive.py: a meta-device build) once and then read from the spec cache
(spec/spec_cache.py). No torch here: deriving an uncached config and a factory reference
("pkg.module:fn") are the paths that need torch, and both import it lazily.
"""
from __future__ import annotations

import difflib
import json
import re
from functools import lru_cache
from pathlib import Path

from shardfit.errors import ShardfitError
from shardfit.spec import spec_cache
from shardfit.spec.derive import derive_spec
from shardfit.spec.factory import spec_from_factory  # torch only when a factory is called
from shardfit.spec.model_spec import ModelSpec

PRESETS_DIR = Path(__file__).resolve().parent / "presets"

# model_type -> (family, HF block class). The causal-LM class comes from the config's architectures.
FAMILIES = {
    "llama": "LlamaDecoderLayer",
    "mistral": "MistralDecoderLayer",
    "mixtral": "MixtralDecoderLayer",
    "qwen2": "Qwen2DecoderLayer",
    "gemma2": "Gemma2DecoderLayer",
    "gpt2": "GPT2Block",
    "bert": "BertLayer",
}
# NOTE: transformers' own defaults for tie_word_embeddings when a config omits it.
_TIE_DEFAULT = {"gemma2": True, "gpt2": True, "bert": True}
_FACTORY_RE = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$")


def preset_names() -> list[str]:
    return sorted(path.stem for path in PRESETS_DIR.glob("*.json"))


def list_presets() -> list[ModelSpec]:
    """Every shipped preset: real models by family and size, then the tiny test models."""
    specs = [model_spec_for(name) for name in preset_names()]
    return sorted(specs, key=lambda s: (s.name.startswith("tiny-"), s.family, s.n_params))


def is_factory_ref(ref: str) -> bool:
    return bool(_FACTORY_RE.match(ref)) and not Path(ref).exists()


def _read_json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ShardfitError(f"{path}: not valid JSON ({exc.msg} at line {exc.lineno}): fix the file or point at another config") from None
    except OSError as exc:
        raise ShardfitError(f"{path}: cannot read it ({exc.strerror})") from None
    if not isinstance(data, dict):
        raise ShardfitError(f"{path}: a model config must be a JSON object, got {type(data).__name__}")
    return data


def resolve_config_path(ref: str) -> Path | None:
    """The config.json a reference names (a preset, a file, or a directory holding config.json)."""
    preset = PRESETS_DIR / f"{ref.lower()}.json"
    if "/" not in ref and "\\" not in ref and preset.is_file():
        return preset
    path = Path(ref).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ShardfitError(f"{ref}: the directory has no config.json: point at a Hugging Face model directory or a config file")
        return path / "config.json"
    if path.is_file():
        return path
    return None


def load_hf_config(ref: str) -> dict:
    """A Hugging Face config dict from a preset name, a config.json path, or a model directory."""
    if not isinstance(ref, str) or not ref.strip():
        raise ShardfitError("the model reference is empty: give a preset name (see `shardfit models`), a config.json path or pkg.module:fn")
    ref = ref.strip()
    path = resolve_config_path(ref)
    if path is None:
        raise ShardfitError(_unknown_message(ref))
    cfg = _read_json(path)
    model_type = cfg.get("model_type")
    if model_type is None:
        raise ShardfitError(f"{path}: the config has no 'model_type': it must be a Hugging Face config.json")
    if not isinstance(model_type, str) or not model_type:
        raise ShardfitError(f"{path}: 'model_type' must be a transformers model type such as \"llama\", got {model_type!r}")
    return cfg


def _unknown_message(ref: str) -> str:
    if "/" in ref or ref.endswith(".json") or ref.startswith("."):
        return (f"'{ref}': no such file or directory; give a local config.json or model directory "
                f"(Hub ids are not fetched: download the config.json first), or a preset (see `shardfit models`)")
    names = preset_names()
    close = difflib.get_close_matches(ref.lower(), names, n=3, cutoff=0.5)
    hint = f"did you mean {', '.join(close)}?" if close else f"presets: {', '.join(names)}"
    return f"unknown model '{ref}': {hint} (or give a config.json path, or pkg.module:fn)"


def _get(cfg: dict, *keys, default=None, required=True):
    for key in keys:
        if cfg.get(key) is not None:
            return cfg[key]
    if default is not None or not required:
        return default
    raise ShardfitError(f"model config ({cfg.get('model_type')}) lacks '{keys[0]}': add it to the config.json")


def _positive(cfg: dict, *keys, default=None) -> int:
    value = _get(cfg, *keys, default=default)
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ShardfitError(f"model config: '{keys[0]}' must be a positive integer, got {value!r}")
    return value


def _linear(n_in: int, n_out: int, bias: bool) -> int:
    return n_in * n_out + (n_out if bias else 0)


def _decoder(cfg: dict, model_type: str) -> dict:
    """Llama-style decoders: llama, mistral, mixtral, qwen2, gemma2."""
    h = _positive(cfg, "hidden_size")
    layers = _positive(cfg, "num_hidden_layers")
    heads = _positive(cfg, "num_attention_heads")
    kv = _positive(cfg, "num_key_value_heads", default=heads)
    if h % heads and not cfg.get("head_dim"):
        raise ShardfitError(f"model config: hidden_size {h} is not divisible by num_attention_heads {heads}: set head_dim")
    head_dim = _positive(cfg, "head_dim", default=h // heads)
    inter = _positive(cfg, "intermediate_size")
    vocab = _positive(cfg, "vocab_size")
    # Which projections carry a bias, as each transformers class builds them.
    qkv_bias = o_bias = bool(cfg.get("attention_bias", False)) if model_type in ("llama", "gemma2") else False
    if model_type == "qwen2":
        qkv_bias, o_bias = True, False
    mlp_bias = bool(cfg.get("mlp_bias", False)) if model_type == "llama" else False
    attn = {
        "q_proj": _linear(h, heads * head_dim, qkv_bias),
        "k_proj": _linear(h, kv * head_dim, qkv_bias),
        "v_proj": _linear(h, kv * head_dim, qkv_bias),
        "o_proj": _linear(heads * head_dim, h, o_bias),
    }
    experts = per_token = 0
    if model_type == "mixtral":
        experts = _positive(cfg, "num_local_experts")
        per_token = _positive(cfg, "num_experts_per_tok")
        # NOTE: transformers >= 5 stores all experts as two 3-D parameters of one module
        # (MixtralExperts), so that module, not the embedding, is the largest layer.
        mlp = {"gate": experts * h, "experts": experts * 3 * h * inter}
    else:
        mlp = {name: _linear(a, b, mlp_bias) for name, a, b in
               (("gate_proj", h, inter), ("up_proj", h, inter), ("down_proj", inter, h))}
    norms = 4 if model_type == "gemma2" else 2  # gemma2 adds pre/post-feedforward norms
    block = {**attn, **mlp, **{f"norm{i}": h for i in range(norms)}}
    tie = bool(cfg.get("tie_word_embeddings", _TIE_DEFAULT.get(model_type, False)))
    outside = {"embed_tokens": vocab * h, "norm": h}
    shared = {}
    (shared if tie else outside)["lm_head"] = vocab * h
    return dict(
        hidden_size=h, num_layers=layers, num_heads=heads, num_kv_heads=kv, head_dim=head_dim,
        intermediate_size=inter, vocab_size=vocab, max_position=int(cfg.get("max_position_embeddings") or 0),
        tie_embeddings=tie, num_experts=experts, experts_per_token=per_token,
        # gated MLPs (SwiGLU, Gemma's GeGLU) keep the same three projections and saved tensors
        mlp="swiglu", norm="rmsnorm", dropout=float(cfg.get("attention_dropout") or 0.0), causal_lm=True,
        _block=block, _outside=outside, _shared=shared,
    )


def _gpt2(cfg: dict) -> dict:
    h = _positive(cfg, "n_embd", "hidden_size")
    layers = _positive(cfg, "n_layer", "num_hidden_layers")
    heads = _positive(cfg, "n_head", "num_attention_heads")
    if h % heads:
        raise ShardfitError(f"model config: n_embd {h} is not divisible by n_head {heads}")
    inter = _positive(cfg, "n_inner", default=4 * h)
    vocab = _positive(cfg, "vocab_size")
    positions = _positive(cfg, "n_positions", "max_position_embeddings")
    if cfg.get("add_cross_attention"):
        raise ShardfitError("model config: GPT-2 with add_cross_attention is not supported: set it to false")
    # GPT-2's Conv1D layers all carry a bias; LayerNorm has weight and bias.
    block = {"ln_1": 2 * h, "c_attn": _linear(h, 3 * h, True), "attn.c_proj": _linear(h, h, True),
             "ln_2": 2 * h, "c_fc": _linear(h, inter, True), "mlp.c_proj": _linear(inter, h, True)}
    tie = bool(cfg.get("tie_word_embeddings", True))
    outside = {"wte": vocab * h, "wpe": positions * h, "ln_f": 2 * h}
    shared = {}
    (shared if tie else outside)["lm_head"] = vocab * h
    dropout = max(float(cfg.get(key) or 0.0) for key in ("resid_pdrop", "attn_pdrop", "embd_pdrop"))
    return dict(
        hidden_size=h, num_layers=layers, num_heads=heads, num_kv_heads=heads, head_dim=h // heads,
        intermediate_size=inter, vocab_size=vocab, max_position=positions, tie_embeddings=tie,
        mlp="gelu", norm="layernorm", dropout=dropout, causal_lm=True,
        _block=block, _outside=outside, _shared=shared,
    )


def _bert(cfg: dict) -> dict:
    """BertForMaskedLM: BertModel without the pooler, plus the MLM head (cls.predictions)."""
    h = _positive(cfg, "hidden_size")
    layers = _positive(cfg, "num_hidden_layers")
    heads = _positive(cfg, "num_attention_heads")
    if h % heads:
        raise ShardfitError(f"model config: hidden_size {h} is not divisible by num_attention_heads {heads}")
    inter = _positive(cfg, "intermediate_size")
    vocab = _positive(cfg, "vocab_size")
    positions = _positive(cfg, "max_position_embeddings")
    types = _positive(cfg, "type_vocab_size", default=2)
    if cfg.get("position_embedding_type", "absolute") != "absolute":
        raise ShardfitError(f"model config: BERT position_embedding_type '{cfg['position_embedding_type']}' is not supported: use 'absolute'")
    block = {"query": _linear(h, h, True), "key": _linear(h, h, True), "value": _linear(h, h, True),
             "attention.output.dense": _linear(h, h, True), "attention.output.LayerNorm": 2 * h,
             "intermediate.dense": _linear(h, inter, True), "output.dense": _linear(inter, h, True),
             "output.LayerNorm": 2 * h}
    tie = bool(cfg.get("tie_word_embeddings", True))
    # transformers 5 ties the decoder's weight to the word embedding and its bias to
    # cls.predictions.bias only when tie_word_embeddings; untied, both are separate parameters.
    # DeepSpeed counts the decoder module as weight + bias either way.
    outside = {"word_embeddings": vocab * h, "position_embeddings": positions * h,
               "token_type_embeddings": types * h, "embeddings.LayerNorm": 2 * h,
               "transform.dense": _linear(h, h, True), "transform.LayerNorm": 2 * h, "predictions.bias": vocab}
    shared = {}
    (shared if tie else outside)["decoder"] = vocab * h + vocab
    dropout = max(float(cfg.get(key) or 0.0) for key in ("hidden_dropout_prob", "attention_probs_dropout_prob"))
    return dict(
        hidden_size=h, num_layers=layers, num_heads=heads, num_kv_heads=heads, head_dim=h // heads,
        intermediate_size=inter, vocab_size=vocab, max_position=positions, tie_embeddings=tie,
        mlp="gelu", norm="layernorm", dropout=dropout, causal_lm=False,
        _block=block, _outside=outside, _shared=shared,
    )


def spec_from_hf_config(cfg: dict, name: str, source: str) -> ModelSpec:
    """The spec of the transformers model this config builds: exact analytic counts for the
    hand-written families (no torch), derived from transformers itself for every other model type."""
    model_type = cfg.get("model_type") if isinstance(cfg, dict) else None
    if model_type not in FAMILIES:
        return derived_spec(cfg, name, source)
    return analytic_spec(cfg, name, source)


def analytic_spec(cfg: dict, name: str, source: str) -> ModelSpec:
    """Hand-written rules for the seven families (the fast path; tests hold them equal to derive)."""
    model_type = cfg.get("model_type") if isinstance(cfg, dict) else None
    if model_type not in FAMILIES:
        raise ShardfitError(f"model '{name}': model_type {model_type!r} has no hand-written rules (those have: {', '.join(FAMILIES)})")
    if model_type == "gpt2":
        shape = _gpt2(cfg)
    elif model_type == "bert":
        shape = _bert(cfg)
    else:
        shape = _decoder(cfg, model_type)
    block, outside, shared = shape.pop("_block"), shape.pop("_outside"), shape.pop("_shared")
    block_params = sum(block.values())
    non_block = sum(outside.values())
    # DeepSpeed's largest_layer: the most parameters any single module owns (tied ones included).
    largest = max([*block.values(), *outside.values(), *shared.values()])
    return ModelSpec(
        name=name, family=model_type, source=source,
        n_params=shape["num_layers"] * block_params + non_block,
        block_class=FAMILIES[model_type], block_params=block_params,
        largest_layer_params=largest, non_block_params=non_block, **shape,
    )


def derived_spec(cfg: dict, name: str, source: str) -> ModelSpec:
    """Any transformers config: from the spec cache (no torch), else built on the meta device and
    counted (spec/derive.py, seconds), then cached. The name and source are this reference's."""
    key = spec_cache.config_key(cfg)
    entry = spec_cache.read_entry(key)
    if entry is None:
        entry = derived_entry(cfg, name, source)
    try:
        spec = ModelSpec.from_dict({**entry["spec"], "name": name, "source": source})
    except (ShardfitError, KeyError, TypeError):
        entry = derived_entry(cfg, name, source)
        spec = ModelSpec.from_dict({**entry["spec"], "name": name, "source": source})
    return spec


def derived_entry(cfg: dict, name: str, source: str) -> dict:
    """Derive a spec (torch + transformers) and write its cache entry: the config, the spec and what
    the activation tracer needs to build a reduced-depth copy."""
    try:
        import torch  # noqa: F401
        import transformers  # noqa: F401
    except ImportError:
        raise ShardfitError(f"model '{name}': model_type '{cfg.get('model_type')}' has no shipped rules, and deriving "
                            f"them needs torch and transformers (pip install 'shardfit[run]'); presets and "
                            f"cached specs do not") from None
    key = spec_cache.config_key(cfg)
    spec, facts = derive_spec(cfg, name, source, config_hash=key)
    facts["max_position"] = spec.max_position
    entry = {"config": cfg, "spec": spec.to_dict(), "facts": facts, "coefficients": {}}
    spec_cache.write_entry(key, entry)
    entry["key"] = key
    return entry


def load_model_spec(ref: str) -> ModelSpec:
    """A preset name, a local config.json or model directory, or an nn.Module factory 'pkg.module:fn'."""
    if not isinstance(ref, str) or not ref.strip():
        raise ShardfitError("the model reference is empty: give a preset name (see `shardfit models`), a config.json path or pkg.module:fn")
    ref = ref.strip()
    if is_factory_ref(ref):
        return spec_from_factory(ref)
    cfg = load_hf_config(ref)
    path = resolve_config_path(ref)
    if path.parent == PRESETS_DIR:
        return spec_from_hf_config(cfg, name=path.stem, source=path.stem)
    name = path.parent.name if path.name == "config.json" else path.stem
    return spec_from_hf_config(cfg, name=name or path.stem, source=str(path.resolve()))


@lru_cache(maxsize=128)
def model_spec_for(ref: str) -> ModelSpec:
    """Cached load_model_spec (specs are frozen; presets never change within a process)."""
    return load_model_spec(ref)
