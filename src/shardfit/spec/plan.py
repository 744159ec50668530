"""The Plan: what is trained, how, and on what. One frozen object flows through every stage.

A Plan is plain data: it round-trips through YAML/JSON (`to_dict` / `plan_from_dict`), and
`validate_plan` rejects contradictory combinations with one line that names the fix.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field, fields, replace

from shardfit.errors import ShardfitError
from shardfit.spec.engine_rules import engine_support_error
from shardfit.spec.fields import build_section
from shardfit.spec.gpus import get_gpu
from shardfit.spec.kernels import DEFAULT_LOSS_CHUNKS, check_kernels
from shardfit.spec.fsdp_units import EMBEDDING_UNITS, embedding_units_error
from shardfit.spec.model_spec import ModelSpec
from shardfit.spec.parallelism import Parallelism, drop_default, validate_parallelism

# single: one device, no wrapper (a plain loop, or HF Trainer / Accelerate on one GPU).
STRATEGY_KINDS = ("single", "ddp", "fsdp", "fsdp2", "zero1", "zero2", "zero3")
DEEPSPEED_KINDS = ("zero1", "zero2", "zero3")
FSDP_SHARDING = ("full_shard", "shard_grad_op", "hybrid_shard", "no_shard")
OFFLOAD_DEVICES = (None, "cpu", "nvme")
PRECISIONS = ("fp32", "fp16", "bf16", "bf16-pure")
OPTIMIZERS = ("adamw", "adamw8bit", "sgd", "lion", "adafactor")
ATTENTION = ("sdpa", "eager")
LORA_BASE_DTYPES = ("bf16", "fp16", "fp32", "int8", "nf4")
BACKWARD_PREFETCH = ("backward_pre", "backward_post", "none")
NAN_POLICIES = ("stop", "skip")


def is_deepspeed_kind(kind: str) -> bool:
    """Whether a strategy kind (or an engine's kind) runs under DeepSpeed: ZeRO-1/2/3."""
    return kind in DEEPSPEED_KINDS


@dataclass(frozen=True, kw_only=True)
class Strategy:
    kind: str = "ddp"
    sharding: str = "full_shard"  # fsdp (FSDP1); fsdp2 reads only hybrid_shard (HSDP)
    reshard_after_forward: bool = True  # fsdp2 only
    offload_optimizer: str | None = None  # zero1/2/3: cpu (nvme: zero3 only)
    offload_params: str | None = None  # zero3: cpu/nvme; fsdp/fsdp2: cpu (moves params, grads, optimizer)
    nvme_path: str | None = None
    # DeepSpeed buffer knobs, in elements, DeepSpeed's own defaults.
    reduce_bucket_size: int = 500_000_000
    allgather_bucket_size: int = 500_000_000
    prefetch_bucket_size: int = 50_000_000
    param_persistence_threshold: int = 100_000
    max_live_parameters: int = 1_000_000_000
    # zero3: a released parameter stays gathered if it is used again within this many elements
    # (DeepSpeed's stage3_max_reuse_distance); at the default, models under ~1B are never
    # re-gathered in backward.
    max_reuse_distance: int = 1_000_000_000
    overlap_comm: bool = True
    # DDP gradient bucket (MiB), torch's default.
    ddp_bucket_cap_mb: float = 25.0
    # DDP gradient_as_bucket_view (torch's default False: the reducer's flat buckets are a second
    # copy of every gradient; True makes .grad views into them).
    ddp_gradient_as_bucket_view: bool = False
    # FSDP: wrap unit class name (None = the model's detected block class) and prefetch.
    wrap_unit: str | None = None
    backward_prefetch: str = "backward_pre"
    # Hybrid sharding: ranks per shard group (None = GPUs per node).
    shard_group_size: int | None = None
    embedding_units: str = "auto"  # fsdp2: the embedding and head as units of their own (spec/fsdp_units.py)

    @property
    def label(self) -> str:
        """Short name used in tables and `--strategies`: ddp, fsdp:full_shard, zero3+offload, ..."""
        text = self.kind
        if self.kind == "fsdp":
            text += f":{self.sharding}"
        if self.kind == "fsdp2" and self.shard_group(0) is not None:
            text += ":hybrid"
        elif self.kind == "fsdp2" and not self.reshard_after_forward:
            text += ":no_reshard"
        if self.offload_params or self.offload_optimizer:
            devices = {d for d in (self.offload_params, self.offload_optimizer) if d}
            text += "+offload" + ("" if devices == {"cpu"} else "-nvme")
            if self.kind == "zero3" and self.offload_optimizer and not self.offload_params:
                text += "-opt"
        return text

    def shard_group(self, gpus_per_node: int) -> int | None:
        """Ranks per shard group under hybrid sharding (FSDP1 hybrid_shard; FSDP2 HSDP, asked for as
        `fsdp2:hybrid` or by a shard group size), None when sharding spans every rank."""
        if self.kind == "fsdp" and self.sharding == "hybrid_shard":
            return self.shard_group_size or gpus_per_node
        if self.kind == "fsdp2" and (self.sharding == "hybrid_shard" or self.shard_group_size):
            return self.shard_group_size or gpus_per_node
        return None

    @property
    def shards_params(self) -> bool:
        return self.kind == "zero3" or self.kind == "fsdp2" or (
            self.kind == "fsdp" and self.sharding in ("full_shard", "shard_grad_op", "hybrid_shard"))

    @property
    def is_deepspeed(self) -> bool:
        return is_deepspeed_kind(self.kind)

    def regathers_in_backward(self, n_params: int) -> bool:
        """Whether sharded parameters are all-gathered again in backward: FSDP1 FULL/HYBRID_SHARD and
        FSDP2 with reshard_after_forward free them after forward; ZeRO-3 keeps a released parameter
        gathered when it is reused within max_reuse_distance elements, which at DeepSpeed's default
        covers every model under ~1B parameters."""
        if self.kind == "zero3":
            return self.max_reuse_distance < n_params
        if self.kind == "fsdp":
            return self.sharding in ("full_shard", "hybrid_shard")
        return self.kind == "fsdp2" and self.reshard_after_forward


def parse_strategy(text: str) -> Strategy:
    """Parse `single`, `ddp`, `fsdp:shard_grad_op`, `fsdp2:no_reshard`, `fsdp2:hybrid`, `zero3+offload`, `zero3+offload-nvme`,
    `zero3+offload-opt`, `zero2+offload`, `fsdp+offload`."""
    raw = str(text).strip().lower()
    base, _, offload = raw.partition("+")
    kind, _, option = base.partition(":")
    kind = {"zero-1": "zero1", "zero-2": "zero2", "zero-3": "zero3", "fsdp1": "fsdp"}.get(kind, kind)
    if kind not in STRATEGY_KINDS:
        raise ShardfitError(f"unknown strategy '{text}': use one of single, ddp, fsdp[:{'|'.join(FSDP_SHARDING)}], "
                            "fsdp2[:no_reshard|hybrid], zero1, zero2, zero3, optionally with +offload")
    if kind == "single" and (option or offload):
        raise ShardfitError(f"strategy '{text}': single (one device, no wrapper) has no options and no offload: "
                            "use single, or zero2+offload / zero3+offload / fsdp2+offload to offload on one GPU")
    values: dict = {"kind": kind}
    if option:
        if kind == "fsdp" and option in FSDP_SHARDING:
            values["sharding"] = option
        elif kind == "fsdp2" and option in ("no_reshard", "reshard"):
            values["reshard_after_forward"] = option == "reshard"
        elif kind == "fsdp2" and option in ("hybrid", "hybrid_shard"):
            values["sharding"] = "hybrid_shard"  # HSDP: shard inside a group (GPUs per node by default)
        else:
            raise ShardfitError(f"strategy '{text}': '{option}' is not an option of {kind}")
    if offload:
        device = "nvme" if "nvme" in offload else "cpu"
        if offload not in ("offload", "offload-nvme", "offload-opt", "offload-nvme-opt"):
            raise ShardfitError(f"strategy '{text}': the suffix must be +offload, +offload-opt or +offload-nvme")
        if kind in ("zero1", "zero2") or offload.endswith("-opt"):
            values["offload_optimizer"] = device
        elif kind == "zero3":
            values["offload_optimizer"] = device
            values["offload_params"] = device
        else:
            values["offload_params"] = device
    # NOTE: an NVMe strategy gets no default path on purpose: validation asks for a real mount.
    return Strategy(**values)


@dataclass(frozen=True, kw_only=True)
class LoRA:
    rank: int = 16
    alpha: int = 32
    dropout: float = 0.0
    target_modules: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj")
    base_dtype: str = "bf16"  # frozen base weights: bf16/fp16/fp32, or int8 / nf4 (QLoRA)


@dataclass(frozen=True, kw_only=True)
class Training:
    micro_batch: int = 1
    seq_len: int = 2048
    grad_accum: int = 1
    precision: str = "bf16"
    loss_scaling: bool | None = None  # fp16 only; None = on
    optimizer: str = "adamw"
    # "none", "selective" (per-op: matmul and attention outputs kept), "full" (every block), or
    # "every-N" (every N-th block: per-layer selective checkpointing)
    activation_checkpointing: str = "none"
    attention: str = "sdpa"
    lora: LoRA | None = None
    # spec/kernels.py: standard | chunked head+loss (loss_chunks row chunks); AdamW auto|foreach|single|fused
    loss: str = "standard"
    loss_chunks: int = DEFAULT_LOSS_CHUNKS
    optimizer_impl: str = "auto"


@dataclass(frozen=True, kw_only=True)
class Schedule:
    """The loop's knobs: used by `train`, ignored by the estimator."""
    steps: int = 50
    lr: float = 3e-4
    warmup_steps: int = 5
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    seed: int = 1234
    log_every: int = 10
    eval_every: int = 0
    save_every: int = 0
    keep_checkpoints: int = 2
    nan_policy: str = "stop"  # NAN_POLICIES
    save_mode: str = "sync"  # sync | async (DCP async_save in a writer process; not DeepSpeed)
    on_save_error: str = "stop"  # stop | continue: what a save that fails (disk full, I/O error) does to the run


@dataclass(frozen=True, kw_only=True)
class Cluster:
    nodes: int = 1
    gpus_per_node: int = 8
    gpu: str = "H100-80GB"
    host_memory_gib: float | None = None  # per node; None = not checked

    @property
    def world_size(self) -> int:
        return self.nodes * self.gpus_per_node


@dataclass(frozen=True, kw_only=True)
class Data:
    path: str | None = None  # None = the corpus shipped in the package
    tokenizer: str | None = None  # None = byte-level tokenizer


@dataclass(frozen=True, kw_only=True)
class Plan:
    model: ModelSpec
    strategy: Strategy = field(default_factory=Strategy)
    training: Training = field(default_factory=Training)
    cluster: Cluster = field(default_factory=Cluster)
    schedule: Schedule = field(default_factory=Schedule)
    data: Data = field(default_factory=Data)
    parallelism: Parallelism = field(default_factory=Parallelism)  # spec/parallelism.py

    @property
    def global_batch(self) -> int:
        t = self.training  # one batch per data-parallel rank: a replica's tp x cp x pp ranks share it
        return t.micro_batch * t.grad_accum * self.cluster.world_size // self.parallelism.model_parallel

    def with_changes(self, **sections) -> "Plan":
        """Replace fields inside sections: plan.with_changes(training={"micro_batch": 2})."""
        updated = {}
        for name, changes in sections.items():
            current = getattr(self, name)
            updated[name] = replace(current, **changes) if isinstance(changes, dict) else changes
        return replace(self, **updated)

    def to_dict(self) -> dict:
        return drop_default(dataclasses.asdict(self))  # no section when default: old files unchanged


# Per-op selective activation checkpointing (torchtitan's "selective op" mode): every block is
# wrapped, matmul and attention outputs are kept (every other matmul recomputed), the rest recomputed.
SELECTIVE_AC = ("selective", "selective-op", "sac")


def parse_activation_checkpointing(value: str) -> int:
    """Return N where every N-th block is checkpointed; 0 means none. `selective` wraps every block
    (N = 1) under the per-op policy (is_selective_ac); every-N is per-layer selective checkpointing."""
    text = str(value).strip().lower()
    if text in ("none", "off", "false", "0"):
        return 0
    if text in ("full", "on", "true", "all", "1", "every-1") or text in SELECTIVE_AC:
        return 1
    if text.startswith("every-"):
        text = text[len("every-"):]
    try:
        every = int(text)
    except ValueError:
        raise ShardfitError(f"activation checkpointing '{value}': use none, selective, full, or every-N (e.g. every-2)") from None
    if every < 1:
        raise ShardfitError(f"activation checkpointing '{value}': N in every-N must be at least 1")
    return every


def is_selective_ac(value: str) -> bool:
    """True for per-op selective checkpointing (matmul and attention outputs kept)."""
    return str(value).strip().lower() in SELECTIVE_AC


def plan_from_dict(data: dict, resolve_model=None) -> Plan:
    """Build and validate a Plan. `model` may be a mapping of ModelSpec fields or a reference
    (preset name, config path, factory) that `resolve_model` turns into a ModelSpec."""
    if not isinstance(data, dict):
        raise ShardfitError(f"a plan must be a mapping with a 'model' key, got {type(data).__name__}")
    known = {f.name for f in fields(Plan)}
    unknown = sorted(set(data) - known)
    if unknown:
        raise ShardfitError(f"unknown plan section '{unknown[0]}': sections are {', '.join(sorted(known))}")
    if "model" not in data:
        raise ShardfitError("the plan has no 'model': give a preset name (see `shardfit models`) or a config path")
    model = data["model"]
    if isinstance(model, ModelSpec):
        spec = model
    elif isinstance(model, dict):
        spec = ModelSpec.from_dict(model)
    elif isinstance(model, str) and resolve_model is not None:
        spec = resolve_model(model)
    else:
        raise ShardfitError("'model' must be a preset name, a config path, or a mapping of model fields")
    training_data = data.get("training")
    if isinstance(training_data, dict) and training_data.get("lora") is not None and not isinstance(
            training_data["lora"], (dict, LoRA)):
        raise ShardfitError(f"'training.lora' must be a mapping (rank, alpha, target_modules, ...), "
                            f"got {training_data['lora']!r}")
    if isinstance(training_data, dict) and isinstance(training_data.get("lora"), dict):
        training_data = {**training_data, "lora": build_section(LoRA, training_data["lora"], "training.lora")}
    plan = Plan(
        model=spec,
        strategy=build_section(Strategy, data.get("strategy"), "strategy"),
        training=build_section(Training, training_data, "training"),
        cluster=build_section(Cluster, data.get("cluster"), "cluster"),
        schedule=build_section(Schedule, data.get("schedule"), "schedule"),
        data=build_section(Data, data.get("data"), "data"),
        parallelism=build_section(Parallelism, data.get("parallelism"), "parallelism"),
    )
    validate_plan(plan)
    return plan


def validate_plan(plan: Plan) -> list[str]:
    """Raise ShardfitError on an invalid combination; return warnings for dubious ones."""
    s, t, c = plan.strategy, plan.training, plan.cluster
    warnings: list[str] = []

    def bad(message: str):
        raise ShardfitError(message)

    def one_of(value, choices, where):
        if value not in choices:
            shown = ", ".join(str(choice) for choice in choices if choice is not None)
            bad(f"{where} '{value}' is not known: use one of {shown}")

    one_of(s.kind, STRATEGY_KINDS, "strategy.kind")
    one_of(s.sharding, FSDP_SHARDING, "strategy.sharding")
    one_of(s.offload_optimizer, OFFLOAD_DEVICES, "strategy.offload_optimizer")
    one_of(s.offload_params, OFFLOAD_DEVICES, "strategy.offload_params")
    one_of(s.backward_prefetch, BACKWARD_PREFETCH, "strategy.backward_prefetch")
    one_of(s.embedding_units, EMBEDDING_UNITS, "strategy.embedding_units")
    if error := embedding_units_error(plan):
        bad(error)
    one_of(t.precision, PRECISIONS, "training.precision")
    one_of(t.optimizer, OPTIMIZERS, "training.optimizer")
    one_of(t.attention, ATTENTION, "training.attention")
    parse_activation_checkpointing(t.activation_checkpointing)
    check_kernels(plan)
    warnings += validate_parallelism(plan)
    gpu = get_gpu(c.gpu)
    for name, value in (("training.micro_batch", t.micro_batch), ("training.seq_len", t.seq_len),
                        ("training.grad_accum", t.grad_accum), ("cluster.nodes", c.nodes),
                        ("cluster.gpus_per_node", c.gpus_per_node)):
        if value < 1:
            bad(f"{name} must be at least 1, got {value}")
    for name, value in (("strategy.reduce_bucket_size", s.reduce_bucket_size),
                        ("strategy.allgather_bucket_size", s.allgather_bucket_size),
                        ("strategy.prefetch_bucket_size", s.prefetch_bucket_size),
                        ("strategy.max_live_parameters", s.max_live_parameters),
                        ("strategy.max_reuse_distance", s.max_reuse_distance),
                        ("strategy.param_persistence_threshold", s.param_persistence_threshold)):
        if value < 0:
            bad(f"{name} must not be negative, got {value}")
    if s.ddp_bucket_cap_mb <= 0:
        bad(f"strategy.ddp_bucket_cap_mb must be positive, got {s.ddp_bucket_cap_mb}")
    if t.micro_batch * t.seq_len > 2**40 or plan.model.n_params > 10**15 or c.world_size > 10**6:
        bad("sizes are beyond any real run (micro_batch×seq_len > 2^40, params > 1e15 or > 1e6 GPUs): check the units")

    # Offload, and the optimizer / precision combinations an engine rejects (spec/engine_rules.py).
    if error := engine_support_error(plan):
        bad(error)

    # Hybrid sharding needs whole shard groups.
    if s.kind in ("fsdp", "fsdp2") and (s.sharding == "hybrid_shard" or s.shard_group_size):
        group = s.shard_group_size or c.gpus_per_node
        if group < 1 or c.world_size % group:
            bad(f"hybrid shard group of {group} ranks does not divide the world size {c.world_size} "
                f"({c.nodes} nodes x {c.gpus_per_node} GPUs): set strategy.shard_group_size (--shard-group-size) to a divisor")
        if s.kind == "fsdp" and group == 1 and c.world_size > 1:
            bad("FSDP1 hybrid shard with a shard group of 1 silently falls back to NO_SHARD and never "
                "all-reduces across replicas: use fsdp2, or a shard group of 2 or more")
        if group == c.world_size and s.sharding == "hybrid_shard":
            warnings.append("hybrid shard over a single shard group is the same as full_shard")

    # Precision and hardware.
    if t.precision in ("bf16", "bf16-pure") and not gpu.supports_bf16:
        bad(f"{gpu.name} has no bf16 support: use precision fp16 (with loss scaling) or fp32")
    if t.precision == "fp16" and t.loss_scaling is False:
        warnings.append("fp16 without loss scaling: small gradients underflow to zero and losses turn NaN; "
                        "enable loss_scaling or use bf16")
    if t.precision != "fp16" and t.loss_scaling:
        warnings.append(f"loss scaling only matters for fp16; it is ignored with {t.precision}")

    # LoRA.
    if t.lora is not None:
        one_of(t.lora.base_dtype, LORA_BASE_DTYPES, "training.lora.base_dtype")
        if t.lora.rank < 1:
            bad(f"training.lora.rank must be at least 1, got {t.lora.rank}")
        if not t.lora.target_modules:
            bad("training.lora.target_modules is empty: name the projections to adapt, e.g. q_proj,v_proj")
    if plan.model.family == "params" and t.lora is not None:
        bad("LoRA needs the model's shapes: give a preset or config instead of --params")
    if plan.schedule.nan_policy not in NAN_POLICIES:
        bad(f"schedule.nan_policy '{plan.schedule.nan_policy}' is not known: use stop or skip")
    if plan.schedule.nan_policy == "skip" and s.is_deepspeed:
        bad("nan_policy skip is not supported with DeepSpeed (it steps inside backward): use stop; "
            "fp16 overflow steps are skipped by DeepSpeed's loss scaler anyway")
    return warnings
