"""The kernel flags, spelled the same in plan, fit, train and profile: --loss standard|chunked[:N] and
--optimizer-impl auto|foreach|single|fused (spec/kernels.py). Not given: the plan's own values (plan,
train, profile) or fit's choice (fit)."""
from __future__ import annotations

from shardfit.spec.kernels import kernel_fields


def add_kernel_arguments(group, fit: bool = False) -> None:
    chosen = "fit tries chunked where it is what makes a plan fit" if fit else "the plan's, else standard"
    group.add_argument("--loss", default=None,
                       help=f"standard (the model's own loss) | chunked[:N] (head + cross-entropy in N row chunks, "
                            f"logits recomputed in backward; N default 8); default: {chosen}")
    chosen = "fit chooses (fused where the engine runs torch's AdamW)" if fit else \
        "the plan's, else auto (CUDA: foreach for torch, FusedAdam for DeepSpeed; CPU: single-tensor)"
    group.add_argument("--optimizer-impl", default=None, dest="optimizer_impl",
                       help=f"AdamW step kernel: auto | foreach | single | fused; default: {chosen}")


def kernel_changes(args) -> dict:
    """Training fields the flags set (validated: one-line errors)."""
    return kernel_fields(getattr(args, "loss", None), getattr(args, "optimizer_impl", None))
