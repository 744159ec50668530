"""Read existing configurations into one engine-neutral `Setup` the rules look at.

Readers: DeepSpeed JSON, Accelerate YAML, HF TrainingArguments JSON, HF model config.json, a shardfit
Plan (YAML/JSON), and Python training scripts (kept as source text for the source rules). Several
files describe one run (accelerate.yaml + ds_config.json + train.py): their facts are merged.
"""
from __future__ import annotations

from dataclasses import dataclass, fields, replace
from pathlib import Path

from shardfit.errors import ShardfitError
from shardfit.spec.deepspeed_config import BUFFER_KEYS
from shardfit.spec.planfile import DuplicateKey, json_load_unique, yaml_load_unique
from shardfit.spec.plan import Strategy, is_deepspeed_kind


@dataclass(frozen=True, kw_only=True)
class Setup:
    """What the configs say. None = not stated (the rules then stay quiet rather than guess)."""
    engine: str | None = None  # deepspeed | fsdp | fsdp2 | ddp | single
    zero_stage: int | None = None
    sharding: str | None = None  # FSDP: full_shard | shard_grad_op | hybrid_shard | no_shard
    auto_wrap: bool | None = None
    precision: str | None = None  # bf16 | fp16 | fp32
    loss_scaling: bool | None = None
    activation_checkpointing: bool | None = None
    use_cache: bool | None = None
    micro_batch: int | None = None
    grad_accum: int | None = None
    global_batch: int | None = None
    world_size: int | None = None
    nodes: int | None = None
    shard_group_size: int | None = None
    seq_len: int | None = None
    buckets: tuple[tuple[str, float], ...] = ()  # DeepSpeed buffer knobs in elements
    offload_optimizer: str | None = None
    offload_params: str | None = None
    full_state_dict: bool | None = None
    optimizer: str | None = None  # shardfit's optimizer name (adamw, adamw8bit, ...) when a config names one
    optimizer_impl: str | None = None  # fused | foreach | single, when the config's optimizer says
    # Facts a config leaves to "auto" (the HF Trainer fills them in at launch): resolved from doctor's
    # --precision / --micro-batch flags, or assumed and said so.
    auto: tuple[str, ...] = ()
    model_ref: object = None  # a Plan's model (preset name or mapping)
    gpu: str | None = None  # a Plan's cluster.gpu
    sources: tuple[tuple[str, str], ...] = ()  # (path, Python source)
    where: tuple[tuple[str, str], ...] = ()  # (fact, file it came from)

    def origin(self, fact: str) -> str:
        return next((path for name, path in self.where if name == fact), "")


def _number(value):
    """DeepSpeed/HF numbers: ints, floats like 5e8, or "auto" (filled in at run time: unknown here)."""
    if isinstance(value, bool) or value is None:
        return None
    if isinstance(value, (int, float)):
        return value
    try:
        return float(value)
    except (TypeError, ValueError):
        return None


def _int(value):
    number = _number(value)
    return int(number) if number is not None else None


def _device(value) -> str | None:
    text = str(value or "none").lower()
    return None if text in ("none", "false", "") else text


def _is_auto(value) -> bool:
    return isinstance(value, str) and value.strip().lower() == "auto"


# DeepSpeed optimizer.type / HF TrainingArguments.optim -> shardfit's optimizer (None: not one it sizes).
_DS_OPTIMIZERS = {"adam": "adamw", "adamw": "adamw", "fusedadam": "adamw", "cpuadam": "adamw", "lion": "lion",
                  "sgd": "sgd"}
_HF_OPTIMIZERS = {"adamw_torch": ("adamw", None), "adamw_torch_fused": ("adamw", "fused"), "adamw_hf": ("adamw", None),
                  "adamw_apex_fused": ("adamw", "fused"), "adamw_bnb_8bit": ("adamw8bit", None),
                  "adamw_8bit": ("adamw8bit", None), "paged_adamw_8bit": ("adamw8bit", None),
                  "adafactor": ("adafactor", None), "sgd": ("sgd", None), "lion_32bit": ("lion", None),
                  "lion_8bit": ("lion", None), "paged_lion_32bit": ("lion", None)}


