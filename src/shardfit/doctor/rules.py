"""Config rules: each a small function `(setup, ctx) -> list[Finding]`, quiet when a fact is unknown.

Rules that need sizes (ZeRO-3 where ZeRO-2 fits, offload not needed, state dict on rank 0) ask the
estimator about the run the configs describe, so they need --model and --gpu.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from shardfit.doctor.setup import Setup, setup_strategy
from shardfit.estimate.estimator import estimate
from shardfit.fit.host import assumed_host_gib
from shardfit.spec.deepspeed_config import DS_KEY
from shardfit.spec.gpus import GPU
from shardfit.spec.model_spec import ModelSpec
from shardfit.spec.plan import Cluster, Plan, Strategy, Training

GIB = 1024**3
LONG_SEQUENCE = 4096  # tokens: above this, activations outgrow the sharded states of most models
BUCKET_SHARE = 0.10  # buffers above 10% of device memory are a real cost
SLOW_LINK_RATIO = 4  # inter-node bandwidth under a quarter of intra-node: cross-node all-gathers dominate
MARGIN = 0.10


@dataclass(frozen=True, kw_only=True)
class Finding:
    rule: str
    severity: str  # error | warning | info
    message: str
    fix: str
    where: str = ""


@dataclass(frozen=True, kw_only=True)
class Context:
    model: ModelSpec | None = None
    gpu: GPU | None = None
    gpus_per_node: int | None = None
    nodes: int | None = None
    seq_len: int | None = None
    global_batch: int | None = None
    host_memory_gib: float | None = None  # per node: the full-state-dict save lands in rank 0's host RAM
    estimate_fn: object = None

    def world(self, setup: Setup) -> int | None:
        if self.gpus_per_node:
            return self.gpus_per_node * (self.nodes or setup.nodes or 1)
        return setup.world_size

    def node_count(self, setup: Setup) -> int:
        return self.nodes or setup.nodes or 1

    def seq(self, setup: Setup) -> int | None:
        return self.seq_len or setup.seq_len


def plan_of(setup: Setup, ctx: Context, **changes) -> Plan | None:
    """The Plan the configs describe (None when model, GPU or world size are unknown)."""
    world = ctx.world(setup)
    if ctx.model is None or ctx.gpu is None or not world:
        return None
    strategy = setup_strategy(setup, **changes)
    if strategy is None:
        return None
    nodes = ctx.node_count(setup)
    if world % nodes:
        nodes = 1
    ac = changes.get("activation_checkpointing", setup.activation_checkpointing)
    training = Training(micro_batch=setup.micro_batch or 1, grad_accum=setup.grad_accum or 1,
                        seq_len=ctx.seq(setup) or 2048,
                        precision=setup.precision if setup.precision in ("bf16", "fp16", "fp32") else "bf16",
                        activation_checkpointing="full" if ac else "none")
    return Plan(model=ctx.model, strategy=strategy, training=training,
                cluster=Cluster(nodes=nodes, gpus_per_node=world // nodes, gpu=ctx.gpu.name))


def _fits(plan: Plan, ctx: Context) -> tuple[bool, int]:
    est = (ctx.estimate_fn or estimate)(plan)
    return est.fits(ctx.gpu.memory_bytes, MARGIN), est.device_peak_bytes


# ---------------------------------------------------------------- rules

def does_not_fit(setup: Setup, ctx: Context) -> list[Finding]:
    # Unknown checkpointing (DeepSpeed JSON doesn't say; it is set in code) counts as on: only a run
    # that fails even then is reported.
    plan = plan_of(setup, ctx, activation_checkpointing=setup.activation_checkpointing is not False)
    if plan is None:
        return []
    fits, peak = _fits(plan, ctx)
    if fits:
        return []
    return [Finding(rule="does-not-fit", severity="error",
                    message=f"this run is predicted to need {peak / GIB:.1f} GiB per GPU on a {ctx.gpu.memory_gib:g} GiB "
                            f"{ctx.gpu.name} (micro-batch {plan.training.micro_batch}, seq {plan.training.seq_len}, "
                            f"{plan.strategy.label}, AC {plan.training.activation_checkpointing})",
                    fix=f"`shardfit fit {ctx.model.name} --gpu {ctx.gpu.name} --gpus {plan.cluster.world_size} "
                        f"--nodes {plan.cluster.nodes} --seq {plan.training.seq_len}` finds one that fits",
                    where=setup.origin("engine"))]


def fsdp_without_auto_wrap(setup: Setup, ctx: Context) -> list[Finding]:
    if setup.engine in ("fsdp", "fsdp2") and setup.auto_wrap is False:
        return [Finding(rule="fsdp-no-auto-wrap", severity="error",
                        message="FSDP without an auto-wrap policy wraps the whole model as one unit: every all-gather "
                                "gathers all parameters, so sharding saves nothing at the peak",
                        fix="wrap each transformer block: fsdp_auto_wrap_policy TRANSFORMER_BASED_WRAP with "
                            "fsdp_transformer_layer_cls_to_wrap (e.g. LlamaDecoderLayer)", where=setup.origin("auto_wrap"))]
    return []


def fp16_without_loss_scaling(setup: Setup, ctx: Context) -> list[Finding]:
    if setup.precision == "fp16" and setup.loss_scaling is False:
        return [Finding(rule="fp16-no-loss-scaling", severity="error",
                        message="fp16 without loss scaling: small gradients underflow to zero and losses go NaN",
                        fix="use dynamic loss scaling (DeepSpeed fp16.loss_scale 0, torch GradScaler), or bf16",
                        where=setup.origin("loss_scaling"))]
    return []


def fp16_where_bf16(setup: Setup, ctx: Context) -> list[Finding]:
    if setup.precision == "fp16" and ctx.gpu is not None and ctx.gpu.supports_bf16:
        return [Finding(rule="fp16-where-bf16", severity="warning",
                        message=f"fp16 on {ctx.gpu.name}, which supports bf16: fp16's narrow range is the usual "
                                "source of NaN losses and needs loss scaling",
                        fix="switch to bf16 (same memory, fp32's exponent range, no loss scaler)",
                        where=setup.origin("precision"))]
    return []


def no_ac_long_sequences(setup: Setup, ctx: Context) -> list[Finding]:
    sharded = setup.engine in ("fsdp", "fsdp2") or (setup.engine == "deepspeed" and setup.zero_stage == 3)
    seq = ctx.seq(setup)
    # Only when the configs say "off": a DeepSpeed JSON can't say, the model code decides.
    if not sharded or setup.activation_checkpointing is not False or seq is None or seq < LONG_SEQUENCE:
        return []
    severity, extra = "warning", ""
    plan = plan_of(setup, ctx)
    if plan is not None:
        fits_now, peak = _fits(plan, ctx)
        fits_ac, peak_ac = _fits(plan_of(setup, ctx, activation_checkpointing=True), ctx)
        if fits_now:
            return []  # it fits as is: recompute would only cost time
        severity = "error" if fits_ac else "warning"
        extra = f" (predicted {peak / GIB:.1f} GiB without, {peak_ac / GIB:.1f} GiB with checkpointing"
        extra += ")" if fits_ac else "; even that does not fit: run `shardfit fit`)"
    return [Finding(rule="no-ac-long-seq", severity=severity,
                    message=f"sharded training at {seq} tokens without activation checkpointing: sharding shrinks "
                            f"parameters and optimizer state, not activations, which grow with the sequence{extra}",
                    fix="enable activation checkpointing (fsdp_activation_checkpointing: true, or "
                        "gradient_checkpointing / activation_checkpointing in TrainingArguments)",
                    where=setup.origin("engine"))]


def use_cache_with_checkpointing(setup: Setup, ctx: Context) -> list[Finding]:
    if setup.use_cache and setup.activation_checkpointing:
        return [Finding(rule="use-cache-with-checkpointing", severity="warning",
                        message="the model config keeps use_cache: true while activation checkpointing is on: the KV "
                                "cache is built again in every recompute (transformers' own models switch it off with a "
                                "warning; custom loops and models don't)",
                        fix="set use_cache: false in the model config (model.config.use_cache = False)",
                        where=setup.origin("use_cache"))]
    return []


def bucket_too_large(setup: Setup, ctx: Context) -> list[Finding]:
    if setup.engine != "deepspeed" or not setup.buckets:
        return []
    buckets = dict(setup.buckets)
    stage = setup.zero_stage or 0
    # the two buffers live at once: ZeRO-3's reduce bucket and prefetch, ZeRO-1/2's reduce and all-gather buckets
    names = (DS_KEY["reduce_bucket_size"], DS_KEY["prefetch_bucket_size" if stage == 3 else "allgather_bucket_size"])
    width = 4 if setup.precision == "fp32" else 2
    total = sum(buckets.get(name, 0) for name in names) * width
    out = []
    if ctx.gpu is not None and total > BUCKET_SHARE * ctx.gpu.memory_bytes:
        out.append(f"{total / GIB:.1f} GiB of communication buffers is over {BUCKET_SHARE:.0%} of {ctx.gpu.name}'s "
                   f"{ctx.gpu.memory_gib:g} GiB")
    if ctx.model is not None and max(buckets.get(name, 0) for name in names) > ctx.model.n_params:
        out.append(f"a bucket of {max(buckets.get(n, 0) for n in names):.3g} elements is larger than the whole model "
                   f"({ctx.model.n_params:.3g} parameters)")
    if not out:
        return []
    return [Finding(rule="bucket-too-large", severity="warning",
                    message="; ".join(out) + ": buffers that big can OOM a model that otherwise fits",
                    fix="lower reduce_bucket_size / allgather_bucket_size / stage3_prefetch_bucket_size "
                        "(e.g. hidden² as HF's 'auto' does, or 5e7)", where=setup.origin("buckets"))]


def zero3_where_zero2_fits(setup: Setup, ctx: Context) -> list[Finding]:
    if setup.engine != "deepspeed" or setup.zero_stage != 3:
        return []
    plan = plan_of(setup, ctx, zero_stage=2, offload_params=None)
    if plan is None:
        return []
    fits, peak = _fits(plan, ctx)
    if not fits:
        return []
    same = " with the same optimizer offload" if setup.offload_optimizer else ""
    return [Finding(rule="zero3-where-zero2-fits", severity="warning",
                    message=f"ZeRO-3 where ZeRO-2{same} fits ({peak / GIB:.1f} GiB predicted on {ctx.gpu.name}): ZeRO-3 "
                            "moves 1.5x the data (parameters gathered again in backward) for no memory you need",
                    fix="use zero_optimization.stage 2", where=setup.origin("zero_stage"))]


def offload_not_needed(setup: Setup, ctx: Context) -> list[Finding]:
    if not (setup.offload_optimizer or setup.offload_params):
        return []
    plan = plan_of(setup, ctx, offload_optimizer=None, offload_params=None)
    if plan is None:
        return []
    fits, peak = _fits(plan, ctx)
    if not fits:
        return []
    return [Finding(rule="offload-not-needed", severity="warning",
                    message=f"offload where the run fits without it ({peak / GIB:.1f} GiB predicted on "
                            f"{ctx.gpu.name}): every step pays host-link traffic and a CPU optimizer step",
                    fix="remove offload_optimizer / offload_param (fsdp_offload_params: false)",
                    where=setup.origin("offload_optimizer") or setup.origin("offload_params"))]


def _hybrid_would_fit(setup: Setup, ctx: Context) -> bool:
    """True when sharding inside each node (states replicated across nodes) still fits, or when the
    model / GPU are unknown and the advice can't be checked."""
    plan = plan_of(setup, ctx, activation_checkpointing=setup.activation_checkpointing is not False)
    if plan is None:
        return True
    # FSDP can't offload the optimizer alone: compare like with like (params offloaded or not).
    offload = "cpu" if plan.strategy.offload_params else None
    hybrid = Strategy(kind="fsdp2", shard_group_size=plan.cluster.gpus_per_node, offload_params=offload)
    return _fits(replace(plan, strategy=hybrid), ctx)[0]


