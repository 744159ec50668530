"""DDP: full replicas, gradients all-reduced in buckets; `no_sync` skips the all-reduce on every
micro-batch but the last of an accumulation step."""
from __future__ import annotations

from contextlib import contextmanager, nullcontext

import torch
from torch.nn.parallel import DistributedDataParallel

from shardfit.engines import base, native
from shardfit.errors import ShardfitError


def setup(plan, model, ctx) -> base.Engine:
    if plan.strategy.offload_params or plan.strategy.offload_optimizer:
        raise ShardfitError("DDP has no offload: use zero2+offload (optimizer) or fsdp2+offload / zero3+offload")
    model, _ = base.prepare_model(plan, model)
    model = model.to(ctx.device)
    wrapped = DistributedDataParallel(
        model, device_ids=[ctx.local_rank] if ctx.device.type == "cuda" else None,
        bucket_cap_mb=plan.strategy.ddp_bucket_cap_mb,
        # NOTE: LoRA freezes the base, and HF checkpointing recomputes in backward: both are fine with
        # static graphs only when every trainable parameter gets a gradient every step, which holds here.
        find_unused_parameters=False)
    params = base.trainable_params(wrapped)
    optimizer = base.build_optimizer(plan, params)
    scheduler = base.build_scheduler(plan, optimizer)
    scaler = torch.amp.GradScaler(ctx.device.type) if base.uses_scaler(plan) else None

    @contextmanager
    def sync(enabled: bool):
        with (nullcontext() if enabled else wrapped.no_sync()):
            yield

    def clip(max_norm: float):
        return torch.nn.utils.clip_grad_norm_(params, max_norm, foreach=False)

    def full_state():
        inner = base.unwrap(wrapped.module)
        skip = base.tied_duplicates(inner)
        for name, tensor in inner.state_dict().items():
            if name not in skip:
                yield name, (tensor.detach().cpu() if ctx.is_main else None)

    return native.build_engine("ddp", plan, ctx, wrapped, base.unwrap(model), optimizer, scheduler, scaler,
                               sync, clip, full_state, autocast=lambda: base.autocast(plan, ctx))