def from_deepspeed(d: dict) -> dict:
    zero = d.get("zero_optimization") or {}
    facts: dict = {"engine": "deepspeed", "zero_stage": _int(zero.get("stage", 0)),
                   "micro_batch": _int(d.get("train_micro_batch_size_per_gpu")),
                   "grad_accum": _int(d.get("gradient_accumulation_steps")),
                   "global_batch": _int(d.get("train_batch_size"))}
    auto = [fact for fact, key in (("micro_batch", "train_micro_batch_size_per_gpu"),
                                   ("grad_accum", "gradient_accumulation_steps"), ("global_batch", "train_batch_size"))
            if _is_auto(d.get(key))]
    bf16, fp16 = d.get("bf16") or {}, d.get("fp16") or {}
    facts["auto"] = tuple(auto)
    if _is_auto(bf16.get("enabled")) or _is_auto(fp16.get("enabled")):
        facts["auto"] += ("precision",)  # HF's ds_config templates: the Trainer's --bf16/--fp16 decide
    elif str(bf16.get("enabled", False)).lower() == "true":
        facts["precision"] = "bf16"
    elif str(fp16.get("enabled", False)).lower() == "true":
        facts["precision"] = "fp16"
        scale = _number(fp16.get("loss_scale", 0))
        # 0 = dynamic scaling; a fixed scale of 1 multiplies by nothing: no scaling at all.
        facts["loss_scaling"] = scale is None or scale != 1
    else:
        facts["precision"] = "fp32"
    buckets = []
    for _, key in BUFFER_KEYS:
        value = _number(zero.get(key))
        if value is not None:
            buckets.append((key, float(value)))
    facts["buckets"] = tuple(buckets)
    optimizer = str((d.get("optimizer") or {}).get("type", "")).lower()
    facts["optimizer"] = _DS_OPTIMIZERS.get(optimizer)
    facts["offload_optimizer"] = _device((zero.get("offload_optimizer") or {}).get("device"))
    facts["offload_params"] = _device((zero.get("offload_param") or {}).get("device"))
    if zero.get("stage3_gather_16bit_weights_on_model_save") or zero.get("gather_16bit_weights_on_model_save"):
        facts["full_state_dict"] = True
    return facts


# Calls that turn activation checkpointing on from a training script.
_AC_CALLS = ("gradient_checkpointing_enable", "activation_checkpointing_enable", "apply_activation_checkpointing",
             "checkpoint_wrapper", "torch.utils.checkpoint")

_FSDP_STRATEGIES = {"1": "full_shard", "2": "shard_grad_op", "3": "no_shard", "4": "hybrid_shard",
                    "full_shard": "full_shard", "shard_grad_op": "shard_grad_op", "no_shard": "no_shard",
                    "hybrid_shard": "hybrid_shard", "_hybrid_shard_zero2": "hybrid_shard"}


