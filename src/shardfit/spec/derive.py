"""A ModelSpec for any transformers config, derived from transformers' own code.

The model class the config names (causal LM first, then masked LM, then seq2seq LM) is built on the
meta device (shapes only, no memory) and counted: unique parameters (tied weights once), the
repeated blocks (every kind: dense and MoE layers, attention and Mamba layers, encoder and decoder
layers), the largest module, the linears LoRA can target, the parameter tensor shapes (ZeRO-3's
persistence threshold and Adafactor's factoring need them), the expert layout from the config.

torch and transformers are imported inside the functions: importing this module is free.
"""
from __future__ import annotations

from collections import Counter
from contextlib import contextmanager

from shardfit.errors import ShardfitError
from shardfit.spec.model_spec import ModelSpec
from shardfit.spec.tp_modules import routed_expert_params

# The class each hand-written family is trained as, whatever the config's `architectures` says.
FORCED_CLASS = {"bert": "BertForMaskedLM"}
_LM_SUFFIXES = ("ForCausalLM", "LMHeadModel", "ForMaskedLM", "ForConditionalGeneration")
# Config attributes that name the MoE layout, across model families.
_EXPERTS = ("num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts", "num_routed_experts")
_TOP_K = ("num_experts_per_tok", "num_experts_per_token", "moe_topk", "top_k", "moe_top_k")
_SHARED = ("n_shared_experts", "num_shared_experts", "shared_expert_count")


@contextmanager
def quiet():
    """transformers' config warnings (token ids outside a small vocabulary, ...) and torch's fake-tensor
    error log are noise for a derivation: a real failure still raises and becomes one error line."""
    import logging  # NOTE: only a derivation needs it (transformers and torch import it anyway); a cached plan does not

    loggers = [logging.getLogger(name) for name in ("transformers", "torch._subclasses.fake_tensor")]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        for logger, level in zip(loggers, levels):
            logger.setLevel(level)


def config_object(cfg: dict):
    """transformers' config object for a config dict; one error line when the type is unknown."""
    from transformers import CONFIG_MAPPING

    model_type = cfg.get("model_type")
    if model_type not in CONFIG_MAPPING:
        import transformers
        raise ShardfitError(f"model_type '{model_type}' is not known to the installed transformers "
                            f"{transformers.__version__}: upgrade transformers, or pass a factory 'pkg.module:fn'")
    try:
        return CONFIG_MAPPING[model_type](**cfg)
    except Exception as exc:  # noqa: BLE001 - a user's config: one line
        raise ShardfitError(f"model_type '{model_type}': transformers refuses the config "
                            f"({type(exc).__name__}: {_first_line(exc)})") from None


def model_class(config, architectures=()):
    """The class a config is trained as: an LM class its `architectures` names, else transformers'
    causal-LM class for the config, else its masked-LM, else its seq2seq-LM class."""
    import transformers
    from transformers.models.auto import modeling_auto as auto

    model_type = config.model_type
    mappings = (auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES, auto.MODEL_FOR_MASKED_LM_MAPPING_NAMES,
                auto.MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES)
    known = {name for mapping in mappings for name in mapping.values() if isinstance(name, str)}
    candidates = [FORCED_CLASS.get(model_type)]
    candidates += [a for a in architectures or () if a in known or a.endswith(_LM_SUFFIXES)]
    candidates += [mapping.get(model_type) for mapping in mappings]
    for name in candidates:
        cls = getattr(transformers, name, None) if isinstance(name, str) else None
        if cls is not None:
            return cls
    raise ShardfitError(f"model_type '{model_type}' has no causal-LM, masked-LM or seq2seq-LM class in transformers "
                        f"{transformers.__version__}: pass a factory 'pkg.module:fn' that returns the nn.Module")


