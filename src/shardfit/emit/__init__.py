"""Fourth stage: write a Plan as the configuration a real tool accepts (analytic; no torch).

Each format is one function `Plan, EmitOptions -> Emitted` (file name -> text, plus notes)."""
from __future__ import annotations

from dataclasses import replace
from functools import partial

from shardfit.emit.accelerate import emit_accelerate
from shardfit.emit.common import Emitted, EmitOptions, write_files
from shardfit.emit.ddp import emit_ddp
from shardfit.emit.deepspeed import emit_deepspeed
from shardfit.emit.fsdp import emit_fsdp
from shardfit.emit.launch import emit_deepspeed_launcher, emit_slurm, emit_torchrun
from shardfit.emit.placeholders import mark_placeholders
from shardfit.emit.single import emit_single
from shardfit.emit.torchtitan import emit_torchtitan
from shardfit.emit.trainers import emit_hf_trainer, emit_lightning
from shardfit.errors import ShardfitError
from shardfit.spec.engine_rules import train_layout_error
from shardfit.spec.parallelism import resolve
from shardfit.spec.plan import Plan, is_selective_ac

FORMATS = {
    "deepspeed": emit_deepspeed,
    "accelerate": emit_accelerate,
    "fsdp": partial(emit_fsdp, version=1),
    "fsdp2": partial(emit_fsdp, version=2),
    "ddp": emit_ddp,
    "single": emit_single,
    "lightning": emit_lightning,
    "hf-trainer": emit_hf_trainer,
    "torchrun": emit_torchrun,
    "deepspeed-launcher": emit_deepspeed_launcher,
    "slurm": emit_slurm,
    "torchtitan": emit_torchtitan,
}


def emit(plan: Plan, fmt: str, options: EmitOptions | None = None) -> Emitted:
    key = str(fmt).strip().lower().replace("_", "-")
    key = {"ds": "deepspeed", "hf": "hf-trainer", "trainer": "hf-trainer", "fsdp1": "fsdp",
           "sbatch": "slurm", "ds-launcher": "deepspeed-launcher"}.get(key, key)
    if key not in FORMATS:
        raise ShardfitError(f"unknown format '{fmt}': use one of {', '.join(FORMATS)}")
    options = options or EmitOptions()
    if not plan.parallelism.is_default:
        _check_layout_format(plan, key, options)
    emitted = FORMATS[key](plan, options)
    if not plan.parallelism.is_default:
        emitted = replace(emitted, notes=emitted.notes + (f"layout {resolve(plan).describe()}",))
    if key in _NO_SELECTIVE_SETTING and is_selective_ac(plan.training.activation_checkpointing):
        emitted = replace(emitted, notes=emitted.notes + (_SELECTIVE_NOTE.format(fmt=key),))
    return mark_placeholders(emitted, plan)


# Formats that carry a tp x cp x pp layout (issue 14): accelerate's ParallelismConfig (tp, cp; no pp),
# torchtitan's launch line (all of them) and the launch lines around your own script; every other
# format writes a data-parallel setup.
_LAYOUT_FORMATS = ("accelerate", "torchtitan", "torchrun", "slurm")


def _check_layout_format(plan: Plan, key: str, options: EmitOptions) -> None:
    layout = resolve(plan).describe()
    par = plan.parallelism
    if key == "fsdp2" and par.pp == 1 and par.cp == 1 and par.ep == 1:
        return  # the FSDP2 x TP script (emit/fsdp.py)
    if key not in _LAYOUT_FORMATS:
        raise ShardfitError(f"--format {key} writes a data-parallel setup, but this plan is {layout}: use --format "
                            "torchtitan (every layout), fsdp2 (FSDP2 x TP, without pp / cp / ep), accelerate (its ParallelismConfig: tp, cp) and "
                            "--format torchrun / slurm with --entry your script; or re-run fit with --data-parallel-only")
    if key in ("torchrun", "slurm") and options.entry is None and train_layout_error(plan):
        raise ShardfitError(f"this plan is {layout}: {train_layout_error(plan)}; or give --entry your training script "
                            "(e.g. `accelerate launch` reading `shardfit emit --format accelerate`)")


# Formats whose tool has no per-op selective checkpointing setting: they checkpoint whole blocks.
_NO_SELECTIVE_SETTING = ("accelerate", "hf-trainer", "lightning", "deepspeed")
_SELECTIVE_NOTE = ("{fmt} has no per-op selective checkpointing setting, so this config checkpoints whole blocks "
                   "(more recompute, less memory than the plan's selective); to run the plan's policy, pass "
                   "context_fn=shardfit.sac.context_fn to torch.utils.checkpoint (activation_checkpointing_kwargs "
                   "/ checkpoint_wrapper) in your code, as `shardfit emit --format fsdp2` does")


__all__ = ["FORMATS", "EmitOptions", "Emitted", "emit", "write_files"]
