"""What every engine shares: the process group, the Engine record, model preparation (LoRA,
activation checkpointing, dtype), the optimizer and the LR schedule.

The differences between single, DDP, FSDP, FSDP2 and DeepSpeed live in the engine modules and nowhere
else; the training loop above only calls the Engine's functions.
"""
from __future__ import annotations

import math
import os
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.distributed as dist

from shardfit import sac
from shardfit.errors import ShardfitError
from shardfit.modeling import block_classes
from shardfit.runtime_env import local_world_size, process_group_kwargs
from shardfit.engines.chunked_loss import install as install_chunked_loss
from shardfit.spec.plan import Plan, is_selective_ac, parse_activation_checkpointing


@dataclass(frozen=True)
class DistContext:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    backend: str

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def init_distributed() -> DistContext:
    """Join the process group torchrun set up: NCCL on CUDA, gloo on CPU. Idempotent."""
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        raise ShardfitError("not inside a distributed launch: run through `shardfit train` or torchrun")
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    if torch.cuda.is_available():
        torch.cuda.set_device(local_rank)
        device, backend = torch.device("cuda", local_rank), "nccl"
    else:
        device, backend = torch.device("cpu"), "gloo"
    if not dist.is_initialized():
        # --collective-timeout, and a fresh store namespace per torchrun restart
        dist.init_process_group(backend=backend, **process_group_kwargs())
    return DistContext(rank=dist.get_rank(), world_size=dist.get_world_size(), local_rank=local_rank,
                       device=device, backend=backend)


@dataclass(frozen=True)
class Engine:
    """A wrapped model and the few operations the loop needs. Built by `<engine>.setup(plan, model, ctx)`.

    forward_backward(batch, last) -> detached unscaled loss; gradients are synchronised only when
        `last` is true (the last micro-batch of an accumulation step).
    step() -> (grad_norm, stepped): unscale, clip, optimizer and scheduler step, zero grads.
    zero_grad(): drop accumulated gradients (NaN skip).
    save(dir) / load(dir): sharded model + optimizer + scheduler (+ loss scaler) state. save may
        return {path: {"size", "xxh3_128"}} for the files this rank checksummed while writing them
        (the manifest hashes the rest from disk).
    save_async(dir) -> Future: like save, but the state is staged (copied) first and written by
        DCP's writer process while training goes on (None: the engine has no asynchronous save).
    inference(): context for forward passes outside training (eval mode, no grad, params gathered
        as the engine needs); every rank must run the same forwards inside it.
    full_state() -> iterator of (name, tensor): the consolidated model, one tensor at a time; every
        rank must iterate, only rank 0 gets real values (others get None).
    A pipeline engine returns 0 for every micro-batch but the last, and there the sum of the step's
    micro-batch losses (its schedule runs them all at once).
    """
    kind: str
    plan: Plan
    ctx: DistContext
    model: Any
    module: Any
    optimizer: Any
    scheduler: Any
    forward_backward: Callable
    step: Callable
    zero_grad: Callable
    save: Callable
    load: Callable
    inference: Callable
    full_state: Callable
    extra_state: Callable = lambda: {}
    load_extra_state: Callable = lambda state: None
    save_async: Callable | None = None
    # eval_loss(batches) -> the summed loss of a pipeline's micro-batches, forward only (None: the loop
    # runs the model under inference()).
    eval_loss: Callable | None = None


def unwrap(model):
    """The HF model inside peft / checkpoint wrappers (config, generation, export names)."""
    inner = model
    if hasattr(inner, "get_base_model"):
        inner = inner.get_base_model()
    return inner


def prepare_model(plan: Plan, model):
    """Before any wrapping, on CPU, identical on every rank: LoRA adapters, activation
    checkpointing per block, pure-bf16 cast."""
    t = plan.training
    blocks_cls = tuple(block_classes(model, plan.model if plan.model.block_class else None))
    if t.lora is not None:
        model = apply_lora(plan, model)
    every = parse_activation_checkpointing(t.activation_checkpointing)
    if every:
        apply_activation_checkpointing(model, blocks_cls, every, selective=is_selective_ac(t.activation_checkpointing))
    if t.precision == "bf16-pure":
        model = model.to(torch.bfloat16)
    if t.loss == "chunked":
        install_chunked_loss(model, t.loss_chunks)
    return model, blocks_cls


