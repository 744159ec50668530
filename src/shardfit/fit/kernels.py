"""fit's two kernel levers (spec/kernels.py): the optimizer step's implementation, chosen explicitly for
every plan, and the chunked cross-entropy rung, turned on only where it is what makes a plan fit.

Order in the search: precision and micro-batch first, then the chunked loss (cheap in time: the head's
matmul runs once more, +2*V*h FLOPs per token), then activation checkpointing (a block's forward
again). The optimizer step is not a rung: fused AdamW does the same math with no scratch and no extra
time, so it is chosen wherever the engine runs torch's AdamW.
"""
from __future__ import annotations

from shardfit.units import fmt_bytes
from shardfit.spec.kernels import CHUNKED_UNSUPPORTED

GIB = 1024**3


def optimizer_impl_for(request, strategy) -> str:
    """fused for torch's AdamW / SGD (CUDA, and CPU since torch 2.4; DTensors under FSDP2; DeepSpeed's client
    optimizer, or its FusedAdam in an emitted config); auto where the optimizer has its own kernel
    (8-bit AdamW, Lion, Adafactor) or DeepSpeed offload runs DeepSpeedCPUAdam. --optimizer-impl pins it."""
    if request.pins.optimizer_impl:
        return request.pins.optimizer_impl
    if request.base.training.optimizer not in ("adamw", "sgd"):
        return "auto"
    if strategy.is_deepspeed and strategy.offload_optimizer:
        return "auto"
    return "fused"


def loss_options(request, model) -> tuple[str, ...]:
    """The losses searched: as asked (--loss), else standard and, as the rung after it, chunked."""
    if request.pins.loss:
        return (request.pins.loss,)
    if not model.has_shape or model.family in CHUNKED_UNSUPPORTED:
        return ("standard",)
    return ("standard", "chunked")


def with_loss(plan, loss: str, chunks: int):
    return plan.with_changes(training={"loss": loss, "loss_chunks": chunks})


def chunked_rung(largest_fitting, make, micro_options, standard_plan, chunks: int):
    """The chunked loss's largest fitting plan (largest_fitting(make) bisects the micro-batch), kept only
    where it is what makes this setting fit (nothing fits without it) or fit a larger micro-batch."""
    if standard_plan is not None and standard_plan.training.micro_batch == micro_options[-1]:
        return None  # everything fits already: the recompute would buy nothing
    plan = largest_fitting(lambda micro: with_loss(make(micro), "chunked", chunks))
    if plan is None or (standard_plan is not None and plan.training.micro_batch <= standard_plan.training.micro_batch):
        return None
    return plan


def kernel_notes(search, best, request) -> list[str]:
    """The "why" lines for the best plan's loss and optimizer step, with the bytes each choice moves."""
    if best is None:
        return []
    plan, t = best.plan, best.plan.training
    notes = []
    if t.loss == "chunked" and not request.pins.loss:
        standard = with_loss(plan, "standard", t.loss_chunks)
        notes.append(f"chunked cross-entropy: head + loss in {t.loss_chunks} row chunks, logits recomputed in "
                     f"backward (+2*V*h FLOPs per token): without it this plan needs {fmt_bytes(search.peak(standard))} "
                     f"> {fmt_bytes(search.usable)} usable; with it {fmt_bytes(best.peak_bytes)}")
    impl = t.optimizer_impl
    if impl == "fused":
        foreach = plan.with_changes(training={"optimizer_impl": "foreach"})
        extra = search.peak(foreach) - best.peak_bytes
        how = "DeepSpeed FusedAdam" if plan.strategy.is_deepspeed else "torch.optim.AdamW(fused=True)"
        line = f"optimizer step: fused ({how}): no step scratch"
        if extra > 0:
            line += f"; foreach would add {fmt_bytes(extra)} per GPU" + (
                f" ({fmt_bytes(search.peak(foreach))} > {fmt_bytes(search.usable)} usable: it would not fit)"
                if not search.fits(foreach) else "")
        notes.append(line + ("" if request.pins.optimizer_impl else " (--optimizer-impl to pin another)"))
    else:
        offloaded = plan.strategy.offload_optimizer or plan.strategy.offload_params
        why = (" (as asked)" if request.pins.optimizer_impl else
               f" ({t.optimizer} brings its own kernel)" if t.optimizer != "adamw" else
               " (DeepSpeed's CPU Adam runs the offloaded step)" if offloaded and plan.strategy.is_deepspeed else
               " (the offloaded step runs on the CPU)" if offloaded else "")
        notes.append(f"optimizer step: {impl}{why}")
    return notes