def from_accelerate(d: dict, path: Path) -> dict:
    kind = str(d.get("distributed_type", "")).upper()
    facts: dict = {"world_size": _int(d.get("num_processes")), "nodes": _int(d.get("num_machines")),
                   "precision": {"bf16": "bf16", "fp16": "fp16", "no": "fp32"}.get(str(d.get("mixed_precision")).lower())}
    if facts["precision"] == "fp16":
        facts["loss_scaling"] = True  # accelerate adds a GradScaler for fp16
    if kind == "DEEPSPEED":
        ds = d.get("deepspeed_config") or {}
        if ds.get("deepspeed_config_file"):
            file = Path(ds["deepspeed_config_file"])
            file = file if file.is_absolute() else path.parent / file
            facts.update({k: v for k, v in from_deepspeed(_load(file)).items() if v is not None})
        facts.update(engine="deepspeed")
        for key, fact in (("zero_stage", "zero_stage"), ("gradient_accumulation_steps", "grad_accum")):
            if ds.get(key) is not None:
                facts[fact] = _int(ds[key])
        for key, fact in (("offload_optimizer_device", "offload_optimizer"), ("offload_param_device", "offload_params")):
            if key in ds:
                facts[fact] = _device(ds[key])
        if ds.get("zero3_save_16bit_model"):
            facts["full_state_dict"] = True
    elif kind == "FSDP":
        f = d.get("fsdp_config") or {}
        version = _int(f.get("fsdp_version", 1))
        facts["engine"] = "fsdp2" if version == 2 else "fsdp"
        policy = str(f.get("fsdp_auto_wrap_policy") or "NO_WRAP").upper()
        facts["auto_wrap"] = policy not in ("NO_WRAP", "NONE")
        if version == 2:
            facts["sharding"] = "full_shard" if str(f.get("fsdp_reshard_after_forward", True)).lower() == "true" else "shard_grad_op"
        else:
            raw = f.get("fsdp_sharding_strategy", f.get("fsdp_reshard_after_forward", "FULL_SHARD"))
            facts["sharding"] = _FSDP_STRATEGIES.get(str(raw).lower(), "full_shard")
        facts["offload_params"] = "cpu" if str(f.get("fsdp_offload_params", False)).lower() == "true" else None
        facts["activation_checkpointing"] = str(f.get("fsdp_activation_checkpointing", False)).lower() == "true"
        facts["full_state_dict"] = str(f.get("fsdp_state_dict_type", "")).upper() == "FULL_STATE_DICT"
        par = d.get("parallelism_config") or {}
        if _int(par.get("parallelism_config_dp_replicate_size")) and _int(par.get("parallelism_config_dp_shard_size")):
            facts["shard_group_size"] = _int(par["parallelism_config_dp_shard_size"])
    elif kind == "NO" and (facts["world_size"] or 1) == 1:
        facts["engine"] = "single"  # one process: accelerate wraps nothing
    elif kind in ("MULTI_GPU", "NO"):
        facts["engine"] = "ddp"
    if facts.get("engine") == "fsdp" and facts.get("sharding") == "hybrid_shard" and facts["world_size"] and facts["nodes"]:
        facts["shard_group_size"] = facts["world_size"] // max(facts["nodes"], 1)
    return facts


def from_hf_args(d: dict, base: Path | None = None) -> dict:
    """base: the folder of the arguments file (a relative `deepspeed` path is found there too)."""
    facts: dict = {"micro_batch": _int(d.get("per_device_train_batch_size")),
                   "grad_accum": _int(d.get("gradient_accumulation_steps")),
                   "precision": "bf16" if d.get("bf16") else "fp16" if d.get("fp16") else "fp32"}
    if facts["precision"] == "fp16":
        facts["loss_scaling"] = True  # Trainer scales fp16 losses itself
    optim = str(d.get("optim") or "").lower().rpartition(".")[2]  # "OptimizerNames.ADAMW_TORCH" from repr
    facts["optimizer"], facts["optimizer_impl"] = _HF_OPTIMIZERS.get(optim, (None, None))
    ac = d.get("activation_checkpointing", d.get("gradient_checkpointing"))
    facts["activation_checkpointing"] = bool(ac)
    fsdp, config = d.get("fsdp"), dict(d.get("fsdp_config") or {})
    config = {k[5:] if k.startswith("fsdp_") else k: v for k, v in config.items()}
    if d.get("deepspeed"):
        ds = d["deepspeed"]
        if not isinstance(ds, dict):
            file = Path(ds)
            if not file.is_absolute() and not file.exists() and base is not None and (base / file).exists():
                file = base / file
            ds = _load(file)
        facts.update({k: v for k, v in from_deepspeed(ds).items() if v is not None and k != "precision"})
    elif fsdp:
        items = fsdp.split() if isinstance(fsdp, str) else list(fsdp) if isinstance(fsdp, list) else []
        version = _int(config.get("version", 2))
        facts["engine"] = "fsdp2" if version == 2 else "fsdp"
        sharding = next((i for i in items if i in _FSDP_STRATEGIES), None)
        reshard = config.get("reshard_after_forward")
        if sharding is None and reshard is not None:
            sharding = (_FSDP_STRATEGIES.get(str(reshard).lower())
                        or ("full_shard" if str(reshard).lower() == "true" else "shard_grad_op"))
        facts["sharding"] = sharding or "full_shard"
        facts["auto_wrap"] = str(config.get("auto_wrap_policy", "TRANSFORMER_BASED_WRAP")).upper() != "NO_WRAP"
        if "offload" in items or config.get("cpu_offload"):
            facts["offload_params"] = "cpu"
        if config.get("activation_checkpointing"):
            facts["activation_checkpointing"] = True
        # Trainer's default is FULL_STATE_DICT: the whole model gathered for every save.
        facts["full_state_dict"] = str(config.get("state_dict_type", "FULL_STATE_DICT")).upper() == "FULL_STATE_DICT"
    return facts