def build_hf_model(cfg: dict, device: str = "meta", dtype=None, attn_implementation: str | None = None,
                   overrides: dict | None = None):
    """The transformers model a config dict builds (use_cache off: a KV cache breaks recompute)."""
    import torch

    config = config_object({**cfg, **(overrides or {})})
    config.use_cache = False
    cls = model_class(config, cfg.get("architectures"))
    kwargs = {"dtype": dtype or torch.float32}
    if attn_implementation == "sdpa" and not getattr(cls, "_supports_sdpa", True):
        # NOTE: e.g. Gemma-2 has no SDPA path in transformers 5 (logit soft-capping): eager is its only kernel.
        attn_implementation = "eager"
    if attn_implementation:
        kwargs["attn_implementation"] = attn_implementation
    text = _text_config(config)
    # A text-only LM class of a multimodal type (Llama-4, Qwen3.5) takes the text sub-config.
    if text is not config:
        text.use_cache = False
    attempts = [config] + ([text] if text is not config else [])
    for attempt in attempts:
        try:
            with torch.device(device):
                return cls._from_config(attempt, **kwargs)
        except Exception as exc:  # noqa: BLE001 - transformers' own refusal, as one line
            error = exc
    raise ShardfitError(f"{cls.__name__} cannot be built from this config ({type(error).__name__}: {_first_line(error)})")


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0][:240] if text else ""


def unique_params(module, seen: set | None = None) -> int:
    seen = set() if seen is None else seen
    total = 0
    for p in module.parameters():
        if id(p) not in seen:
            seen.add(id(p))
            total += p.numel()
    return total


def find_blocks(model) -> list:
    """The repeated blocks: children of every nn.ModuleList of >= 2 non-torch.nn modules that holds at
    least 10% of the largest such list's parameters and is not inside a list already taken (MoE
    expert lists sit inside blocks; an encoder-decoder has two lists). Lists may mix classes
    (attention and Mamba layers)."""
    import torch

    lists = [m for m in model.modules() if isinstance(m, torch.nn.ModuleList) and len(m) >= 2
             and all(not type(c).__module__.startswith("torch.nn") for c in m) and unique_params(m) > 0]
    lists.sort(key=unique_params, reverse=True)
    inside: set = set()
    chosen = []
    for module_list in lists:
        # NOTE: measured against the largest list, not the model: a small config's embedding can
        # outweigh all its layers.
        if id(module_list) in inside or unique_params(module_list) < 0.1 * unique_params(lists[0]):
            continue
        chosen.append(module_list)
        inside.update(id(m) for m in module_list.modules())
    order = {id(m): i for i, m in enumerate(model.modules())}
    return sorted((block for module_list in chosen for block in module_list), key=lambda b: order[id(b)])


def block_signature(block, layer_type=None) -> tuple:
    """Blocks of one kind: same class, same parameter shapes, same layer type (sliding / full...)."""
    shapes = tuple((name, tuple(p.shape)) for name, p in block.named_parameters())
    return (type(block).__name__, shapes, layer_type)


def layer_types(config, count: int) -> list:
    types = getattr(config, "layer_types", None)
    if isinstance(types, (list, tuple)) and len(types) == count:
        return list(types)
    return [None] * count


def _linear_dims(module):
    """(in, out) of an nn.Linear or transformers' Conv1D (GPT-2 style); None for anything else."""
    import torch

    if isinstance(module, torch.nn.Linear):
        return module.in_features, module.out_features
    if type(module).__name__ == "Conv1D" and getattr(module, "weight", None) is not None:
        return int(module.weight.shape[0]), int(module.weight.shape[1])
    return None


def block_linears(blocks) -> tuple:
    """((name, in, out, count), ...): the linears inside the blocks by leaf name and shape, summed over
    every block: what LoRA can target, what bitsandbytes quantizes, what autocast copies."""
    found: Counter = Counter()
    for block in blocks:
        for name, module in block.named_modules():
            dims = _linear_dims(module)
            if dims is not None and name:
                found[(name.rsplit(".", 1)[-1], *dims)] += 1
    return tuple(sorted((name, i, o, n) for (name, i, o), n in found.items()))


def tensor_shapes(model) -> tuple:
    """((shape, count), ...) of the unique parameter tensors."""
    seen: set = set()
    shapes: Counter = Counter()
    for p in model.parameters():
        if id(p) not in seen:
            seen.add(id(p))
            shapes[tuple(int(d) for d in p.shape)] += 1
    return tuple(sorted(shapes.items()))


def single_adam_peak(model) -> int:
    """max_i(2*n_i + n_(i-1)) over the unique parameters in the order AdamW visits them."""
    sizes, seen = [], set()
    for p in model.parameters():
        if id(p) not in seen:
            seen.add(id(p))
            sizes.append(p.numel())
    return max(2 * n + (sizes[i - 1] if i else 0) for i, n in enumerate(sizes))


