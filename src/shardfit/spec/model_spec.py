"""ModelSpec: the shape of a model, as much as memory and FLOP estimates need. No torch here."""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields

from shardfit.errors import ShardfitError


@dataclass(frozen=True, kw_only=True)
class ModelSpec:
    name: str
    # llama | mistral | mixtral | qwen2 | gemma2 | gpt2 | bert | module (nn.Module factory) | params
    family: str
    # where it came from: a preset name, a local config path, "pkg.module:fn", or "params"
    source: str
    n_params: int
    hidden_size: int = 0
    num_layers: int = 0
    num_heads: int = 0
    num_kv_heads: int = 0
    head_dim: int = 0
    intermediate_size: int = 0
    vocab_size: int = 0
    max_position: int = 0
    tie_embeddings: bool = False
    num_experts: int = 0  # 0 = dense MLP
    experts_per_token: int = 0
    mlp: str = "swiglu"  # swiglu | gelu
    norm: str = "rmsnorm"  # rmsnorm | layernorm
    dropout: float = 0.0
    causal_lm: bool = True
    # The repeated block (the natural FSDP / activation-checkpointing unit) and its size.
    block_class: str = ""
    block_params: int = 0
    # Largest single module's own parameters (DeepSpeed's `largest_layer`: usually the embedding).
    largest_layer_params: int = 0
    # Parameters outside the repeated blocks (embeddings, final norm, head): FSDP's root unit.
    non_block_params: int = 0
    shared_experts: int = 0  # MoE experts every token passes through (DeepSeek, Qwen-MoE)
    # Derived from transformers' own code (spec/derive.py) rather than hand-written rules: the
    # activation coefficients then come from traced forwards (estimate/derived.py), cached by
    # config_hash (spec/spec_cache.py).
    derived: bool = False
    model_class: str = ""  # the transformers class trained (Qwen3ForCausalLM, ...)
    config_hash: str = ""
    # ((kind, count, params), ...): each distinct block (dense / MoE, sliding / full, attention /
    # Mamba layers) with how many the model has and its parameters.
    block_kinds: tuple = ()
    # ((leaf name, in, out, count over all blocks), ...): the block linears, for derived specs.
    linears: tuple = ()
    # ((shape, count), ...): every unique parameter tensor's shape, for derived specs.
    tensor_shapes: tuple = ()
    # Single-tensor AdamW's step scratch in elements: max over parameters in registration order of
    # 2*numel + the previous one's (its sqrt/div temporaries next to the previous `denom`); derived
    # specs only (0: use the hand-written largest-layer rule).
    single_adam_peak: int = 0
    # ((unit, (numel, ...), repeat), ...): every unique parameter in registration order, grouped by the
    # FSDP unit that flattens it ("root" or "block"; `repeat` equal blocks in a row), for FSDP1's flat
    # shards (estimate/flat_shards.py); derived specs only.
    param_order: tuple = ()
    # ((module path pattern, transformers TP style), ...): the model's own tensor-parallel plan
    # (`_tp_plan`: the config's base_model_tp_plan under the base-model prefix, the head's entry);
    # derived specs only. What a tp rank holds and runs (estimate/derived_parallel.py).
    tp_plan: tuple = ()
    # ((block kind index, run), ...): the kind of every layer in order, run-length encoded (which kinds
    # a pipeline stage holds); derived specs only.
    layer_kinds: tuple = ()
    # (params, ...): per block kind, the routed experts' parameters in one block (tensors under an
    # `experts` module with num_experts rows: what expert parallel splits); derived specs only.
    kind_expert_params: tuple = ()

    @property
    def largest_unit_params(self) -> int:
        """The largest FSDP unit when each block is wrapped and the root holds the rest."""
        return max(self.block_params, self.non_block_params)

    @property
    def has_shape(self) -> bool:
        """False for a states-only spec (`--params`): activations can't be derived."""
        return self.num_layers > 0 and self.hidden_size > 0

    def to_dict(self) -> dict:
        return asdict(self)

    def __hash__(self) -> int:
        # NOTE: a spec is the key of every per-model lru_cache the estimator keeps (fit looks them up
        # tens of thousands of times a second): the generated dataclass hash would re-hash every field,
        # a derived spec's shape tuples too, on each look-up. Fields never change, so hash them once.
        cached = self.__dict__.get("_hash")
        if cached is None:
            cached = hash(tuple(getattr(self, f.name) for f in fields(self)))
            object.__setattr__(self, "_hash", cached)
        return cached

    def __getstate__(self) -> dict:
        # str hashes differ between processes: a pickled spec must not carry this process's hash.
        return {name: value for name, value in self.__dict__.items() if name != "_hash"}

    def __post_init__(self):
        # NOTE: YAML/JSON give lists; a frozen spec is a cache key, so nested sequences become tuples.
        for name in ("block_kinds", "linears", "tensor_shapes", "param_order", "tp_plan", "layer_kinds", "kind_expert_params"):
            object.__setattr__(self, name, _tuples(getattr(self, name)))

    @classmethod
    def from_dict(cls, data: dict) -> "ModelSpec":
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ShardfitError(f"unknown model field(s) {', '.join(unknown)}: known fields are {', '.join(sorted(known))}")
        kinds = {"int": int, "float": (int, float), "bool": bool, "str": str}
        for f in fields(cls):
            if f.name not in data:
                continue
            value, kind = data[f.name], str(f.type)
            if kind not in kinds:
                continue
            bad = (not isinstance(value, kinds[kind]) or (kind != "bool" and isinstance(value, bool))
                   or (kind in ("int", "float") and not (math.isfinite(value) and value >= 0)))
            if bad:
                what = {"int": "a whole number >= 0", "float": "a number >= 0", "bool": "true or false", "str": "text"}[kind]
                raise ShardfitError(f"model field '{f.name}' must be {what}, got {value!r}")
        try:
            return cls(**data)
        except TypeError as exc:
            raise ShardfitError(f"model spec is incomplete: {exc}") from None


def _tuples(value):
    if isinstance(value, (list, tuple)):
        return tuple(_tuples(v) for v in value)
    return value


def params_only_spec(n_params: float, largest_layer: float | None = None) -> ModelSpec:
    """A states-only model (`shardfit plan --params 7.5e9`): no activations, no shapes."""
    if not n_params or not math.isfinite(n_params) or n_params <= 0:
        raise ShardfitError(f"--params must be a positive number of parameters, got {n_params}")
    if largest_layer is not None and not math.isfinite(largest_layer):
        raise ShardfitError(f"--largest-layer must be a finite number of parameters, got {largest_layer}")
    count = int(n_params)
    largest = int(largest_layer) if largest_layer else 0
    if largest < 0 or largest > count:
        raise ShardfitError(f"--largest-layer must be between 0 and --params ({count}), got {largest}")
    return ModelSpec(name=f"{count / 1e9:.3g}B-params", family="params", source="params", n_params=count,
                     largest_layer_params=largest, block_params=largest, non_block_params=largest)
