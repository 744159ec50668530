"""Chunked linear + cross-entropy: the output head and the loss run one row chunk at a time, and each
chunk's logits are recomputed in backward, so no b*s*V tensor ever exists (torchtune's chunked loss /
Liger-Kernel's fused linear cross-entropy, in plain PyTorch: it runs on CPU and under every engine).

How it plugs in: `install` swaps the forward of the model's output head (`get_output_embeddings()`,
the same module and parameter, so state dicts, FSDP units and ZeRO-3 hooks are unchanged);
`model_loss` calls the model without labels and hands the shifted labels to that head, which returns
the mean loss instead of the logits. The head runs inside the model's forward, so FSDP's root gather,
DeepSpeed's module hooks and the profiler's phases see what they see for the standard loss.

What it allocates (estimate/chunked_loss.py counts exactly these; c = ceil(b*s / chunks) rows):
- saved for backward: the head input (as the standard head saves it), the shifted int64 labels
  (b*s) and an fp32 logsumexp per row (b*s);
- forward, per chunk: the c*V logits in the compute dtype and their fp32 copy (one tensor when fp32),
  then in-place max-subtract / exp / sum;
- backward: the head input's gradient (b*s*h) and the weight's (V*h, the weight's dtype) up front;
  per chunk the recomputed logits, their fp32 softmax-minus-one-hot (in place) and its cast back.
"""
from __future__ import annotations

from shardfit.errors import ShardfitError

# --- emitted scripts copy from here to the end marker (emit/kernels.py): torch only, no shardfit imports.
import types

import torch
import torch.nn.functional as F

IGNORE_INDEX = -100  # transformers' ForCausalLMLoss / torch's cross_entropy default
_CHUNKS, _LABELS = "_shardfit_loss_chunks", "_shardfit_loss_labels"


def _logits(hidden, weight, bias):
    # torch.mm, not F.linear: DeepSpeed ZeRO-3 replaces F.linear with its own autograd function.
    return torch.mm(hidden, weight.t()) if bias is None else torch.addmm(bias, hidden, weight.t())


def _wide(dtype):
    """The softmax's dtype: fp32 for 16-bit logits, the logits' own otherwise (fp32, fp64)."""
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