def full_shard_slow_links(setup: Setup, ctx: Context) -> list[Finding]:
    shards = (setup.engine == "deepspeed" and setup.zero_stage == 3) or (
        setup.engine in ("fsdp", "fsdp2") and setup.sharding in (None, "full_shard", "shard_grad_op"))
    hybrid = setup.shard_group_size is not None or setup.sharding == "hybrid_shard"
    if not shards or hybrid:
        return []
    nodes = ctx.node_count(setup)
    gpu = ctx.gpu
    if nodes > 1 and (gpu is None or gpu.inter_node_gbs * SLOW_LINK_RATIO <= gpu.intra_node_gbs):
        if not _hybrid_would_fit(setup, ctx):
            return []  # sharding over every node is what makes it fit: there is nothing better to suggest
        speed = f" ({gpu.inter_node_gbs:g} GB/s between nodes vs {gpu.intra_node_gbs:g} inside)" if gpu else ""
        return [Finding(rule="full-shard-slow-links", severity="warning",
                        message=f"parameters sharded across all {nodes} nodes: every all-gather crosses the slow "
                                f"inter-node network{speed}",
                        fix="shard inside each node and replicate across nodes: FSDP HYBRID_SHARD / FSDP2 2-D mesh "
                            "(accelerate parallelism_config dp_replicate_size = nodes), or ZeRO++ hpZ "
                            "(zero_hpz_partition_size = GPUs per node)", where=setup.origin("engine"))]
    if nodes == 1 and gpu is not None and gpu.intra_node_gbs <= 64 and (ctx.world(setup) or 1) > 1:
        return [Finding(rule="full-shard-slow-links", severity="warning",
                        message=f"{gpu.name} has no NVLink ({gpu.intra_node_gbs:g} GB/s between GPUs): parameter "
                                "all-gathers can dominate the step",
                        fix="if it fits, shard only gradients and optimizer state (SHARD_GRAD_OP / ZeRO-2)",
                        where=setup.origin("engine"))]
    return []


