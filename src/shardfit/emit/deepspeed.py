"""DeepSpeed config JSON from a Plan (the keys DeepSpeed's own DeepSpeedConfig accepts)."""
from __future__ import annotations

import json

from shardfit.emit.common import Emitted, EmitOptions
from shardfit.errors import ShardfitError
from shardfit.spec.deepspeed_config import zero_optimization
from shardfit.spec.plan import Plan

# DeepSpeed's native optimizer types; others run as a client optimizer built in the training script.
_DS_OPTIMIZERS = {"adamw": "AdamW", "lion": "Lion"}


def deepspeed_config(plan: Plan) -> dict:
    s, t, sched = plan.strategy, plan.training, plan.schedule
    if not s.is_deepspeed:
        raise ShardfitError(f"the plan's strategy is {s.label}, not DeepSpeed: use --format "
                            f"{s.kind if s.kind in ('single', 'fsdp', 'fsdp2') else 'torchrun'}, "
                            "or set strategy.kind to zero1/zero2/zero3")
    config: dict = {
        "train_batch_size": plan.global_batch,
        "train_micro_batch_size_per_gpu": t.micro_batch,
        "gradient_accumulation_steps": t.grad_accum,
        "gradient_clipping": sched.grad_clip,
        "steps_per_print": max(sched.log_every, 1),
        "wall_clock_breakdown": False,
    }
    if t.precision == "bf16":
        config["bf16"] = {"enabled": True}
    elif t.precision == "fp16":
        # loss_scale 0 = dynamic loss scaling; a fixed scale of 1 means none (kept only when asked).
        scale = 1.0 if t.loss_scaling is False else 0
        config["fp16"] = {"enabled": True, "loss_scale": scale, "initial_scale_power": 16,
                          "loss_scale_window": 1000, "hysteresis": 2, "min_loss_scale": 1}
    config["zero_optimization"] = zero_optimization(s)
    if t.optimizer in _DS_OPTIMIZERS:
        config["optimizer"] = {"type": _DS_OPTIMIZERS[t.optimizer],
                               "params": {"lr": sched.lr, "betas": [0.9, 0.95], "eps": 1e-8,
                                          "weight_decay": sched.weight_decay}}
        warmup = min(sched.warmup_steps, max(sched.steps, 1))
        params = {"total_num_steps": max(sched.steps, 1), "warmup_num_steps": warmup, "cos_min_ratio": sched.min_lr_ratio}
        if warmup == 0:
            # WarmupCosineLR refuses 0 warm-up steps at deepspeed.initialize (its config parser lets it
            # through): one step warming from the full rate is no warm-up.
            params.update(warmup_num_steps=1, warmup_min_ratio=1.0)
        config["scheduler"] = {"type": "WarmupCosineLR", "params": params}
    else:
        config["zero_allow_untested_optimizer"] = True
    return config


def emit_deepspeed(plan: Plan, options: EmitOptions) -> Emitted:
    config = deepspeed_config(plan)
    notes = []
    if "optimizer" not in config:
        notes.append(f"{plan.training.optimizer} is not a DeepSpeed optimizer: build it in the script and pass "
                     "it to deepspeed.initialize(optimizer=...)")
    if "optimizer" in config and plan.training.optimizer_impl in ("foreach", "single"):
        notes.append(f"DeepSpeed builds its FusedAdam from this config (no step scratch); the plan's "
                     f"{plan.training.optimizer_impl} step needs a client torch.optim.AdamW(foreach="
                     f"{plan.training.optimizer_impl == 'foreach'}) passed to deepspeed.initialize(optimizer=...), "
                     "as `shardfit train` does")
    if plan.training.loss == "chunked":
        notes.append("the chunked cross-entropy is training-script code, not DeepSpeed config: compute the loss with "
                     "shardfit's engines/chunked_loss.py (model_loss) or Liger-Kernel's fused linear cross-entropy")
    if plan.training.activation_checkpointing != "none":
        notes.append("activation checkpointing is set in the model code (e.g. model.activation_checkpointing_enable("
                     "activation_checkpointing_kwargs={'use_reentrant': False}), gradient_checkpointing_enable before "
                     "transformers 5, and model.config.use_cache = False), not in this JSON")
    return Emitted(files={"ds_config.json": json.dumps(config, indent=2) + "\n"}, notes=tuple(notes))