def param_order(model, blocks) -> tuple:
    """((unit, (numel, ...), repeat), ...): the unique parameters in the order model.parameters() gives
    them (the order FSDP1's use_orig_params views reach the optimizer), grouped by the FSDP unit that
    flattens them: "root" (everything outside the blocks: one flat parameter, however many groups) or
    "block" (one flat parameter per block; `repeat` consecutive blocks with the same sizes)."""
    owner = {id(q): i for i, block in enumerate(blocks) for q in block.parameters()}
    groups: list = []
    for q in model.parameters():  # tied parameters once
        unit = owner.get(id(q), "root")
        if groups and groups[-1][0] == unit:
            groups[-1][1].append(int(q.numel()))
        else:
            groups.append((unit, [int(q.numel())]))
    order: list = []
    for unit, sizes in groups:
        name = "root" if unit == "root" else "block"
        if name == "block" and order and order[-1][0] == "block" and order[-1][1] == tuple(sizes):
            order[-1] = ("block", order[-1][1], order[-1][2] + 1)
        else:
            order.append((name, tuple(sizes), 1))
    return tuple(order)


def run_lengths(values: list) -> tuple:
    """((value, run), ...) of consecutive equal values."""
    runs: list = []
    for value in values:
        if runs and runs[-1][0] == value:
            runs[-1][1] += 1
        else:
            runs.append([value, 1])
    return tuple((value, run) for value, run in runs)


def _first_int(config, names, default=0) -> int:
    for name in names:
        try:
            value = getattr(config, name, None)
        except (AttributeError, ValueError, KeyError):  # per-layer attributes (Gemma-4) refuse a global read
            continue
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return default


def _max_dropout(cfg: dict) -> float:
    rates = [float(v) for k, v in cfg.items() if isinstance(v, (int, float)) and not isinstance(v, bool)
             and ("dropout" in k or k.endswith("pdrop")) and 0 < float(v) < 1]
    return max(rates, default=0.0)


def _text_config(config):
    getter = getattr(config, "get_text_config", None)
    try:
        return getter() if callable(getter) else config
    except ValueError:  # several text configs (an encoder and a decoder): the top level names the sizes
        return config


def reduced_depth(kinds: list) -> int:
    """The shortest prefix of layers that holds every block kind, each (where it repeats) at an index
    other than 0: block 0 also claims what every block shares (rotary tables) and is not typical."""
    wanted: dict = {}
    for index, kind in enumerate(kinds):
        if kind not in wanted or wanted[kind] == 0:
            wanted[kind] = index
    return max(wanted.values()) + 1


def depth_overrides(cfg: dict, config, depth: int, total: int) -> dict:
    """Config changes for a copy with `depth` layers: the layer count and every per-layer list."""
    overrides = {}
    text = _text_config(config)
    for key in ("num_hidden_layers", "n_layer", "num_layers", "n_layers"):
        if key in cfg and cfg[key] == total:
            overrides[key] = depth
    if not overrides and getattr(text, "num_hidden_layers", None) == total:
        overrides["num_hidden_layers"] = depth
    for key, value in cfg.items():
        # A list with one entry per layer, or a per-layer pattern string ("M-M*" hybrids); a plain
        # string that happens to have `total` letters ("silu") is not one.
        per_layer = isinstance(value, list) or (isinstance(value, str) and ("pattern" in key or "layer" in key))
        if per_layer and len(value) == total and key != "architectures":
            overrides[key] = value[:depth]
    return overrides


def derive_spec(cfg: dict, name: str, source: str, config_hash: str = "") -> tuple[ModelSpec, dict]:
    """(spec, facts): the spec of the model the config builds, and what the tracer needs to build a
    reduced-depth copy holding every block kind (config overrides, per-kind counts)."""
    with quiet():
        try:
            return _derive(cfg, name, source, config_hash)
        except ShardfitError:
            raise
        except Exception as exc:  # noqa: BLE001 - transformers' refusal of this config, as one line
            raise ShardfitError(f"model '{name}': cannot derive a spec for model_type '{cfg.get('model_type')}' "
                                f"({type(exc).__name__}: {_first_line(exc)})") from None


