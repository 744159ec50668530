"""The plan's kernel choices (spec/kernels.py) in emitted scripts: the optimizer step's keyword and the
chunked cross-entropy, whose code is copied from the engines' own implementation (engines/chunked_loss.py,
between its markers) so a script trains with exactly what `shardfit train` runs."""
from __future__ import annotations

from pathlib import Path

from shardfit.spec.plan import Plan

ENGINE_CODE = Path(__file__).resolve().parents[1] / "engines" / "chunked_loss.py"
_BEGIN, _END = "# --- emitted scripts copy from here", "# --- end of the emitted part"


def chunked_loss_code() -> str:
    """engines/chunked_loss.py's torch-only part, as source text (read, not imported: emit has no torch)."""
    text = ENGINE_CODE.read_text()
    start = text.index("\n", text.index(_BEGIN)) + 1
    return text[start:text.index(_END)].rstrip() + "\n"


def optimizer_keywords(plan: Plan) -> str:
    """The torch.optim keyword for training.optimizer_impl (engines/base.optimizer_kernel), as source."""
    impl = plan.training.optimizer_impl
    return {"fused": ", fused=True", "foreach": ", foreach=True", "single": ", foreach=False"}.get(impl, "")


def script_fields(plan: Plan, indent: str = "    ", batch: str | None = None) -> dict:
    """Template fields of the single / FSDP scripts: optimizer keyword, loss line, head setup, loss code.
    batch: the name of the script's batch dict (input_ids, labels, attention_mask); None: `ids` only."""
    t = plan.training
    impl = t.optimizer_impl
    fields = {"optimizer_kwargs": optimizer_keywords(plan),
              "optimizer_note": f"# optimizer step: {impl} (shardfit plan training.optimizer_impl)" if impl != "auto"
              else "# optimizer step: torch's default (foreach on CUDA)",
              "loss_line": f"loss = model(**{batch}).loss / GRAD_ACCUM" if batch
              else "loss = model(input_ids=ids, labels=ids).loss / GRAD_ACCUM", "head_setup": "",
              "loss_code": ""}
    if t.loss == "chunked":
        inputs = batch or '{"input_ids": ids, "labels": ids}'
        fields["loss_line"] = f"loss = model_loss(model, {inputs}, head) / GRAD_ACCUM"
        fields["head_setup"] = "\n".join((
            f"# chunked cross-entropy: head + loss in {t.loss_chunks} row chunks, logits recomputed in backward",
            f"{indent}head = model.get_output_embeddings()",
            f"{indent}patch_head(head, {t.loss_chunks})"))
        fields["loss_code"] = ("\n\n# The chunked cross-entropy of shardfit's engines (engines/chunked_loss.py).\n"
                               + chunked_loss_code())
    return fields


def trainer_kernel_notes(plan: Plan) -> list[str]:
    """What the framework front-ends (HF Trainer, Accelerate, Lightning) cannot set from a config."""
    t = plan.training
    if t.loss != "chunked":
        return []
    return [f"TODO: the plan's loss is chunked ({t.loss_chunks} row chunks): set use_liger_kernel=True (HF Trainer; "
            "needs `pip install liger-kernel`, CUDA) or compute the loss with shardfit's chunked loss (written into "
            "`shardfit emit --format fsdp2|fsdp|single`); without it expect `shardfit plan --loss standard`'s memory"]


def optimizer_line(plan: Plan) -> str:
    """The optimizer a framework front-end's own script should build (Accelerate, Lightning)."""
    impl = plan.training.optimizer_impl
    if plan.training.optimizer != "adamw" or impl == "auto" or plan.strategy.is_deepspeed:
        return ""  # DeepSpeed builds its FusedAdam from the config's "optimizer" block
    return (f"optimizer step: build torch.optim.AdamW(params, ...{optimizer_keywords(plan)}) in the training script "
            f"(the plan's optimizer_impl {impl})")


def hf_optim(plan: Plan, default: str) -> tuple[str, list[str]]:
    """TrainingArguments.optim for the plan's AdamW implementation, and what HF cannot say."""
    impl = plan.training.optimizer_impl
    if plan.training.optimizer != "adamw":
        return default, []
    if impl == "fused":
        return "adamw_torch_fused", []
    if impl == "single":
        return "adamw_torch", ["HF Trainer has no single-tensor AdamW switch: adamw_torch runs torch's default "
                               "(foreach on CUDA, a full copy of the states as step scratch); the plan's single-tensor "
                               "step needs your own optimizer (Trainer(optimizers=(AdamW(..., foreach=False), None)))"]
    return "adamw_torch", []  # foreach, and auto: torch's default, foreach on CUDA