def apply_lora(plan: Plan, model):
    from peft import LoraConfig, get_peft_model

    lora = plan.training.lora
    names = {n.rsplit(".", 1)[-1] for n, _ in model.named_modules()}
    missing = [m for m in lora.target_modules if m not in names]
    if missing:
        raise ShardfitError(f"LoRA target module(s) {', '.join(missing)} not found in {type(model).__name__}: "
                            f"set training.lora.target_modules (e.g. q_proj,v_proj; c_attn for GPT-2)")
    if lora.base_dtype in ("int8", "nf4"):
        model = quantize_base(plan, model)
    config = LoraConfig(r=lora.rank, lora_alpha=lora.alpha, lora_dropout=lora.dropout,
                        target_modules=list(lora.target_modules), task_type="CAUSAL_LM")
    import warnings

    with warnings.catch_warnings():
        # peft reads transformers' `is_gradient_checkpointing`, deprecated in transformers 5 (its
        # successor: is_activation_checkpointing); a notice about peft's internals, on every LoRA run.
        warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
        return get_peft_model(model, config)



# The engines that train a bitsandbytes base. FSDP2 shards nf4's packed uint8 weight per parameter and
# all-gathers the same bytes (run on 2 CPU ranks: losses equal to one rank's), but its gathered int8
# weight loses Int8Params.CB; FSDP1 cannot flatten integer tensors; ZeRO is not wired up.
QLORA_ENGINES = {"nf4": ("single", "ddp", "fsdp2"), "int8": ("single", "ddp")}


def quantize_base(plan: Plan, model):
    """QLoRA as transformers + peft set it up, in place on the built weights: every nn.Linear / Conv1D
    except the output head becomes a bitsandbytes Linear4bit (nf4, double-quantized absmax) or
    Linear8bitLt (int8 rows, outlier threshold 6.0), then peft's prepare_model_for_kbit_training
    freezes the base and upcasts every 16-bit weight it did not quantize to fp32.
    Source: transformers quantizers/quantizer_bnb_4bit.py + integrations/bitsandbytes.py
    replace_with_bnb_linear (what from_pretrained(quantization_config=BitsAndBytesConfig(...)) builds);
    peft utils/other.py prepare_model_for_kbit_training.
    NOTE: peft enables gradient checkpointing by default (use_gradient_checkpointing=True); here the
    plan's activation_checkpointing decides, so the run is what the estimate counts."""
    lora, t = plan.training.lora, plan.training
    if any(p.device.type == "meta" for p in model.parameters()):
        raise ShardfitError(f"a {lora.base_dtype} base is quantized from real weights and cannot be built on the meta "
                            "device: use the analytic estimate (shardfit plan) for QLoRA")
    if plan.strategy.kind not in QLORA_ENGINES[lora.base_dtype]:
        raise ShardfitError(f"a {lora.base_dtype} base (QLoRA) trains under strategy {', '.join(QLORA_ENGINES[lora.base_dtype])}, "
                            f"not {plan.strategy.kind}: the bitsandbytes weights do not survive its sharding")
    if t.precision == "bf16-pure":
        raise ShardfitError("QLoRA keeps peft's fp32 norms, embeddings and head (prepare_model_for_kbit_training): "
                            "use precision bf16 (autocast) or fp32, not bf16-pure")
    try:
        import bitsandbytes as bnb
    except ImportError:
        raise ShardfitError(f"training with a {lora.base_dtype} base (QLoRA) needs bitsandbytes: "
                            "pip install 'bitsandbytes>=0.45', or use base_dtype bf16 or fp32") from None
    from peft import prepare_model_for_kbit_training
    from transformers.pytorch_utils import Conv1D
    from transformers.quantizers.base import HfQuantizer
    from transformers.quantizers.quantizers_utils import should_convert_module

    compute = low_precision_dtype(plan) or torch.float32  # bnb_4bit_compute_dtype
    skip = HfQuantizer.get_modules_to_not_convert(model, None, getattr(model, "_keep_in_fp32_modules", None))
    for name, module in list(model.named_modules()):
        if not (type(module) is torch.nn.Linear or isinstance(module, Conv1D)) or not should_convert_module(name, skip):
            continue
        # Conv1D keeps its weight as (in, out): bnb's layers are nn.Linear, (out, in).
        weight = module.weight.data.t() if isinstance(module, Conv1D) else module.weight.data
        out_features, in_features = weight.shape
        has_bias = module.bias is not None
        if lora.base_dtype == "nf4":
            new = bnb.nn.Linear4bit(in_features, out_features, has_bias, compute_dtype=compute,
                                    compress_statistics=True, quant_type="nf4", device="meta")
            new.weight = bnb.nn.Params4bit(weight.to(compute).contiguous(), requires_grad=False,
                                           compress_statistics=True, quant_type="nf4", module=new)
        else:
            new = bnb.nn.Linear8bitLt(in_features, out_features, has_bias, has_fp16_weights=False, threshold=6.0,
                                      device="meta")
            new.weight = bnb.nn.Int8Params(weight.to(torch.float16).contiguous(), requires_grad=False,
                                           has_fp16_weights=False)
        if has_bias:
            new.bias = torch.nn.Parameter(module.bias.data, requires_grad=False)
        model.set_submodule(name, new.to(weight.device))  # Params4bit / Int8Params quantize on .to()
    # peft builds its bnb LoRA layers (lora/bnb.py) only for a model flagged the way transformers flags it.
    setattr(model, "is_loaded_in_4bit" if lora.base_dtype == "nf4" else "is_loaded_in_8bit", True)
    return prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)