def full_state_dict_rank0(setup: Setup, ctx: Context) -> list[Finding]:
    # A full state dict (FSDP FULL_STATE_DICT with HF's offload_to_cpu=True, rank0_only=True; DeepSpeed's
    # gather_16bit_weights_on_model_save) streams unit by unit through the GPU into rank 0's host RAM:
    # that host, shared with the node's other processes, is the limit, and every save waits on it.
    if not setup.full_state_dict:
        return []
    fix = ("save sharded checkpoints (fsdp_state_dict_type SHARDED_STATE_DICT; DeepSpeed "
           "stage3_gather_16bit_weights_on_model_save false) and consolidate offline (zero_to_fp32 / dcp_to_torch_save)")
    if ctx.model is None:
        return [Finding(rule="full-state-dict-rank0", severity="info",
                        message="checkpoints gather the full state dict into rank 0's host RAM: fine for small models, "
                                "out of host memory at save time for big ones (give --model and --host-memory-gib to check)",
                        fix=fix, where=setup.origin("full_state_dict"))]

    width = 2 if setup.engine == "deepspeed" else 4  # DS gathers 16-bit weights; FSDP's sharded params are fp32
    full = ctx.model.n_params * width
    per_node = (ctx.world(setup) or 8) // ctx.node_count(setup) or 1
    if ctx.host_memory_gib is not None:
        host, said = ctx.host_memory_gib, f"{ctx.host_memory_gib:g} GiB (--host-memory-gib)"
    elif ctx.gpu is not None:
        host = assumed_host_gib(ctx.gpu, per_node)
        said = f"~{host:g} GiB assumed for {per_node} x {ctx.gpu.name} (give --host-memory-gib)"
    else:
        host, said = None, "unknown (give --host-memory-gib or --gpu)"
    message = (f"a full state dict of {ctx.model.name} is {full / GIB:.1f} GiB, gathered into rank 0's host RAM "
               f"(per node: {said}) at every save")
    if host is not None and full > host * GIB:
        return [Finding(rule="full-state-dict-rank0", severity="error", message=message + ": the save will run out of "
                        "host memory", fix=fix, where=setup.origin("full_state_dict"))]
    if host is not None and full <= host * GIB / 4 and (ctx.gpu is None or full <= ctx.gpu.memory_bytes):
        return []
    return [Finding(rule="full-state-dict-rank0", severity="warning",
                    message=message + ": it competes with the node's other processes and every save waits on one "
                                      "rank's copy", fix=fix, where=setup.origin("full_state_dict"))]


