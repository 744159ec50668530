"""Per-op selective activation checkpointing (SAC), torchtitan's "selective op" policy: inside each
checkpointed block the outputs of matmuls (with or without a bias) and attention kernels are kept for
backward, every second matmul of the block is recomputed anyway, and everything else (norms, activations, rotary,
elementwise products) is recomputed. One policy serves the engines (which apply it through
torch.utils.checkpoint's context_fn) and the activation tracer (which counts what it keeps), so the
estimate and the run cannot disagree on what is saved.

torch is imported inside the functions: importing this module is free.
"""
from __future__ import annotations

from collections import defaultdict
from functools import partial

# aten ops whose outputs SAC keeps; the CPU attention kernel is the CPU build's flash equivalent.
# A linear with a bias is one addmm (torch's F.linear on a contiguous input) or an mm and an add
# (DeepSpeed ZeRO-3's linear): both count as the matmul they are, so the policy keeps the same
# tensors whichever linear runs (torchtitan's models have no biases and list mm alone).
MATMULS = ("mm.default", "addmm.default")
SAVED_OPS = (*MATMULS, "_scaled_dot_product_efficient_attention.default",
             "_scaled_dot_product_flash_attention.default", "_scaled_dot_product_cudnn_attention.default",
             "_scaled_dot_product_flash_attention_for_cpu.default")


def _op_name(func) -> str:
    return f"{func._opname}.{func._overloadname}" if hasattr(func, "_opname") else str(func)


def keeps(func, counts: dict, recompute: bool = False) -> bool:
    """Whether SAC keeps this op's output. counts: the block's matmul counter (one dict per block and
    per pass: torchtitan counts forward and recompute apart so both passes agree)."""
    name = _op_name(func)
    if name not in SAVED_OPS or getattr(func, "namespace", "aten") != "aten":
        return False
    if name in MATMULS:
        key = "recompute" if recompute else "forward"
        counts[key] += 1
        return counts[key] % 2 == 1  # the 1st, 3rd, 5th... matmul of the block is kept
    return True


def _policy(counts, ctx, func, *args, **kwargs):
    from torch.utils.checkpoint import CheckpointPolicy

    keep = keeps(func, counts, recompute=ctx.is_recompute)
    return CheckpointPolicy.MUST_SAVE if keep else CheckpointPolicy.PREFER_RECOMPUTE


def context_fn():
    """torch.utils.checkpoint's context_fn: a fresh matmul counter for each checkpointed call."""
    from torch.utils.checkpoint import create_selective_checkpoint_contexts

    return create_selective_checkpoint_contexts(partial(_policy, defaultdict(int)))