def apply_activation_checkpointing(model, blocks_cls, every: int, selective: bool = False) -> None:
    """Checkpoint every `every`-th block; `selective`: under the per-op SAC policy (shardfit/sac.py).
    NOTE: transformers' own mechanism (non-reentrant torch.utils.checkpoint inside each decoder
    layer) works under every engine, unlike reentrant checkpointing with ZeRO-3 or a wrapper class
    that changes the FSDP wrap unit; both paths hand SAC's context_fn to torch.utils.checkpoint."""
    inner = unwrap(model)
    kwargs = {"use_reentrant": False, **({"context_fn": sac.context_fn} if selective else {})}
    if not getattr(inner, "supports_gradient_checkpointing", False):
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
            CheckpointImpl, apply_activation_checkpointing as wrap_ac, checkpoint_wrapper)
        blocks = [m for m in model.modules() if isinstance(m, blocks_cls)]
        chosen = {id(b) for i, b in enumerate(blocks) if i % every == 0}
        extra = {"context_fn": sac.context_fn} if selective else {}
        wrap_ac(model, checkpoint_wrapper_fn=lambda m: checkpoint_wrapper(m, checkpoint_impl=CheckpointImpl.NO_REENTRANT, **extra),
                check_fn=lambda m: id(m) in chosen)
        return
    if hasattr(inner, "activation_checkpointing_enable"):  # transformers >= 5: every-N built in
        inner.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs, every_n_layers=every)
        return
    inner.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    blocks = [m for m in inner.modules() if isinstance(m, blocks_cls)]
    for index, block in enumerate(blocks):
        if hasattr(block, "gradient_checkpointing"):
            block.gradient_checkpointing = index % every == 0


def trainable_params(model):
    return [p for p in model.parameters() if p.requires_grad]


def build_optimizer(plan: Plan, params):
    t, s = plan.training, plan.schedule
    params = list(params)
    kernel = optimizer_kernel(t.optimizer_impl, bool(params) and params[0].device.type == "cuda")
    if t.optimizer == "adamw":
        return torch.optim.AdamW(params, lr=s.lr, weight_decay=s.weight_decay, betas=(0.9, 0.95), eps=1e-8, **kernel)
    if t.optimizer == "sgd":
        return torch.optim.SGD(params, lr=s.lr, momentum=0.9, weight_decay=s.weight_decay, **kernel)
    if t.optimizer == "adamw8bit":
        try:
            import bitsandbytes as bnb
        except ImportError:
            raise ShardfitError("optimizer adamw8bit needs bitsandbytes: pip install 'bitsandbytes>=0.45', or use adamw") from None
        # NOTE: not the paged variant (HF's paged_adamw_8bit): it keeps the same states in CUDA unified
        # memory, which torch's allocator statistics do not see (bitsandbytes falls back to this one on CPU).
        return bnb.optim.AdamW8bit(params, lr=s.lr, weight_decay=s.weight_decay, betas=(0.9, 0.95), eps=1e-8)
    raise ShardfitError(f"optimizer '{t.optimizer}' is not supported by `shardfit train` yet: use adamw, adamw8bit or sgd")