def from_plan(d: dict) -> dict:
    s, t, c = d.get("strategy") or {}, d.get("training") or {}, d.get("cluster") or {}
    kind = str(s.get("kind", "ddp")).lower()
    facts: dict = {"engine": "deepspeed" if is_deepspeed_kind(kind) else kind, "model_ref": d.get("model"),
                   "micro_batch": _int(t.get("micro_batch", 1)), "grad_accum": _int(t.get("grad_accum", 1)),
                   "seq_len": _int(t.get("seq_len", 2048)), "precision": str(t.get("precision", "bf16")).replace("-pure", ""),
                   "activation_checkpointing": str(t.get("activation_checkpointing", "none")).lower() not in ("none", "off", "0"),
                   "offload_optimizer": _device(s.get("offload_optimizer")), "offload_params": _device(s.get("offload_params"))}
    if facts["precision"] == "fp16":
        facts["loss_scaling"] = t.get("loss_scaling") is not False
    nodes, gpus = _int(c.get("nodes", 1)), _int(c.get("gpus_per_node", 8))
    facts.update(nodes=nodes, world_size=nodes * gpus if nodes and gpus else None, gpu=c.get("gpu"))
    if is_deepspeed_kind(kind):
        facts["zero_stage"] = int(kind[-1])
        facts["buckets"] = tuple((key, float(s[field])) for field, key in BUFFER_KEYS if field in s)
    if kind in ("fsdp", "fsdp2"):
        facts["auto_wrap"] = True  # shardfit always wraps each block
        facts["sharding"] = str(s.get("sharding", "full_shard")) if kind == "fsdp" else (
            "full_shard" if s.get("reshard_after_forward", True) else "shard_grad_op")
        if s.get("shard_group_size") or facts["sharding"] == "hybrid_shard":
            facts["shard_group_size"] = _int(s.get("shard_group_size")) or gpus
    return facts


def _load(path: Path) -> dict:
    """A config file as a mapping: YAML by extension (.yaml/.yml), JSON otherwise; errors in one line.
    A key written twice is an error too: DeepSpeed, Accelerate and transformers would silently take
    the last one, so the config would not say what its author reads in it."""
    import yaml

    try:
        text = path.read_text()
    except OSError as exc:
        raise ShardfitError(f"cannot read {path}: {exc.strerror}") from None
    kind = "YAML" if path.suffix in (".yaml", ".yml") else "JSON"
    try:
        data = yaml_load_unique(text) if kind == "YAML" else json_load_unique(text)
    except DuplicateKey as exc:
        raise ShardfitError(exc.message(path)) from None
    except RecursionError:
        raise ShardfitError(f"{path} is not valid {kind}: nested too deeply") from None
    except (ValueError, yaml.YAMLError) as exc:
        raise ShardfitError(f"{path} is not valid {kind}: {str(exc).splitlines()[0]}") from None
    if not isinstance(data, dict):
        raise ShardfitError(f"{path} must hold a mapping (a {kind} object), got {type(data).__name__}")
    return data


