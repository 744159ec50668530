"""How the loss and the optimizer step are computed: two plan knobs (training.loss / loss_chunks and
training.optimizer_impl) that change memory and time but not the math.

- loss "standard": the model's own head and cross-entropy (`model(**batch).loss`): b*s*V logits, their
  fp32 upcast, the saved fp32 log_softmax and two fp32 b*s*V gradients.
- loss "chunked": the head and the loss run `loss_chunks` row chunks at a time and each chunk's logits
  are recomputed in backward (engines/chunked_loss.py; torchtune / Liger-Kernel's idea in plain
  PyTorch): only one chunk's c*V logits ever exist, at the price of the head's matmul run twice.
- optimizer_impl: torch AdamW's foreach (a full copy of the states as step scratch), single-tensor
  (one parameter at a time) or fused (one kernel, no scratch); auto = the engines' default (foreach
  on CUDA, single-tensor on CPU, DeepSpeed's FusedAdam where DeepSpeed builds the optimizer).
"""
from __future__ import annotations

from shardfit.errors import ShardfitError

LOSSES = ("standard", "chunked")
OPTIMIZER_IMPLS = ("auto", "foreach", "single", "fused")
DEFAULT_LOSS_CHUNKS = 8
# Families whose head the chunked loss does not reproduce: BERT's masked-LM head (unshifted labels, a
# transform before the decoder) and Gemma-2's final logit softcapping.
CHUNKED_UNSUPPORTED = {"bert": "a masked-LM head (unshifted labels)",
                       "gemma2": "final logit softcapping (tanh on the logits)"}


def parse_loss(text: str) -> tuple[str, int]:
    """`standard`, `chunked` or `chunked:N` -> (loss, chunks)."""
    raw = str(text).strip().lower()
    kind, _, count = raw.partition(":")
    if kind not in LOSSES or (count and kind != "chunked"):
        raise ShardfitError(f"--loss '{text}': use standard, chunked or chunked:N (N row chunks, e.g. chunked:8)")
    if not count:
        return kind, DEFAULT_LOSS_CHUNKS
    try:
        chunks = int(count)
    except ValueError:
        raise ShardfitError(f"--loss '{text}': N in chunked:N must be a whole number, e.g. chunked:8") from None
    if chunks < 1:
        raise ShardfitError(f"--loss '{text}': N in chunked:N must be at least 1")
    return kind, chunks


def kernel_fields(loss: str | None = None, optimizer_impl: str | None = None) -> dict:
    """Training fields from the --loss / --optimizer-impl flags (None: not given), validated."""
    changes = {}
    if loss is not None:
        changes["loss"], changes["loss_chunks"] = parse_loss(loss)
    if optimizer_impl is not None:
        impl = str(optimizer_impl).strip().lower()
        if impl not in OPTIMIZER_IMPLS:
            raise ShardfitError(f"--optimizer-impl '{optimizer_impl}' is not known: use one of {', '.join(OPTIMIZER_IMPLS)}")
        changes["optimizer_impl"] = impl
    return changes


def loss_label(loss: str, chunks: int) -> str:
    return "standard" if loss == "standard" else f"chunked:{chunks}"


def check_kernels(plan) -> None:
    """One line per bad value of training.loss / loss_chunks / optimizer_impl."""
    t = plan.training
    if t.loss not in LOSSES:
        raise ShardfitError(f"training.loss '{t.loss}' is not known: use standard or chunked (--loss chunked[:N])")
    if t.loss_chunks < 1:
        raise ShardfitError(f"training.loss_chunks must be at least 1, got {t.loss_chunks}")
    if t.optimizer_impl not in OPTIMIZER_IMPLS:
        raise ShardfitError(f"training.optimizer_impl '{t.optimizer_impl}' is not known: use one of "
                            f"{', '.join(OPTIMIZER_IMPLS)}")
    if t.loss == "chunked" and plan.model.family in CHUNKED_UNSUPPORTED:
        raise ShardfitError(f"training.loss chunked: {plan.model.name} has {CHUNKED_UNSUPPORTED[plan.model.family]}, "
                            "which the chunked loss does not reproduce: use loss standard")
    if t.optimizer_impl != "auto" and plan.strategy.is_deepspeed and plan.strategy.offload_optimizer:
        raise ShardfitError(f"training.optimizer_impl {t.optimizer_impl}: DeepSpeed optimizer offload runs its own CPU "
                            "Adam (DeepSpeedCPUAdam): use optimizer_impl auto")
    if t.optimizer_impl != "auto" and t.optimizer not in ("adamw", "sgd"):
        raise ShardfitError(f"training.optimizer_impl {t.optimizer_impl} is a torch AdamW/SGD choice; "
                            f"{t.optimizer} has its own kernel: use optimizer_impl auto")