def _rows(total: int, chunks: int):
    step = -(-total // max(chunks, 1))
    return [slice(start, start + step) for start in range(0, total, step)]


class ChunkedLinearCrossEntropy(torch.autograd.Function):
    """mean over labels != -100 of cross_entropy(hidden @ weight.T + bias, labels); hidden (T, h), labels (T,)."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, labels, chunks):
        wide = _wide(hidden.dtype)
        lse = torch.empty(hidden.shape[0], dtype=wide, device=hidden.device)
        total = torch.zeros((), dtype=wide, device=hidden.device)
        with torch.autocast(hidden.device.type, enabled=False):
            for part in _rows(hidden.shape[0], chunks):
                logits = _logits(hidden[part], weight, bias).to(wide)  # the 16-bit logits go at once
                target = labels[part]
                picked = logits.gather(1, target.clamp(min=0).unsqueeze(1)).squeeze(1)
                top = logits.amax(1)
                lse[part] = logits.sub_(top.unsqueeze(1)).exp_().sum(1).log_().add_(top)
                total += (lse[part] - picked).masked_fill_(target == IGNORE_INDEX, 0).sum()
                del logits, picked, top  # before the next chunk's logits exist
        count = (labels != IGNORE_INDEX).sum().clamp(min=1)
        ctx.save_for_backward(hidden, weight, bias, labels, lse, count)
        ctx.chunks = chunks
        return total / count

    @staticmethod
    def backward(ctx, grad):
        hidden, weight, bias, labels, lse, count = ctx.saved_tensors
        wide = _wide(hidden.dtype)
        scale = grad.to(wide) / count
        grad_hidden = torch.empty_like(hidden) if ctx.needs_input_grad[0] else None
        grad_weight = torch.zeros_like(weight) if ctx.needs_input_grad[1] else None
        grad_bias = torch.zeros_like(bias) if bias is not None and ctx.needs_input_grad[2] else None
        with torch.autocast(hidden.device.type, enabled=False):
            for part in _rows(hidden.shape[0], ctx.chunks):
                rows = hidden[part]
                probs = _logits(rows, weight, bias).to(wide)  # recomputed: the head's matmul a second time
                probs.sub_(lse[part].unsqueeze(1)).exp_()  # softmax
                target = labels[part]
                keep = (target != IGNORE_INDEX).to(wide)
                probs.scatter_add_(1, target.clamp(min=0).unsqueeze(1), -keep.unsqueeze(1))  # minus one-hot
                probs.mul_((keep * scale).unsqueeze(1))
                grad_logits = probs.to(rows.dtype)
                del probs
                if grad_hidden is not None:
                    torch.mm(grad_logits, weight, out=grad_hidden[part])
                if grad_weight is not None:
                    grad_weight.addmm_(grad_logits.t(), rows)
                if grad_bias is not None:
                    grad_bias.add_(grad_logits.sum(0))
                del grad_logits
        return grad_hidden, grad_weight, grad_bias, None, None


def chunked_linear_cross_entropy(hidden, weight, bias, labels, chunks: int):
    return ChunkedLinearCrossEntropy.apply(hidden, weight, bias, labels, chunks)


def shift_labels(labels):
    """transformers' ForCausalLMLoss shift: position t predicts token t+1, the last one nothing."""
    return F.pad(labels, (0, 1), value=IGNORE_INDEX)[:, 1:].reshape(-1)


def _head_forward(self, hidden):
    labels = getattr(self, _LABELS)
    if labels is None:  # generation, evaluation through the model's own loss: the plain head
        return F.linear(hidden, self.weight, self.bias)
    device = hidden.device.type
    # Under torch.autocast the standard head runs in the autocast dtype (the weight's cast saved for
    # backward); otherwise in the weight's dtype (FSDP MixedPrecision / DeepSpeed / pure bf16 / fp32).
    dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else self.weight.dtype
    rows = hidden.reshape(-1, hidden.shape[-1]).to(dtype)
    bias = None if self.bias is None else self.bias.to(dtype)
    return chunked_linear_cross_entropy(rows, self.weight.to(dtype), bias, labels, getattr(self, _CHUNKS))


def patch_head(head, chunks: int) -> None:
    """The head computes the chunked loss when `model_loss` hands it labels, its own logits otherwise."""
    setattr(head, _CHUNKS, int(chunks))
    setattr(head, _LABELS, None)
    head.forward = types.MethodType(_head_forward, head)


def chunked_head(model):
    """The head `patch_head` patched, or None (the standard loss)."""
    return next((m for m in model.modules() if hasattr(m, _CHUNKS)), None)


def model_loss(model, batch: dict, head=None):
    """The training loss of `model` on `batch` (input_ids, labels, ...): the model's own
    (`model(**batch).loss`) for the standard loss, the chunked head's when `head` is given."""
    if head is None:
        return model(**batch).loss
    inputs = {k: v for k, v in batch.items() if k != "labels"}
    setattr(head, _LABELS, shift_labels(batch["labels"]))
    try:
        out = model(**inputs)
    finally:
        setattr(head, _LABELS, None)
    return out.logits if hasattr(out, "logits") else out[0]
# --- end of the emitted part


def install(model, chunks: int) -> None:
    """Make the model's output head compute the chunked loss when `model_loss` gives it labels; one
    clear line for a model whose head or loss it does not reproduce."""
    inner = model.get_base_model() if hasattr(model, "get_base_model") else model  # under peft's wrapper
    head = inner.get_output_embeddings() if hasattr(inner, "get_output_embeddings") else None
    config = getattr(inner, "config", None)
    if not isinstance(head, torch.nn.Linear):
        raise ShardfitError(f"loss chunked needs an output head that is an nn.Linear; {type(inner).__name__} has "
                            f"{type(head).__name__}: use loss standard")
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    causal = type(inner).__name__ in set(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values())
    if getattr(config, "final_logit_softcapping", None) or not causal:
        raise ShardfitError(f"loss chunked reproduces a causal LM's shifted cross-entropy without logit "
                            f"softcapping; {type(inner).__name__} is not one: use loss standard")
    patch_head(head, chunks)