def auto_values(setup: Setup, ctx: Context) -> list[Finding]:
    if not setup.auto:
        return []
    names = ", ".join(fact.replace("_", " ") for fact in setup.auto)
    flags = ", ".join({"precision": "--precision", "micro_batch": "--micro-batch", "grad_accum": "--grad-accum",
                       "global_batch": "--global-batch"}[f] for f in setup.auto)
    return [Finding(rule="auto-values", severity="info",
                    message=f'{names} left to "auto" (the HF Trainer fills them in at launch): the memory and batch rules '
                            "ran on assumed values (listed above)",
                    fix=f"give {flags} (the Trainer's own values) to check the real run",
                    where=setup.origin(setup.auto[0]))]


def batch_mismatch(setup: Setup, ctx: Context) -> list[Finding]:
    world = ctx.world(setup)
    target = ctx.global_batch or setup.global_batch
    if not (world and target and setup.micro_batch and setup.grad_accum):
        return []
    actual = setup.micro_batch * setup.grad_accum * world
    if actual == target:
        return []
    fix_accum = target / (setup.micro_batch * world)
    hint = (f"set gradient accumulation to {int(fix_accum)}" if fix_accum == int(fix_accum) and fix_accum >= 1
            else f"pick micro-batch x accumulation = {target / world:g} per GPU")
    return [Finding(rule="batch-mismatch", severity="error",
                    message=f"micro-batch {setup.micro_batch} x accumulation {setup.grad_accum} x {world} GPUs = "
                            f"{actual}, not the global batch {target}",
                    fix=hint, where=setup.origin("global_batch") or setup.origin("micro_batch"))]


