"""The loss's bytes under training.loss = chunked: what engines/chunked_loss.py allocates, tensor by
tensor (measured against real CPU steps in tests/measure/test_kernels_measured.py).

With c = ceil(b*s / chunks) rows per chunk, d the compute dtype's bytes (4 for fp32, else 2):
- saved for backward: the head input (counted with the head's items, as for the standard loss), an
  fp32 logsumexp per row (4*b*s) and the valid-label count (8 B). The shifted int64 labels are made
  before the model's forward runs, so they are counted with the loss inputs, not the activations;
  nothing of size b*s*V is saved (the standard loss saves its fp32 log_softmax, 4*b*s*V).
- forward, one chunk at a time: its c*V logits in the compute dtype plus their fp32 copy (one fp32
  tensor when d = 4), and three c-row vectors (gathered target logit, row max, loss terms);
- loss inputs: the batch's int64 input ids and labels and the shifted labels (24*b*s), plus under
  autocast the fp32 final-norm output the model's forward still holds (as for the standard loss);
- backward: the head input's gradient (b*s*h*d), the weight's gradient (V*h in the weight's dtype,
  allocated up front and accumulated chunk by chunk), and per chunk the recomputed logits with their
  fp32 softmax (c*V*(d+4), c*V*4 in fp32) and a c-row mask. Under autocast the weight is a 16-bit cast,
  so its gradient is a temporary until autograd casts it back to the fp32 .grad; on single / DDP it
  is the .grad itself; DeepSpeed's hooks move it into a bucket (a temporary); FSDP's root gradient is
  counted by its buffers from the start of backward.
"""
from __future__ import annotations

from shardfit.spec.plan import is_deepspeed_kind


def chunked_loss_bytes(model, regime: str, kind: str, micro_batch: int, seq: int, chunks: int,
                       head_trains: bool, a_head: int, term=None) -> tuple[int, int, int, int, int]:
    """(head activations, loss forward temporaries, loss inputs, loss backward temporaries, loss
    backward gradients) per rank, replacing the standard loss's figures; `term` records them (explain)."""
    tokens = micro_batch * seq
    vocab, hidden = model.vocab_size, model.hidden_size
    d = 4 if regime == "fp32" else 2
    rows = -(-tokens // max(chunks, 1))
    chunk = rows * vocab * (d + (4 if d != 4 else 0))
    # Source: transformers ForCausalLMLoss saves log_softmax in fp32 (4*V per token) and the shifted
    # labels (8 per token); the chunked loss saves a logsumexp per row and the count instead.
    saved = a_head - tokens * (4 * vocab + 8) + 4 * tokens + 8
    forward = chunk + 12 * rows
    inputs = 24 * tokens + (4 * tokens * hidden if regime == "autocast" else 0)
    grad_weight = vocab * hidden * d if head_trains else 0
    # The weight's gradient: the .grad itself on single / DDP; a temporary under autocast (a 16-bit cast's
    # gradient) and under DeepSpeed (its hooks move .grad into a bucket); FSDP counts it with its buffers.
    as_grad = regime != "autocast" and kind in ("single", "ddp")
    temporary = regime == "autocast" or is_deepspeed_kind(kind)
    backward = chunk + 4 * rows + tokens * hidden * d + 24 * tokens + (grad_weight if temporary else 0)
    grads = grad_weight if as_grad else 0
    out = int(saved), int(forward), int(inputs), int(backward), int(grads)
    if term is not None:
        record_terms(term, model, micro_batch, seq, chunks, *out)
    return out


def record_terms(term, model, micro_batch: int, seq: int, chunks: int, a_head: int, forward: int, inputs: int,
                 backward: int, grads: int) -> None:
    """The loss's explain terms under the chunked loss (same names as the standard loss's)."""
    rows = -(-micro_batch * seq // max(chunks, 1))
    source = "shardfit engines/chunked_loss.py: head + cross-entropy per row chunk, logits recomputed in backward"
    inputs_of = {"V": model.vocab_size, "h": model.hidden_size, "tokens": micro_batch * seq, "chunks": chunks,
                 "rows_per_chunk": rows}
    term("activations.head", a_head, "b*s*(final norm + 4 (fp32 logsumexp)) + 8 + rotary", inputs_of, source)
    term("temporaries.logits_and_upcast", forward, "c*V*d + c*V*4 when logits are 16-bit (c = ceil(b*s/chunks))",
         inputs_of, source)
    term("temporaries.loss_inputs", inputs, "24*b*s (+ b*s*h*4 under autocast)", inputs_of, source)
    term("temporaries.loss_backward", backward + grads,
         "c*V*(d+4) + b*s*h*d + V*h*d (the head's weight gradient, accumulated over the chunks)", inputs_of, source)
