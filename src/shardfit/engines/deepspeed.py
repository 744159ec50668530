"""DeepSpeed ZeRO 1/2/3: the config is generated from the Plan; DeepSpeed owns accumulation,
loss scaling, clipping and (optionally) offload. Plain torchrun launches it: DeepSpeed joins the
existing process group (gloo on CPU, NCCL on CUDA)."""
from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path

import torch

from shardfit.engines import base
from shardfit.engines.dcp_io import SafeMetadataReader
from shardfit.engines.chunked_loss import chunked_head, model_loss
from shardfit.errors import ShardfitError
from shardfit.spec.deepspeed_config import zero_optimization

TAG = "ds"  # one tag per checkpoint directory: the step lives in the directory name


def ds_config(plan, world_size: int, cuda: bool) -> dict:
    """The DeepSpeed JSON the engines run: emit's zero_optimization (one builder), with torch's AdamW as
    the client optimizer and the loop's own LR schedule (so every engine runs the same math)."""
    s, t, sched = plan.strategy, plan.training, plan.schedule
    zero = zero_optimization(s, pin_memory=cuda)
    config = {
        "train_micro_batch_size_per_gpu": t.micro_batch,
        "gradient_accumulation_steps": t.grad_accum,
        "train_batch_size": t.micro_batch * t.grad_accum * world_size,
        "gradient_clipping": float(sched.grad_clip or 0.0),
        "zero_optimization": zero,
        "bf16": {"enabled": t.precision == "bf16"},
        "fp16": {"enabled": t.precision == "fp16", "loss_scale": 0 if t.loss_scaling is not False else 1,
                 "initial_scale_power": 16, "loss_scale_window": 1000, "hysteresis": 2, "min_loss_scale": 1},
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
        # Our optimizer is torch's AdamW (same math as the other engines, no op compile); DeepSpeed
        # only needs to be told it may run an optimizer it did not build.
        "zero_allow_untested_optimizer": True,
    }
    if s.offload_optimizer:
        # Offloaded optimizer state needs DeepSpeed's own CPU Adam (a compiled op).
        config["optimizer"] = {"type": "AdamW", "params": {"lr": sched.lr, "betas": [0.9, 0.95], "eps": 1e-8,
                                                            "weight_decay": sched.weight_decay}}
    return config


def setup(plan, model, ctx) -> base.Engine:
    import deepspeed

    s, t = plan.strategy, plan.training
    if t.optimizer not in ("adamw", "adamw8bit"):
        # adamw8bit runs as a client optimizer over ZeRO's flat fp32 partitions (plain tensors, which
        # bitsandbytes' kernels take); validate_plan rules it out under optimizer offload.
        raise ShardfitError(f"optimizer '{t.optimizer}' is not supported with DeepSpeed in `shardfit train`: "
                            "use adamw or adamw8bit")
    deepspeed.init_distributed(dist_backend=ctx.backend)
    model, _ = base.prepare_model(plan, model)
    config = ds_config(plan, ctx.world_size, ctx.device.type == "cuda")
    kwargs = {}
    if "optimizer" not in config:
        kwargs["optimizer"] = base.build_optimizer(plan, base.trainable_params(model))
    schedule = base.lr_lambda(plan)
    engine, optimizer, _, scheduler = deepspeed.initialize(
        model=model, model_parameters=base.trainable_params(model), config=config,
        lr_scheduler=lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, schedule), **kwargs)
    stage = config["zero_optimization"]["stage"]
    head = chunked_head(engine.module)  # None: the model's own loss

    def forward_backward(batch: dict, last: bool):
        loss = model_loss(engine, base.to_device(batch, engine.device), head)
        engine.backward(loss)  # divides by gradient_accumulation_steps itself
        engine.step()  # an optimizer step only on the accumulation boundary
        return loss.detach().float()

    def step():
        norm = engine.get_global_grad_norm()
        stepped = not getattr(optimizer, "overflow", False)
        return float(norm) if norm is not None else float("nan"), stepped

    def zero_grad():
        engine.zero_grad()

    def save(directory: Path):
        engine.save_checkpoint(str(Path(directory) / "deepspeed"), tag=TAG, save_latest=False)

    def load(directory: Path):
        if (Path(directory) / "dcp").is_dir():  # a DDP / FSDP / FSDP2 checkpoint: switch engines mid-run
            _load_from_dcp(engine, optimizer, Path(directory) / "dcp", stage, ctx)
            return
        if stage == 3 and "nvme" in (s.offload_optimizer, s.offload_params):
            # NOTE: DeepSpeed writes empty swap folders for ZeRO-3 + NVMe: load_checkpoint would
            # silently restore nothing. Refuse rather than resume from garbage.
            raise ShardfitError("resuming ZeRO-3 with NVMe offload is not reliable in DeepSpeed: export the fp32 "
                                "weights (`shardfit export`) and start a new run from them, or use cpu offload")
        path, _ = engine.load_checkpoint(str(Path(directory) / "deepspeed"), tag=TAG, load_optimizer_states=True,
                                         load_lr_scheduler_states=True)
        if path is None:
            raise ShardfitError(f"no DeepSpeed checkpoint in {directory}: was it written by a zero strategy?")

    @contextmanager
    def inference():
        was_training = engine.module.training
        engine.module.eval()
        try:
            with torch.no_grad(), _gathered(engine.module, stage):
                yield engine
        finally:
            engine.module.train(was_training)

    def full_state():
        inner = base.unwrap(engine.module)
        skip = base.tied_duplicates(inner)
        named = dict(inner.named_parameters())
        for name, tensor in inner.state_dict(keep_vars=True).items():
            if name in skip:
                continue
            if stage == 3 and name in named:
                with deepspeed.zero.GatheredParameters([named[name]], modifier_rank=None):
                    value = named[name].data.detach().cpu().clone() if ctx.is_main else None
            else:
                value = tensor.detach().cpu() if ctx.is_main else None
            yield name, value

    def extra_state():
        return {}  # DeepSpeed's checkpoint holds the scheduler and the loss scaler

    def load_extra_state(state):
        if "scheduler" in state:  # only from a DCP checkpoint; DeepSpeed's own restores it itself
            scheduler.load_state_dict(state["scheduler"])
            for group in scheduler.optimizer.param_groups:
                group["lr"] = group["initial_lr"] * schedule(scheduler.last_epoch)

    return base.Engine(kind=s.kind, plan=plan, ctx=ctx, model=engine, module=base.unwrap(engine.module),
                       optimizer=optimizer, scheduler=scheduler, forward_backward=forward_backward, step=step,
                       zero_grad=zero_grad, save=save, load=load, inference=inference, full_state=full_state,
                       extra_state=extra_state, load_extra_state=load_extra_state)