def fsdp1_hybrid_group_of_one(setup: Setup, ctx: Context) -> list[Finding]:
    if setup.engine == "fsdp" and setup.sharding == "hybrid_shard" and setup.shard_group_size == 1 and (ctx.world(setup) or 2) > 1:
        return [Finding(rule="fsdp1-hybrid-group-1", severity="error",
                        message="FSDP1 HYBRID_SHARD with a shard group of 1 silently falls back to NO_SHARD and never "
                                "all-reduces across replicas: ranks drift apart with no error",
                        fix="use FSDP2 (fsdp_version 2) for this mesh, or put 2+ GPUs in each shard group",
                        where=setup.origin("sharding"))]
    return []


def zero12_nvme_offload(setup: Setup, ctx: Context) -> list[Finding]:
    if setup.engine == "deepspeed" and setup.zero_stage in (1, 2) and setup.offload_optimizer == "nvme":
        return [Finding(rule="zero12-nvme-offload", severity="error",
                        message=f"ZeRO-{setup.zero_stage} accepts offload_optimizer.device nvme but silently uses CPU "
                                "RAM: the host memory you planned to save is spent anyway",
                        fix="use ZeRO-3 for NVMe offload, or say cpu", where=setup.origin("offload_optimizer"))]
    return []


RULES = (does_not_fit, fsdp_without_auto_wrap, fp16_without_loss_scaling, fp16_where_bf16, no_ac_long_sequences,
         use_cache_with_checkpointing, bucket_too_large, zero3_where_zero2_fits, offload_not_needed,
         full_shard_slow_links, full_state_dict_rank0, auto_values, batch_mismatch, fsdp1_hybrid_group_of_one, zero12_nvme_offload)
