"""The LoRA flags, spelled the same in plan, fit, train and profile, and the one rule that turns LoRA on.

Rule (docs/plan.md, the `--lora-*` options): any of --lora-r, --lora-targets, --lora-base turns LoRA on. What is
not given takes its default, and the commands print it (`note: QLoRA r=16, ...`): rank 16, the model's own attention projections
(estimate/lora_targets.py), a bf16 base. A quantized base (--lora-base int8 / nf4) therefore always
means QLoRA: a 4- or 8-bit base cannot be fully fine-tuned. Old spellings still work.
"""
from __future__ import annotations

from shardfit.errors import ShardfitError
from shardfit.estimate.lora_targets import lora_for
from shardfit.spec.plan import LORA_BASE_DTYPES

# The old spellings (--lora-rank in train, --lora-base-dtype in plan) are kept as deprecated aliases of
# the same option: they work silently (a note on stderr would break the one-line error rule when the
# same command line also fails) and --help lists them after the name to use.


def add_lora_arguments(group, base_default_text: str = "bf16") -> None:
    group.add_argument("--lora-r", "--lora-rank", type=int, default=None, dest="lora_r",
                       help="LoRA rank (turns LoRA on; default 16 when another --lora-* flag is given; "
                            "--lora-rank: deprecated spelling)")
    group.add_argument("--lora-targets", default=None, dest="lora_targets",
                       help="comma-separated linears to adapt, or all-linear (turns LoRA on; default: the model's "
                            "attention projections)")
    group.add_argument("--lora-base", "--lora-base-dtype", default=None, dest="lora_base",
                       help=f"frozen base weights: bf16 | fp16 | fp32 | int8 | nf4 (turns LoRA on; int8/nf4 = QLoRA; "
                            f"default {base_default_text}; --lora-base-dtype: deprecated spelling)")


def lora_asked(args) -> bool:
    return any(getattr(args, name, None) is not None for name in ("lora_r", "lora_targets", "lora_base"))


def lora_targets(args) -> tuple[str, ...] | None:
    if getattr(args, "lora_targets", None) is None:
        return None
    return tuple(x.strip() for x in args.lora_targets.split(",") if x.strip())


def lora_from_args(args, model, current=None):
    """The LoRA the flags ask for (over the plan's own `current`), or `current` when no flag is given."""
    if not lora_asked(args):
        return current
    if args.lora_r is not None and args.lora_r < 1:
        raise ShardfitError(f"--lora-r must be at least 1, got {args.lora_r}")
    base = args.lora_base.strip().lower() if args.lora_base is not None else None
    if base is not None and base not in LORA_BASE_DTYPES:
        raise ShardfitError(f"--lora-base '{args.lora_base}' is not known: use one of {', '.join(LORA_BASE_DTYPES)}")
    return lora_for(model, rank=args.lora_r, base_dtype=base, targets=lora_targets(args), lora=current)


def lora_line(lora, args) -> str:
    """What LoRA the run uses and which parts were defaults (printed by plan and fit)."""
    defaults = [what for what, flag in (("rank", "lora_r"), ("targets", "lora_targets"), ("base", "lora_base"))
                if getattr(args, flag, None) is None]
    kind = "QLoRA" if lora.base_dtype in ("int8", "nf4") else "LoRA"
    text = f"{kind} r={lora.rank}, targets {','.join(lora.target_modules)}, {lora.base_dtype} base"
    return text + (f" ({', '.join(defaults)}: default)" if defaults else "")