@contextmanager
def _gathered(module, stage: int):
    """ZeRO-3: gather every parameter once for the whole generation (rather than per block per
    token); the forward hooks see them available and fetch nothing. Other stages hold full params."""
    if stage != 3:
        yield
        return
    import deepspeed

    with deepspeed.zero.GatheredParameters(list(module.parameters()), modifier_rank=None):
        yield


def _load_from_dcp(engine, optimizer, path: Path, stage: int, ctx) -> None:
    """Model and AdamW state from a DCP checkpoint (any engine, any world size) into ZeRO's
    partitions: every rank reads the full tensors and keeps its own fragment."""
    import deepspeed
    import torch.distributed.checkpoint as dcp
    from deepspeed.utils import safe_set_full_fp32_param, safe_set_full_optimizer_state
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    metadata = SafeMetadataReader(str(path)).read_metadata().state_dict_metadata
    named = dict(base.unwrap(engine.module).named_parameters())
    keys = [k for name in named for k in (f"model.{name}", f"optim.state.{name}.exp_avg",
                                          f"optim.state.{name}.exp_avg_sq", f"optim.state.{name}.step")]
    missing = [k for k in keys if k not in metadata]
    if missing:
        raise ShardfitError(f"DCP checkpoint {path} lacks {missing[0]}: it was written for another model or optimizer")
    state = {k: torch.empty(metadata[k].size, dtype=metadata[k].properties.dtype) for k in keys
             if isinstance(metadata[k], TensorStorageMetadata)}
    dcp.load(state, storage_reader=SafeMetadataReader(str(path)), no_dist=True)
    # NOTE: AdamW creates its state on the first step, and ZeRO links each parameter to its state
    # fragments only then; before it the setters fail. Create zero state of AdamW's own layout and
    # link it, then overwrite it.
    inner = optimizer.optimizer
    flats = [p for group in inner.param_groups for p in group["params"]]
    flats += list(getattr(optimizer, "fp32_partitioned_groups_flat", []))  # ZeRO-3 keys its state by these
    for flat in flats:
        inner.state[flat] = {"step": torch.tensor(0.0), "exp_avg": torch.zeros_like(flat),
                             "exp_avg_sq": torch.zeros_like(flat)}
    if hasattr(optimizer, "_lazy_init_hp_params_optimizer_state"):
        optimizer._lazy_init_hp_params_optimizer_state()
    steps = None
    for name, param in named.items():
        if not param.requires_grad:
            continue
        weights = state[f"model.{name}"]
        # The fp32 master fragment, then the moments, then the low-precision copy the forward uses.
        safe_set_full_fp32_param(param, weights.to(engine.device))
        for key in ("exp_avg", "exp_avg_sq"):
            safe_set_full_optimizer_state(param, state[f"optim.state.{name}.{key}"].to(engine.device), key)
        steps = state.get(f"optim.state.{name}.step", steps)
        if stage == 3:
            with deepspeed.zero.GatheredParameters([param], modifier_rank=0):
                if ctx.rank == 0:
                    param.data.copy_(weights.to(param.dtype))
        else:
            param.data.copy_(weights.to(param.dtype))
    if steps is not None:
        # torch AdamW keeps the step count per tensor: ZeRO's flat fragments take the same count.
        for group_state in optimizer.optimizer.state.values():
            if "step" in group_state:
                group_state["step"] = torch.as_tensor(steps, dtype=group_state["step"].dtype if torch.is_tensor(
                    group_state["step"]) else torch.float32).clone()
