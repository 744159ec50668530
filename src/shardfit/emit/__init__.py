"""Fourth stage: write a Plan as the configuration a real tool accepts (analytic; no torch).

Each format is one function `Plan, EmitOptions -> Emitted` (file name -> text, plus notes)."""
from __future__ import annotations

from functools import partial

from shardfit.emit.accelerate import emit_accelerate
from shardfit.emit.common import Emitted, EmitOptions, write_files
from shardfit.emit.deepspeed import emit_deepspeed
from shardfit.emit.fsdp import emit_fsdp
from shardfit.emit.launch import emit_deepspeed_launcher, emit_slurm, emit_torchrun
from shardfit.emit.trainers import emit_hf_trainer, emit_lightning
from shardfit.errors import ShardfitError
from shardfit.spec.plan import Plan

FORMATS = {
    "deepspeed": emit_deepspeed,
    "accelerate": emit_accelerate,
    "fsdp": partial(emit_fsdp, version=1),
    "fsdp2": partial(emit_fsdp, version=2),
    "lightning": emit_lightning,
    "hf-trainer": emit_hf_trainer,
    "torchrun": emit_torchrun,
    "deepspeed-launcher": emit_deepspeed_launcher,
    "slurm": emit_slurm,
}


def emit(plan: Plan, fmt: str, options: EmitOptions | None = None) -> Emitted:
    key = str(fmt).strip().lower().replace("_", "-")
    key = {"ds": "deepspeed", "hf": "hf-trainer", "trainer": "hf-trainer", "fsdp1": "fsdp",
           "sbatch": "slurm", "ds-launcher": "deepspeed-launcher"}.get(key, key)
    if key not in FORMATS:
        raise ShardfitError(f"unknown format '{fmt}': use one of {', '.join(FORMATS)}")
    return FORMATS[key](plan, options or EmitOptions())


__all__ = ["FORMATS", "EmitOptions", "Emitted", "emit", "write_files"]