def optimizer_kernel(impl: str, cuda: bool) -> dict:
    """torch.optim's keyword for training.optimizer_impl. auto: foreach on CUDA, the single-tensor loop on
    CPU (it keeps the update arithmetic the same for plain tensors and DTensors, so DDP, FSDP and FSDP2
    stay bit-identical there). fused: one kernel per step (CUDA and, since torch 2.4, CPU; DTensors too)."""
    if impl == "fused":
        return {"fused": True, "foreach": False}
    return {"foreach": impl == "foreach" or (impl == "auto" and cuda), "fused": False if impl != "auto" else None}


def lr_lambda(plan: Plan) -> Callable[[int], float]:
    """Linear warm-up, then cosine from the peak down to min_lr_ratio at the last step."""
    s = plan.schedule
    warmup, total, floor = max(0, s.warmup_steps), max(1, s.steps), s.min_lr_ratio

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / (warmup + 1)
        progress = min(1.0, (step - warmup) / max(1, total - warmup))
        return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))

    return factor


def build_scheduler(plan: Plan, optimizer):
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(plan))


def autocast(plan: Plan, ctx: DistContext):
    """bf16 / fp16 autocast for engines that keep fp32 parameters (single, DDP); FSDP's mixed-precision
    policies cast the parameters themselves, and pure bf16 needs nothing."""
    precision = plan.training.precision
    if precision in ("bf16", "fp16"):
        dtype = torch.bfloat16 if precision == "bf16" else torch.float16
        return torch.autocast(device_type=ctx.device.type, dtype=dtype)
    return nullcontext()


def low_precision_dtype(plan: Plan):
    return {"bf16": torch.bfloat16, "fp16": torch.float16, "bf16-pure": torch.bfloat16}.get(plan.training.precision)


def uses_scaler(plan: Plan) -> bool:
    return plan.training.precision == "fp16" and plan.training.loss_scaling is not False


def sharded_scaler(plan: Plan, ctx: DistContext):
    """fp16 loss scaler for FSDP / FSDP2: it must see the inf/nan of every rank's gradient shard."""
    if not uses_scaler(plan):
        return None
    from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler
    return ShardedGradScaler(ctx.device.type)


def to_device(batch: dict, device) -> dict:
    return {k: v.to(device, non_blocking=True) for k, v in batch.items()}


def hybrid_group(plan: Plan, ctx: DistContext) -> int | None:
    """Ranks per shard group for hybrid sharding, or None for plain sharding over all ranks."""
    s = plan.strategy
    if s.kind == "fsdp" and s.sharding != "hybrid_shard":
        return None
    if s.kind == "fsdp2" and s.shard_group(0) is None:
        return None
    group = s.shard_group_size or local_world_size(ctx.world_size)
    if group < 1 or ctx.world_size % group:
        raise ShardfitError(f"hybrid shard group of {group} ranks does not divide the world size {ctx.world_size}: "
                            "set strategy.shard_group_size to a divisor")
    return group


def device_mesh(ctx: DistContext, group: int | None):
    from torch.distributed.device_mesh import init_device_mesh

    if group is None:
        return init_device_mesh(ctx.device.type, (ctx.world_size,), mesh_dim_names=("shard",))
    return init_device_mesh(ctx.device.type, (ctx.world_size // group, group), mesh_dim_names=("replicate", "shard"))


def tied_duplicates(module) -> set:
    """State-dict keys that alias an earlier key (tied embeddings): safetensors stores each once."""
    seen, duplicates = {}, set()
    for name, tensor in module.state_dict(keep_vars=True).items():
        key = id(tensor)
        if key in seen:
            duplicates.add(name)
        else:
            seen[key] = name
    return duplicates