def _derive(cfg: dict, name: str, source: str, config_hash: str) -> tuple[ModelSpec, dict]:
    model = build_hf_model(cfg, device="meta")
    config = model.config
    text = _text_config(config)
    n_params = unique_params(model)
    if n_params == 0:
        raise ShardfitError(f"model '{name}' has no parameters")
    blocks = find_blocks(model)
    if not blocks:
        raise ShardfitError(f"{type(model).__name__}: no repeated layers found (no nn.ModuleList of blocks): "
                            f"pass a factory 'pkg.module:fn' instead")
    types = layer_types(text, len(blocks))
    kinds = [block_signature(b, t) for b, t in zip(blocks, types)]
    seen: set = set()
    block_total = sum(unique_params(b, seen) for b in blocks)
    kind_list = list(dict.fromkeys(kinds))
    per_kind = [(k[0] + (f"[{k[2]}]" if k[2] else ""), kinds.count(k),
                 unique_params(blocks[kinds.index(k)])) for k in kind_list]
    largest = max(sum(p.numel() for p in m.parameters(recurse=False)) for m in model.modules())
    inputs, outputs = model.get_input_embeddings(), model.get_output_embeddings()
    tie = bool(inputs is not None and outputs is not None and getattr(outputs, "weight", None) is getattr(inputs, "weight", 0))
    heads = _first_int(text, ("num_attention_heads", "n_head", "num_heads"))
    hidden = _first_int(text, ("hidden_size", "n_embd", "d_model", "dim"))
    head_dim = _first_int(text, ("head_dim",), default=hidden // heads if heads and hidden % heads == 0 else 0)
    classes = list(dict.fromkeys(type(b).__name__ for b in blocks))
    is_mlm = type(model).__name__.endswith("ForMaskedLM")
    spec = ModelSpec(
        name=name, family=str(cfg.get("model_type")), source=source, n_params=n_params,
        hidden_size=hidden, num_layers=len(blocks), num_heads=heads,
        num_kv_heads=_first_int(text, ("num_key_value_heads", "num_kv_heads", "multi_query_group_num"), default=heads),
        head_dim=head_dim,
        intermediate_size=_first_int(text, ("intermediate_size", "n_inner", "ffn_dim", "d_ff", "moe_intermediate_size"),
                                     default=4 * hidden),
        vocab_size=_first_int(text, ("vocab_size",)),
        max_position=_first_int(text, ("max_position_embeddings", "n_positions", "max_seq_len", "seq_length")),
        tie_embeddings=tie,
        num_experts=_first_int(text, _EXPERTS), experts_per_token=_first_int(text, _TOP_K),
        shared_experts=_first_int(text, _SHARED),
        mlp="derived", norm="layernorm" if any("LayerNorm" in type(m).__name__ for m in model.modules()) else "rmsnorm",
        dropout=_max_dropout(cfg), causal_lm=not is_mlm,
        block_class=",".join(classes), block_params=max(k[2] for k in per_kind),
        largest_layer_params=largest, non_block_params=n_params - block_total,
        derived=True, model_class=type(model).__name__, config_hash=config_hash,
        block_kinds=tuple(per_kind), linears=block_linears(blocks), tensor_shapes=tensor_shapes(model),
        single_adam_peak=single_adam_peak(model), param_order=param_order(model, blocks),
        tp_plan=tuple((str(path), str(style)) for path, style in (getattr(model, "_tp_plan", None) or {}).items()),
        layer_kinds=run_lengths([kind_list.index(k) for k in kinds]),
        kind_expert_params=tuple(routed_expert_params(blocks[kinds.index(k)], _first_int(text, _EXPERTS))
                                 for k in kind_list),
    )
    depth = reduced_depth(kinds)
    facts = {"depth": len(blocks), "kinds": [kind_list.index(k) for k in kinds]}
    if depth < len(blocks):
        overrides = depth_overrides(cfg, config, depth, len(blocks))
        if overrides and _prefix_holds(cfg, overrides, kinds[:depth]):
            facts = {"depth": depth, "overrides": overrides, "kinds": [kind_list.index(k) for k in kinds[:depth]]}
    return spec, facts


def _prefix_holds(cfg: dict, overrides: dict, expected: list) -> bool:
    """True when the reduced copy really has the full model's first layers, kind for kind."""
    try:
        small = build_hf_model(cfg, device="meta", overrides=overrides)
    except ShardfitError:
        return False
    blocks = find_blocks(small)
    types = layer_types(_text_config(small.config), len(blocks))
    return [block_signature(b, t) for b, t in zip(blocks, types)] == expected
