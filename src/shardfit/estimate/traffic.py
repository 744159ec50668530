"""Activation bytes a micro-batch moves through device memory: what the step-time model charges the
memory-bound kernels (norms, activations, softmax, dropout, the loss) with. Analytic; no torch.

The bytes are the estimator's own: the tensors the forward saves for backward, at the real dtypes of
the plan's precision regime, with eager attention's b·h·s² scores and the loss' fp32 upcast where the
code really makes them. Each saved byte crosses memory four times over a step: written in forward,
read in backward, and its gradient (the same size) written and read in backward. Activation
checkpointing writes the recomputed part once more and reads it once more. Tensors a layer makes
and drops (eager attention's intermediate scores, backward's working set) cross it twice.
"""
from __future__ import annotations

from shardfit.estimate import activations as act
from shardfit.estimate import temporaries as tmp
from shardfit.estimate.step_activations import precision_regime, saved_activation_bytes
from shardfit.spec.plan import is_selective_ac, parse_activation_checkpointing

# written in forward + read in backward + gradient written + gradient read
TOUCHES_PER_SAVED_BYTE = 4
# a tensor made and consumed inside one layer: written once, read once
TOUCHES_PER_TRANSIENT_BYTE = 2
# a recomputed byte is written again in backward and read again by its consumer
TOUCHES_PER_RECOMPUTED_BYTE = 2


def micro_batch_traffic_bytes(plan) -> int:
    """Bytes the memory-bound kernels of one micro-batch move on one rank (0 without model shapes)."""
    model, t = plan.model, plan.training
    if not model.has_shape or not model.num_layers:
        return 0
    regime = precision_regime(t.precision, plan.strategy.kind, t.lora)
    prof = act.activation_profile(model, regime, t.attention, t.lora, seq=t.seq_len)
    tokens, seq = t.micro_batch * t.seq_len, t.seq_len
    blocks, head, _ = saved_activation_bytes(prof, tokens, seq, model.num_layers, 0)
    # The loss' fp32 log_softmax and its b·s·V gradients are not saved activations but move as much.
    loss = tmp.loss_forward_bytes(tokens, prof.loss_fwd_temp) + tmp.loss_backward_bytes(tokens, prof.loss_bwd_temp)
    saved = blocks + head + loss
    # Tensors made and dropped inside a layer (eager attention's scaled / masked / fp32 scores, the
    # block's backward working set: one gradient per saved input) are written once and read once.
    transient = model.num_layers * (prof.attn_fwd_temp_quad * tokens * seq + prof.bwd_work * tokens
                                    + prof.bwd_work_quad * tokens * seq)
    every = parse_activation_checkpointing(t.activation_checkpointing)
    recomputed = 0
    if every:
        share = act.checkpointed_blocks(model.num_layers, every) / model.num_layers
        # Per-op SAC keeps the matmul outputs: about half of a block's saved bytes are recomputed.
        recomputed = int(blocks * share * (0.5 if is_selective_ac(t.activation_checkpointing) else 1.0))
    return int(TOUCHES_PER_SAVED_BYTE * saved + TOUCHES_PER_TRANSIENT_BYTE * transient
               + TOUCHES_PER_RECOMPUTED_BYTE * recomputed)
