"""What a zero-bubble pipeline schedule holds between a micro-batch's input gradient and its weight
gradient (torch.distributed.pipelining's ZB1P, ZB-V and DualPipeV). No torch here.

torch splits each backward in two (pipelining/_backward.py): `stage_backward_input` computes the
gradient of the stage's input with `retain_graph=True` and, through hooks, keeps the gradient arriving
at every autograd node where a weight meets the input's path (the output of each linear, each norm's
weight product, the head's logits); `stage_backward_weight` runs later, from those kept gradients, and
only then frees the graph. So a micro-batch waiting for its W keeps its saved activations (counted as
in flight: spec/parallelism.split_backward_points) and, beside them, one gradient per weight-consuming
op output: per token the widths below. The first stage's input (token ids) needs no gradient: torch
runs its whole backward at W, holding only the received output gradient (b x s x h) until then.
"""
from __future__ import annotations

from shardfit.spec.model_spec import ModelSpec
from shardfit.spec.parallelism import (SPLIT_BACKWARD_SCHEDULES, V_SCHEDULES, Layout, chunk_rank, rank_chunks,
                                       split_backward_points)


def block_output_widths(model: ModelSpec) -> int:
    """Per token, the summed widths of one block's weight-consuming op outputs: its linears (from the
    derived spec's own linears, or the family's q / k / v / o and MLP shapes), two norms, and under MoE
    the router and the top-k experts each token passes through (routed experts are fused tensors in
    recent transformers, not nn.Linear, so not in `linears`)."""
    h = model.hidden_size
    if model.derived and model.linears and model.num_layers:
        linear = sum(out * count for _, _, out, count in model.linears) // model.num_layers
    else:
        head_dim = model.head_dim or h // max(model.num_heads, 1)
        attention = (model.num_heads + 2 * (model.num_kv_heads or model.num_heads)) * head_dim + h
        mlp = (2 if model.mlp == "swiglu" else 1) * model.intermediate_size + h
        linear = attention + (0 if model.num_experts else mlp)
    moe = 0
    if model.num_experts:
        expert = (2 if model.mlp == "swiglu" else 1) * model.intermediate_size + h
        moe = model.num_experts + (max(model.experts_per_token, 1) + model.shared_experts) * expert
    return linear + moe + 2 * h


def weight_grad_inputs(model: ModelSpec, layers: int, holds_first: bool, holds_last: bool, tokens: int,
                       d: int, chunks: int) -> int:
    """Bytes one waiting micro-batch of one of the rank's `chunks` chunks keeps until its W: the
    rank's layers' op-output gradients (+ the final norm's and the logits' on the chunk with the head)
    shared over its chunks. A rank whose only chunk is the model's first keeps the received gradient."""
    if holds_first and chunks == 1:
        return tokens * model.hidden_size * d
    per_token = layers * block_output_widths(model) + ((model.hidden_size + model.vocab_size) if holds_last else 0)
    return tokens * per_token * d // chunks


def split_instants(layout: Layout, stage: int, rank_model: ModelSpec, layers: int, first: bool, last: bool,
                   tokens: int, d: int, per_micro: int, head: int, vocab: int) -> dict:
    """{phase: (micro-batches alive, bytes waiting for W, activation bytes freed)} of pipeline rank
    `stage` under a zero-bubble schedule ({} under the others): the frontier instant
    (spec/parallelism.split_backward_points) that holds the most, with `per_micro` bytes of
    activations per alive micro-batch (of the rank's layers) and `head` of them in the head's part;
    `vocab`: the model's whole vocabulary (the logits' width).
    Their input-gradient pass detaches the stage output, which frees what sits above the topmost op
    with a weight: on the chunk with the head, the kept logits and the loss's fp32 log-softmax
    (measured, tiny-llama pp 2 ZB1P: one micro-batch's logits and log-softmax alive of two). In a V the
    rank with the head (rank 0) peaks holding 2p - 1 micro-batches of its first chunk and one of its
    last (torch's action list): the head's activations count once, not per alive micro-batch."""
    if layout.pp == 1 or layout.schedule not in SPLIT_BACKWARD_SCHEDULES:
        return {}
    v = layout.virtual
    per_wait = weight_grad_inputs(rank_model, layers, first, last, tokens, d, v)
    above_head = tokens * vocab * (4 + d) // (layout.tp if layout.loss_parallel else 1) if last else 0
    above_head //= v  # the waiting micro-batches' share on the head's chunk
    head = head if last and layout.schedule in V_SCHEDULES else 0
    out = {}
    for phase in ("forward", "backward"):
        alive, count = max(split_backward_points(layout, stage, phase),
                           key=lambda pt: pt[0] / v * per_micro + pt[1] * (per_wait - above_head))
        out[phase] = alive / v, count * per_wait, count * above_head + int((alive / v - 1) * head)
    return out


def kept_input_grads(layout: Layout, stage: int, boundary: int) -> int:
    """Under a zero-bubble schedule, what each of the rank's chunks fed from another rank keeps past the
    step: the gradient of every micro-batch's received input (`boundary` bytes each). Measured
    (tiny-llama, pp 2, m 4): m x b*s*h*4 more after the step per such chunk (ZB1P v 1 and 2, ZB-V rank
    0; ZB-V rank 1, whose second chunk is fed locally, keeps 1.36 x that; DualPipeV 0.27 x on rank 0)."""
    if layout.schedule not in SPLIT_BACKWARD_SCHEDULES:
        return 0
    mine = rank_chunks(stage, layout.pp, layout.virtual, layout.schedule)
    remote = sum(1 for k in mine if k and chunk_rank(k - 1, layout.pp, layout.virtual, layout.schedule) != stage)
    return layout.microbatches * boundary * remote
