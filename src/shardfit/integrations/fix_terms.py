"""An OOM fix (a `plan.with_changes` argument) said in the user's own framework: TrainingArguments
fields, Lightning Trainer arguments, or Accelerate / loop changes.

The strategy changes come from emit (the same DeepSpeed JSON, FSDP config and Lightning strategy
`shardfit emit` writes): a ZeRO fix is written next to the report as a DeepSpeed JSON to pass on.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

from shardfit.emit.accelerate import emit_accelerate
from shardfit.emit.common import EmitOptions
from shardfit.emit.deepspeed import deepspeed_config
from shardfit.emit.trainers import _HF_OPTIM, _LIGHTNING_PRECISION, training_arguments

FRAMEWORKS = ("transformers", "lightning", "accelerate")


def _write_json(data: dict, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    tmp.write_text(json.dumps(data, indent=2) + "\n")
    os.replace(tmp, path)
    return path


def _file_label(plan) -> str:
    return plan.strategy.label.replace(":", "-").replace("+", "-")


def _trainer_ac_field() -> str:
    """transformers 5.x renamed gradient_checkpointing to activation_checkpointing (the old name warns)."""
    try:
        import dataclasses

        from transformers import TrainingArguments

        names = {f.name for f in dataclasses.fields(TrainingArguments)}
    except ImportError:
        return "gradient_checkpointing"
    return "activation_checkpointing" if "activation_checkpointing" in names else "gradient_checkpointing"


def trainer_arguments(changes: dict, changed_plan, out_dir) -> dict:
    """TrainingArguments fields for one change (what to pass instead of what was passed)."""
    args: dict = {}
    training = changes.get("training", {})
    if "micro_batch" in training:
        args["per_device_train_batch_size"] = training["micro_batch"]
    if "grad_accum" in training:
        args["gradient_accumulation_steps"] = training["grad_accum"]
    if "activation_checkpointing" in training:
        name = _trainer_ac_field()
        args[name] = training["activation_checkpointing"] != "none"
        args[f"{name}_kwargs"] = {"use_reentrant": False}
    if "precision" in training:
        args["bf16"] = changed_plan.training.precision.startswith("bf16")
        args["fp16"] = changed_plan.training.precision == "fp16"
    if "optimizer" in training:
        args["optim"] = _HF_OPTIM[training["optimizer"]]
    if "strategy" in changes:
        s = changed_plan.strategy
        if s.is_deepspeed:
            path = _write_json(deepspeed_config(changed_plan), Path(out_dir) / f"shardfit-fix-{_file_label(changed_plan)}.json")
            args["deepspeed"] = str(path)
        elif s.kind in ("fsdp", "fsdp2"):
            emitted, _ = training_arguments(changed_plan, EmitOptions(out_dir=str(out_dir)))
            args["fsdp"], args["fsdp_config"] = emitted["fsdp"], emitted["fsdp_config"]
    return args


def _loop_terms(training: dict, changed_plan, keys: dict, ac_note: str, precision: str) -> dict:
    """The batch / accumulation / checkpointing / precision / optimizer changes of a loop the user
    writes (Lightning, Accelerate): `keys` names where each goes in that framework."""
    args: dict = {}
    if "micro_batch" in training:
        args["DataLoader.batch_size"] = training["micro_batch"]
    if "grad_accum" in training:
        args[keys["grad_accum"]] = training["grad_accum"]
    if "activation_checkpointing" in training:
        args["note"] = ac_note
    if "precision" in training:
        args[keys["precision"]] = precision
    if "optimizer" in training:
        optimizer = training["optimizer"]
        args[keys["optimizer"]] = "bitsandbytes.optim.AdamW8bit" if optimizer == "adamw8bit" else optimizer
    return args


def lightning_arguments(changes: dict, changed_plan, out_dir) -> dict:
    """Lightning Trainer / DataLoader arguments for one change (strategy given as Python source)."""
    args = _loop_terms(changes.get("training", {}), changed_plan,
                       {"grad_accum": "accumulate_grad_batches", "precision": "precision",
                        "optimizer": "configure_optimizers"},
                       "model.gradient_checkpointing_enable() in configure_model (a transformers model), or "
                       "FSDPStrategy(activation_checkpointing_policy={Block})",
                       _LIGHTNING_PRECISION[changed_plan.training.precision])
    if "strategy" in changes:
        s = changed_plan.strategy
        if s.is_deepspeed:
            path = _write_json(deepspeed_config(changed_plan), Path(out_dir) / f"shardfit-fix-{_file_label(changed_plan)}.json")
            args["strategy"] = f'DeepSpeedStrategy(config="{path}")'
        elif s.kind == "fsdp":
            args["strategy"] = (f'FSDPStrategy(sharding_strategy="{s.sharding.upper()}", auto_wrap_policy={{'
                                f'{changed_plan.model.block_class}}}, cpu_offload={bool(s.offload_params)})')
        elif s.kind == "fsdp2":
            args["strategy"] = "ModelParallelStrategy() with fully_shard per block in configure_model"
    return args


def accelerate_arguments(changes: dict, changed_plan, out_dir) -> dict:
    """Accelerator / DataLoader / launch changes for a custom Accelerate loop."""
    args = _loop_terms(changes.get("training", {}), changed_plan,
                       {"grad_accum": "Accelerator.gradient_accumulation_steps",
                        "precision": "Accelerator.mixed_precision", "optimizer": "optimizer"},
                       "model.gradient_checkpointing_enable({'use_reentrant': False}) before accelerator.prepare",
                       {"bf16": "bf16", "bf16-pure": "bf16", "fp16": "fp16"}.get(changed_plan.training.precision, "no"))
    if "strategy" in changes:
        emitted = emit_accelerate(changed_plan, EmitOptions(out_dir=str(out_dir)))
        path = Path(out_dir) / f"shardfit-fix-{_file_label(changed_plan)}.yaml"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(emitted.main)
        args["accelerate launch --config_file"] = str(path)
    return args


_TRANSLATORS = {"transformers": trainer_arguments, "lightning": lightning_arguments, "accelerate": accelerate_arguments}


def in_framework_terms(framework: str, changes: dict, changed_plan, out_dir) -> dict:
    return _TRANSLATORS[framework](changes, changed_plan, out_dir)


def format_arguments(framework: str, args: dict) -> str:
    """`per_device_train_batch_size=2, gradient_accumulation_steps=4` (TrainingArguments keywords) or
    `key: value` pairs for the others."""
    if framework == "transformers":
        return ", ".join(f"{k}={v!r}" for k, v in args.items() if not k.endswith("checkpointing_kwargs"))
    # "note": free text; a key with a space is a command and its argument; the rest are keywords.
    return ", ".join(str(v) if k == "note" else f"{k} {v}" if " " in k else f"{k}={v}" for k, v in args.items())