def read_file(path: str | Path) -> tuple[str, dict]:
    """(kind, facts) for one file; kind names the reader that understood it."""
    path = Path(path)
    if not path.is_file():
        raise ShardfitError(f"{path}: no such file (give DeepSpeed JSON, Accelerate YAML, TrainingArguments JSON, "
                            "a plan, or a .py script)")
    if path.suffix == ".py":
        try:
            text = path.read_text()
        except (OSError, UnicodeDecodeError) as exc:
            raise ShardfitError(f"cannot read {path}: {exc}") from None
        facts: dict = {"sources": ((str(path), text),)}
        if any(name in text for name in _AC_CALLS):
            facts["activation_checkpointing"] = True
        return "python", facts
    data = _load(path)
    if "distributed_type" in data or "compute_environment" in data:
        return "accelerate", from_accelerate(data, path)
    if "model" in data and ({"strategy", "training", "cluster"} & set(data)):
        return "plan", from_plan(data)
    if "zero_optimization" in data or "train_micro_batch_size_per_gpu" in data or "train_batch_size" in data:
        return "deepspeed", from_deepspeed(data)
    if "per_device_train_batch_size" in data or "output_dir" in data:
        return "hf-trainer", from_hf_args(data, path.parent)
    if "model_type" in data:
        return "model-config", {"use_cache": data.get("use_cache")}
    raise ShardfitError(f"{path}: can't tell what this is: expected DeepSpeed JSON (zero_optimization), Accelerate YAML "
                        "(distributed_type), TrainingArguments JSON (per_device_train_batch_size) or a plan (model + strategy)")


def read_setup(paths) -> tuple[Setup, list[tuple[str, str]]]:
    """Merge what every file says; later files only fill facts earlier ones left open."""
    values: dict = {}
    where: list[tuple[str, str]] = []
    kinds: list[tuple[str, str]] = []
    sources: list = []
    autos: list[str] = []
    for path in paths:
        kind, facts = read_file(path)
        kinds.append((str(path), kind))
        sources += list(facts.pop("sources", ()))
        autos += [(fact, str(path)) for fact in facts.pop("auto", ())]
        for name, value in facts.items():
            if value is None or value == ():
                continue
            if name == "activation_checkpointing" and value and values.get(name) is False:
                values[name] = True  # enabled in any file (often the script) means enabled
                where.append((name, str(path)))
            elif name not in values:
                values[name] = value
                where.append((name, str(path)))
    known = {f.name for f in fields(Setup)}
    # "auto" in one file and a value in another (TrainingArguments next to its ds_config): the value wins.
    values["auto"] = tuple(dict.fromkeys(a for a, _ in autos if values.get(a) is None))
    where += [(a, path) for a, path in autos if a in values["auto"] and all(n != a for n, _ in where)]
    setup = Setup(**{k: v for k, v in values.items() if k in known})
    return replace(setup, sources=tuple(sources), where=tuple(where)), kinds


def setup_strategy(setup: Setup, **changes) -> Strategy | None:
    """The Strategy the configs describe (None: no engine named); `changes` override what they say.
    Doctor's rules and `plan`/`fit --from-...` (integrations/setup_plan.py) map a setup the same way."""
    values = {"engine": setup.engine, "zero_stage": setup.zero_stage, "offload_optimizer": setup.offload_optimizer,
              "offload_params": setup.offload_params, "sharding": setup.sharding}
    values.update(changes)
    engine = values["engine"]
    if engine == "deepspeed":
        stage = values["zero_stage"] or 0
        if stage == 0:
            return Strategy(kind="ddp")
        off_opt = "cpu" if values["offload_optimizer"] else None
        off_par = "cpu" if values["offload_params"] and stage == 3 else None
        if off_par and not off_opt:
            off_opt = "cpu"
        bucket = dict(setup.buckets)
        knobs = {field: int(bucket[key]) for field, key in BUFFER_KEYS if key in bucket}
        return Strategy(kind=f"zero{stage}", offload_optimizer=off_opt, offload_params=off_par, **knobs)
    if engine in ("fsdp", "fsdp2"):
        sharding = values["sharding"] or "full_shard"
        if engine == "fsdp2":
            return Strategy(kind="fsdp2", reshard_after_forward=sharding != "shard_grad_op",
                            offload_params="cpu" if values["offload_params"] else None)
        if sharding == "hybrid_shard":
            sharding = "full_shard"  # memory per rank of hybrid = full shard inside the group
        return Strategy(kind="fsdp", sharding=sharding, offload_params="cpu" if values["offload_params"] else None)
    if engine in ("ddp", "single"):
        return Strategy(kind=engine)
    return None
