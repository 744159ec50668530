"""single: one device, no wrapper: the model on the device, autocast for bf16/fp16 (a GradScaler for
fp16), gradients never synchronised. What a plain PyTorch loop, or the HF Trainer / Accelerate on one
GPU, runs. Checkpoints are DCP like the other torch engines (a process group of one, as `shardfit
train` always launches under torchrun), so a single run resumes on DDP/FSDP and back."""
from __future__ import annotations

from contextlib import contextmanager

import torch

from shardfit.engines import base, native
from shardfit.errors import ShardfitError


def setup(plan, model, ctx) -> base.Engine:
    if ctx.world_size != 1:
        raise ShardfitError(f"strategy single runs one process, but this launch has {ctx.world_size} ranks: "
                            "run with --nproc 1, or use a data-parallel strategy (ddp, fsdp2, zero2, ...)")
    if plan.strategy.offload_params or plan.strategy.offload_optimizer:
        raise ShardfitError("single has no offload: use zero2+offload (optimizer) or fsdp2+offload / zero3+offload")
    model, _ = base.prepare_model(plan, model)
    model = model.to(ctx.device)
    params = base.trainable_params(model)
    optimizer = base.build_optimizer(plan, params)
    scheduler = base.build_scheduler(plan, optimizer)
    scaler = torch.amp.GradScaler(ctx.device.type) if base.uses_scaler(plan) else None

    @contextmanager
    def sync(enabled: bool):
        yield  # nothing to synchronise: gradients simply accumulate in .grad

    def clip(max_norm: float):
        return torch.nn.utils.clip_grad_norm_(params, max_norm, foreach=False)

    def full_state():
        inner = base.unwrap(model)
        skip = base.tied_duplicates(inner)
        for name, tensor in inner.state_dict().items():
            if name not in skip:
                yield name, tensor.detach().cpu()

    return native.build_engine("single", plan, ctx, model, base.unwrap(model), optimizer, scheduler, scaler,
                               sync, clip, full_state, autocast=lambda: base.autocast(plan, ctx))
