"""The head of a tensor-parallel rank: the logits either stay a V/tp shard under torch's loss_parallel
(the engines' default) or are gathered by transformers' `colwise_gather_output`; what each adds to the
rank's estimate beside the rank-local model's terms (estimate/model_parallel.py). No torch here."""
from __future__ import annotations

from shardfit.estimate.result import Estimate
from shardfit.spec.model_spec import ModelSpec
from shardfit.spec.parallelism import Layout
from shardfit.spec.plan import is_selective_ac


def _shard_rows(vocab: int, tp: int) -> int:
    return -(-vocab // tp)


def loss_parallel_scratch(vocab: int, layout: Layout, tokens: int) -> int:
    """Bytes loss_parallel adds at the loss of the last stage. torch computes the log-softmax of the
    V/tp logits shard in steps, the max and the sum of exponentials all-reduced over tp: the shifted
    shard (fp32) lives beside the exponentials and the result, one shard more than a fused
    log-softmax, at the loss and again in its backward. Measured (FSDP2 x TP, 4 CPU ranks,
    tiny-llama): forward temporaries +83,472 B over the rank-local loss in fp32 and bf16, one shard
    being 81,920."""
    if layout.tp == 1 or not layout.loss_parallel:
        return 0
    return tokens * _shard_rows(vocab, layout.tp) * 4


def scratch_phases(activation_checkpointing: str) -> tuple[str, ...]:
    """Where the shard's scratch is at the peak: under per-op selective checkpointing the backward peaks
    in the top block's recompute, after the loss's backward (measured: +8.1% with it there, +3.9%
    without)."""
    return ("forward",) if is_selective_ac(activation_checkpointing) else ("forward", "backward")


def loss_parallel_backward(forward: dict, vocab: int, layout: Layout, tokens: int, d: int) -> dict:
    """Without checkpointing the backward peaks as loss_parallel's backward starts: the logits' gradient
    (one shard in their dtype) computed while every forward tensor is still alive (measured, FSDP2 x
    TP: backward activations 1,869,332 B = the forward's, temporaries the forward's + 83,572 in fp32,
    + 42,612 in bf16; a shard 81,920 / 40,960)."""
    return {**forward, "temporaries": forward["temporaries"] + tokens * _shard_rows(vocab, layout.tp) * d}


def logits_gather_instant(est: Estimate, forward: dict, rank_model: ModelSpec, tokens: int, d: int, tp: int,
                           kept: int = 0, sharded: int = 0) -> dict:
    """transformers' `colwise_gather_output` head: the forward peaks while the logits are gathered --
    the local V/tp shard, DTensor's all-gather buffer and the full logits are live, the loss has not
    saved its fp32 log_softmax or labels yet. The larger of that instant and the loss's. `kept`: the
    pipeline's kept logits of this micro-batch, counted in `forward`'s activations, which at the
    gather are the full logits being built (the temporaries here), not a second copy. `sharded`: what
    sequence parallel took off this micro-batch's activations."""
    at_loss = est.term("activations.blocks").bytes + est.term("activations.head").bytes - sharded
    if forward["activations"] < at_loss - tokens * rank_model.hidden_size * 4:
        return forward  # the peak is inside a block (checkpointing), not at the loss
    vocab = rank_model.vocab_size
    # Measured (4 CPU ranks): run to run, the gather's staging buffers are freed before or after the
    # loss saves its log_softmax; the worst case keeps both (pp 2 x tp 2, last stage: 2,584,756 B
    # measured, this instant 2,575,872).
    both = {**forward, "activations": forward["activations"] - kept,
            "temporaries": forward["temporaries"] - est.term("temporaries.loss_inputs").bytes
            + tokens * -(-vocab // tp) * d + tokens * vocab * d}
    return both if sum(both.values()) > sum(forward.values()) else forward
