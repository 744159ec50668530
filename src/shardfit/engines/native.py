"""The part single, DDP, FSDP and FSDP2 share: the micro-step, the optimizer step with clipping and loss
scaling, and DCP checkpoints (sharded, resharding on load, so another world size can resume)."""
from __future__ import annotations

from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import Callable

import torch
from torch.distributed.tensor.parallel import loss_parallel

from shardfit.engines import quantized_state
from shardfit.engines.chunked_loss import chunked_head, model_loss
from shardfit.engines.base import DistContext, Engine, to_device
from shardfit.engines.dcp_io import async_save_state, SafeMetadataReader, save_with_checksums
from shardfit.engines.tensor_parallel import gathered_logits, vocab_parallel
from shardfit.spec.plan import Plan


def build_engine(kind: str, plan: Plan, ctx: DistContext, model, module, optimizer, scheduler, scaler,
                 sync: Callable[[bool], object], clip: Callable[[float], torch.Tensor], full_state: Callable,
                 autocast: Callable = None, dcp_options=None) -> Engine:
    """sync(enabled) is a context manager that turns gradient synchronisation on or off for one
    micro-batch; clip(max_norm) clips and returns the global gradient norm."""
    accum = plan.training.grad_accum
    quantized = quantized_state.is_quantized(plan)
    grad_clip = plan.schedule.grad_clip
    head = chunked_head(model)  # None: the model's own loss
    sharded_vocab = vocab_parallel(plan)

    def forward_backward(batch: dict, last: bool):
        # Under the vocab-parallel loss the logits stay sharded over tp and torch's loss_parallel runs the
        # model's own cross-entropy on the shards, forward and backward; the loss is a replicated DTensor.
        with sync(last), (loss_parallel() if sharded_vocab else nullcontext()):
            with (autocast() if autocast else nullcontext()):
                loss = model_loss(model, to_device(batch, ctx.device), head)
            scaled = loss.float() / accum
            (scaler.scale(scaled) if scaler is not None else scaled).backward()
        loss = loss.detach().float()
        return loss.to_local() if sharded_vocab else loss

    def step():
        if scaler is not None:
            scaler.unscale_(optimizer)
        # NOTE: max_norm=inf still returns the norm for the log line without changing gradients.
        norm = clip(grad_clip if grad_clip and grad_clip > 0 else float("inf"))
        norm = float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)
        stepped = True
        if scaler is not None:
            before = scaler.get_scale()
            scaler.step(optimizer)
            scaler.update()
            stepped = scaler.get_scale() >= before  # the scale drops exactly when the step was skipped
        else:
            optimizer.step()
        if stepped:
            scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        return norm, stepped

    def zero_grad():
        optimizer.zero_grad(set_to_none=True)

    save, save_async, load = dcp_checkpoint(model, optimizer, quantized, dcp_options)

    @contextmanager
    def inference():
        was_training = model.training
        model.eval()
        try:
            with torch.no_grad(), (autocast() if autocast else nullcontext()), \
                    (gathered_logits(model) if sharded_vocab else nullcontext()):
                yield model
        finally:
            model.train(was_training)

    def extra_state():
        state = {"scheduler": scheduler.state_dict()}
        if scaler is not None:
            state["scaler"] = scaler.state_dict()
        return state

    def load_extra_state(state):
        scheduler.load_state_dict(state["scheduler"])
        if scaler is not None and "scaler" in state:
            scaler.load_state_dict(state["scaler"])

    return Engine(kind=kind, plan=plan, ctx=ctx, model=model, module=module, optimizer=optimizer,
                  scheduler=scheduler, forward_backward=forward_backward, step=step, zero_grad=zero_grad,
                  save=save, load=load, inference=inference, full_state=full_state,
                  extra_state=extra_state, load_extra_state=load_extra_state, save_async=save_async)


def dcp_checkpoint(model, optimizer, quantized: bool = False, dcp_options=None):
    """(save, save_async, load) of `model` + `optimizer` as one sharded DCP checkpoint under
    `<dir>/dcp`, keyed by the model's parameter names (so another layout of the same model loads it)."""

    def save(directory: Path) -> dict:
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, get_state_dict

        if quantized:
            msd = quantized_state.model_state_dict(model)
            osd = get_optimizer_state_dict(model, optimizer, options=dcp_options)
        else:
            msd, osd = get_state_dict(model, optimizer, options=dcp_options)
        return save_with_checksums({"model": msd, "optim": osd}, Path(directory) / "dcp")

    def save_async(directory: Path):
        from torch.distributed.checkpoint.state_dict import get_state_dict

        msd, osd = get_state_dict(model, optimizer, options=dcp_options)
        return async_save_state({"model": msd, "optim": osd}, Path(directory) / "dcp")

    def load(directory: Path):
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import (get_optimizer_state_dict, get_state_dict,
                                                             set_optimizer_state_dict, set_state_dict)

        reader = SafeMetadataReader(str(Path(directory) / "dcp"))
        if quantized:  # bitsandbytes' extra state-dict keys: see engines/quantized_state.py
            state = {"model": quantized_state.load_targets(model, directory, reader),
                     "optim": get_optimizer_state_dict(model, optimizer, options=dcp_options)}
            dcp.load(state, storage_reader=reader)
            quantized_state.load_model_state_dict(model, state["model"])
            set_optimizer_state_dict(model, optimizer, state["optim"], options=dcp_options)
            return
        msd, osd = get_state_dict(model, optimizer, options=dcp_options)
        state = {"model": msd, "optim": osd}
        dcp.load(state, storage_reader=reader)
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"],
                       options=dcp_options)

    return save, save_async, load
