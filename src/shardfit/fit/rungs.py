"""The state rungs: smaller optimizer states and no fp32 master, tried after the field's cheaper levers
and before offload.

When no family fits with full-precision states (after precision, micro-batch + accumulation, activation
checkpointing and ZeRO / FSDP sharding have all been searched), the states themselves are what keeps the
plan out. The field then reaches for, in this order, before paying offload's host-link traffic every step:

1. 8-bit AdamW (bitsandbytes): m and v in 1 byte each plus a fp32 absmax per 256-block instead of
   2 x 4 bytes. A small quality risk (block-wise quantized moments); it needs bitsandbytes.
2. Pure bf16 (no fp32 master): parameters, gradients and moments in bf16, 8 instead of 16 bytes per
   trained parameter. Updates smaller than bf16's resolution (2^-8 of the weight) are lost; long runs
   need Kahan summation / stochastic rounding, or an fp32 master. DeepSpeed always keeps fp32 masters:
   FSDP, DDP and single only.
3. Both together.

A rung applies only when the request left that knob open: `--optimizer` given pins the optimizer (no
8-bit rung), `--precision` given pins the precision (no pure-bf16 rung).
"""
from __future__ import annotations

from dataclasses import dataclass

# Rung names a FitRequest may allow (FitRequest.rungs).
RUNG_NAMES = ("adamw8bit", "bf16-pure")

EIGHT_BIT_COST = ("bitsandbytes block-wise 8-bit moments: a small quality risk (watch the loss of the first "
                  "hundred steps); needs bitsandbytes (pip install bitsandbytes)")
PURE_BF16_COST = ("no fp32 master: updates below bf16 resolution are lost; for long runs use Kahan summation / "
                  "stochastic rounding or keep the fp32 master (precision bf16); FSDP/DDP only")


@dataclass(frozen=True)
class Rung:
    name: str  # what the field calls it
    changes: tuple[tuple[str, str], ...]  # Training fields it sets
    flags: str  # the command-line flags that ask for it
    cost: str  # one line: what it costs

    @property
    def training(self) -> dict:
        return dict(self.changes)


EIGHT_BIT = Rung("8-bit AdamW", (("optimizer", "adamw8bit"),), "--optimizer adamw8bit", EIGHT_BIT_COST)
PURE_BF16 = Rung("pure bf16", (("precision", "bf16-pure"),), "--precision bf16-pure", PURE_BF16_COST)
BOTH = Rung("8-bit AdamW + pure bf16", (("optimizer", "adamw8bit"), ("precision", "bf16-pure")),
            "--optimizer adamw8bit --precision bf16-pure", f"{EIGHT_BIT_COST}; and {PURE_BF16_COST}")


def rungs_for(request, precision: str) -> list[Rung]:
    """The rungs this request leaves open, in the order they are tried. `precision` is the one fit
    resolved (bf16 on GPUs that support it)."""
    allowed = set(request.options.rungs)
    eight = "adamw8bit" in allowed and request.base.training.optimizer == "adamw"
    pure = "bf16-pure" in allowed and request.pins.precision is None and precision == "bf16"
    out = []
    if eight:
        out.append(EIGHT_BIT)
    if pure:
        out.append(PURE_BF16)
    if eight and pure:
        out.append(BOTH)
    return out


def rung_note(rung: Rung, family: str, saved_bytes: int, before: int, after: int, fmt) -> str:
    """The one line fit prints when a rung is what made the plan fit: memory saved and its cost."""
    return (f"{rung.name} ({rung.flags}) is what makes {family} fit: saves {fmt(saved_bytes)} per GPU "
            f"({fmt(before)} -> {fmt(after)} with full-precision states at the same micro-batch and AC); "
            f"cost: {rung.cost}")
