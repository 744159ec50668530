"""Turn a Plan file plus `shardfit train`'s flags into the Plan the workers run (the relaunch under
torchrun is supervise.relaunch, through the one launcher: shardfit/launcher.py)."""
from __future__ import annotations

import os
from pathlib import Path

from shardfit.errors import ShardfitError
from shardfit.estimate.lora_targets import with_default_targets
from shardfit.runtime_env import local_world_size
from shardfit.spec.fields import lora_section
from shardfit.spec.models import load_model_spec
from shardfit.spec.parallelism import schedule_fixed_chunks
from shardfit.spec.plan import parse_strategy, plan_from_dict
from shardfit.spec.planfile import read_plan_data
from shardfit.spec.kernels import kernel_fields
from shardfit.train.flags import TrainFlags

# Without a plan file: the tiny preset on CPU, fp32, a few steps, so `shardfit train` finishes
# in well under a minute on a fresh machine.
QUICK_DEFAULTS = {
    "model": "tiny-llama",
    "strategy": {"kind": "fsdp2"},
    "training": {"micro_batch": 4, "seq_len": 128, "grad_accum": 1, "precision": "fp32"},
    "schedule": {"steps": 20, "lr": 3e-3, "warmup_steps": 2, "log_every": 5, "eval_every": 10, "save_every": 10,
                 "keep_checkpoints": 2},
}


def inside_launch() -> bool:
    return "LOCAL_RANK" in os.environ and "WORLD_SIZE" in os.environ


def read_plan_dict(path: str | None) -> dict:
    if path is None:
        return {k: dict(v) if isinstance(v, dict) else v for k, v in QUICK_DEFAULTS.items()}
    if not Path(path).is_file():
        raise ShardfitError(f"plan file '{path}' does not exist: write one with `shardfit fit ... -o plan.yaml` "
                            "or omit it")

    return read_plan_data(path)  # the one plan reader: one-line errors, duplicate keys refused


def default_nproc(flags: TrainFlags) -> int:
    """Ranks per node when --nproc is not given: 1 for a single-device plan, else 2."""
    return 1 if plan_data(flags)["strategy"].get("kind") == "single" else 2


def build_plan(flags: TrainFlags):
    """Plan file (or quick defaults) < command-line flags < the launch's real cluster shape."""
    data = plan_data(flags)
    # The cluster is what this launch really is (torchrun's or the DeepSpeed launcher's environment), not
    # what the file says.
    nproc = flags.nproc or (1 if data["strategy"].get("kind") == "single" else 2)
    world = int(os.environ.get("WORLD_SIZE", nproc * flags.nnodes))
    local = local_world_size(nproc)
    data["cluster"].update({"nodes": max(1, world // max(1, local)), "gpus_per_node": local})
    return plan_from_dict(data, resolve_model=load_model_spec)


def plan_data(flags: TrainFlags) -> dict:
    """The plan as a mapping: file (or quick defaults, or the checkpoint's own plan on a resume) with
    the command-line flags applied; the cluster is left to build_plan."""
    data = read_plan_dict(flags.plan)
    if flags.resume and not flags.plan:
        # Resuming without a plan file continues the checkpoint's own plan (flags still override it).
        from shardfit.train.checkpoint import resolve_resume

        found = resolve_resume(flags.resume, Path(flags.out), verify=False)
        if found is not None:  # `--resume auto` with no checkpoint yet: a fresh start
            data = read_plan_dict(str(found / "plan.yaml"))
    for section in ("strategy", "training", "schedule", "data", "cluster"):
        data[section] = dict(data.get(section) or {})
    if flags.model:
        data["model"] = flags.model
    if flags.strategy:
        strategy = parse_strategy(flags.strategy)
        data["strategy"].update({k: getattr(strategy, k) for k in ("kind", "sharding", "reshard_after_forward",
                                                                   "offload_optimizer", "offload_params", "nvme_path")})
    if flags.shard_group_size:
        data["strategy"]["shard_group_size"] = flags.shard_group_size
    if flags.tp is not None:
        # The model's own TP plan with the plan's vocab-parallel loss (its default: the logits stay sharded
        # into torch's loss_parallel), unless the plan file says otherwise.
        data["parallelism"] = {**dict(data.get("parallelism") or {}), "tp": flags.tp}
    if flags.pp is not None:
        data["parallelism"] = {**dict(data.get("parallelism") or {}), "pp": flags.pp}
    if flags.pp_schedule is not None:
        schedule = flags.pp_schedule.strip().lower()
        data["parallelism"] = {**dict(data.get("parallelism") or {}), "pp_schedule": schedule,
                               **schedule_fixed_chunks(schedule)}
    for flag, section, key in (("micro_batch", "training", "micro_batch"), ("seq", "training", "seq_len"),
                               ("grad_accum", "training", "grad_accum"), ("precision", "training", "precision"),
                               ("ac", "training", "activation_checkpointing"), ("steps", "schedule", "steps"),
                               ("lr", "schedule", "lr"), ("seed", "schedule", "seed"),
                               ("log_every", "schedule", "log_every"), ("eval_every", "schedule", "eval_every"),
                               ("save_every", "schedule", "save_every"), ("keep", "schedule", "keep_checkpoints"),
                               ("nan_policy", "schedule", "nan_policy"), ("save_mode", "schedule", "save_mode"),
                               ("on_save_error", "schedule", "on_save_error"), ("data", "data", "path"),
                               ("tokenizer", "data", "tokenizer")):
        value = getattr(flags, flag)
        if value is not None:
            data[section][key] = value
    # --loss / --optimizer-impl (commands/kernel_flags.py)
    data["training"].update(kernel_fields(flags.loss, flags.optimizer_impl))
    if data["training"].get("loss") == "chunked" and flags.tp is not None:
        # The chunked loss computes its own head in chunks, which the vocab-parallel loss cannot shard.
        data["parallelism"]["loss_parallel"] = False
    # The LoRA flags (commands/lora_flags.py): any of them turns LoRA on; rank 16 when not given.
    lora = lora_section(data["training"].get("lora"), *(getattr(flags, name)
                                                         for name in ("lora_r", "lora_targets", "lora_base")), "fp32")
    if lora is not None:
        data["training"]["lora"] = with_default_targets(lora, data["model"])
    return data
