"""The optimizer line of an emitted training script: the plan's optimizer, not always AdamW.

8-bit AdamW is bitsandbytes' AdamW8bit (what HF Trainer's optim=adamw_bnb_8bit builds; on CPU it falls
back to the same class), not the paged variant, whose states live in CUDA unified memory that torch's
allocator statistics do not see (engines/base.py build_optimizer makes the same choice).
"""
from __future__ import annotations

from shardfit.emit.kernels import optimizer_keywords
from shardfit.errors import ShardfitError
from shardfit.spec.plan import Plan

_ADAM_ARGS = "lr=LR, betas=(0.9, 0.95), weight_decay=WEIGHT_DECAY"


def optimizer_code(plan: Plan, params: str, indent: str = "    ") -> str:
    """`optimizer = ...` for `params` (a Python expression), continuation lines at `indent`."""
    name = plan.training.optimizer
    kernel = optimizer_keywords(plan)  # the plan's optimizer_impl (fused / foreach / single-tensor)
    if name == "adamw":
        return f"optimizer = torch.optim.AdamW({params}, {_ADAM_ARGS}{kernel})"
    if name == "adamw8bit":
        return ("import bitsandbytes as bnb  # 8-bit AdamW (block-wise 8-bit moments): pip install bitsandbytes\n"
                f"{indent}optimizer = bnb.optim.AdamW8bit({params}, {_ADAM_ARGS})")
    if name == "sgd":
        return f"optimizer = torch.optim.SGD({params}, lr=LR, momentum=0.9, weight_decay=WEIGHT_DECAY{kernel})"
    raise ShardfitError(f"the emitted scripts build adamw, adamw8bit or sgd, not {name}: set training.optimizer, "
                        "or use --format hf-trainer (it has lion and adafactor)")
