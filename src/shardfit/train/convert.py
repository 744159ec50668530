"""Move a training checkpoint between engines: DeepSpeed ZeRO (any stage) -> DCP, model and
optimizer state, so a run started on DeepSpeed can continue on DDP / FSDP / FSDP2 (on any world size).

The DeepSpeed side goes through DeepSpeed's own universal-checkpoint converter (`ds_to_universal`),
which writes one folder per parameter with fp32 weights and Adam moments; we load those into a
plain CPU model + AdamW and let DCP write them in the layout `get_state_dict` produces. The LR
scheduler, step, data position, RNG states, Plan and config carry over unchanged.
"""
from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from shardfit.errors import ShardfitError
from shardfit.spec.models import load_model_spec
from shardfit.spec.plan import plan_from_dict


def _load_universal(folder: Path, name: str, kind: str):
    import torch

    path = folder / "zero" / name / f"{kind}.pt"
    if not path.is_file():
        return None
    value = torch.load(path, map_location="cpu", weights_only=False)
    return value["param"] if isinstance(value, dict) else value


def deepspeed_to_dcp(checkpoint: Path, out: Path) -> Path:
    import torch
    import torch.distributed.checkpoint as dcp
    import yaml
    from torch.distributed.checkpoint.state_dict import get_state_dict

    from shardfit.engines.base import build_optimizer, build_scheduler
    from shardfit.engines.deepspeed import TAG
    from shardfit.train.checkpoint import read_manifest, write_manifest
    from shardfit.train.loop import build_model

    checkpoint, out = Path(checkpoint), Path(out)
    manifest = read_manifest(checkpoint)
    if manifest["format"] != "deepspeed":
        raise ShardfitError(f"{checkpoint} is already a DCP checkpoint ({manifest['engine']}): DDP, FSDP and FSDP2 "
                            "all resume from it directly")
    if manifest.get("lora"):
        raise ShardfitError("converting a LoRA run is not supported yet")
    plan = plan_from_dict(yaml.safe_load((checkpoint / "plan.yaml").read_text()), resolve_model=load_model_spec)
    if plan.training.optimizer != "adamw":
        raise ShardfitError(f"only AdamW state converts (this run used {plan.training.optimizer})")
    trainer = torch.load(checkpoint / "trainer.pt", weights_only=True)
    ds_folder = checkpoint / "deepspeed" / TAG
    with tempfile.TemporaryDirectory() as tmp:
        universal = Path(tmp) / "universal"
        command = [sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal", "--input_folder", str(ds_folder),
                   "--output_folder", str(universal), "--inject_missing_state", "--num_extract_workers", "1",
                   "--num_merge_workers", "1"]
        done = subprocess.run(command, capture_output=True, text=True)
        if done.returncode != 0:
            raise ShardfitError(f"DeepSpeed's ds_to_universal failed on {ds_folder}: "
                                f"{(done.stderr.strip().splitlines() or ['no output'])[-1]}")
        model = build_model(plan)
        optimizer = build_optimizer(plan, [p for p in model.parameters() if p.requires_grad])
        scheduler = build_scheduler(plan, optimizer)
        # Optimizer steps taken (AdamW's bias correction). NOTE: fp16 runs that skipped overflow steps
        # would count fewer; DeepSpeed keeps that count per parameter only for some stages.
        steps = float(trainer["step"])
        with torch.no_grad():
            for name, param in model.named_parameters():
                weights = _load_universal(universal, name, "fp32")
                if weights is None:
                    raise ShardfitError(f"parameter {name} is missing from the DeepSpeed checkpoint {checkpoint}")
                param.copy_(weights.view_as(param))
                moments = {k: _load_universal(universal, name, k) for k in ("exp_avg", "exp_avg_sq")}
                if all(v is not None for v in moments.values()):
                    optimizer.state[param] = {"step": torch.tensor(steps),
                                              **{k: v.view_as(param).clone() for k, v in moments.items()}}
        # ZeRO-1/2 write one model-states file, ZeRO-3 one per rank; all hold the scheduler.
        states = sorted(ds_folder.glob("*mp_rank_00_model_states.pt"))
        if not states:
            raise ShardfitError(f"{ds_folder} has no DeepSpeed model-states file: is the checkpoint complete?")
        ds_state = torch.load(states[0], map_location="cpu", weights_only=False)
        if ds_state.get("lr_scheduler"):
            scheduler.load_state_dict(ds_state["lr_scheduler"])
        for group in optimizer.param_groups:  # the current LR, as the scheduler left it
            group["lr"] = group["initial_lr"] * scheduler.lr_lambdas[0](scheduler.last_epoch)
        msd, osd = get_state_dict(model, optimizer)
        staging = out.parent / f".tmp-{out.name}"
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir(parents=True)
        dcp.save({"model": msd, "optim": osd}, checkpoint_id=str(staging / "dcp"), no_dist=True)
    torch.save({"step": trainer["step"], "position": trainer["position"],
                "engine": {"scheduler": scheduler.state_dict()}}, staging / "trainer.pt")
    shutil.copytree(checkpoint / "rng", staging / "rng")
    for name in ("plan.yaml", "config.json"):
        if (checkpoint / name).is_file():
            shutil.copy(checkpoint / name, staging / name)
    # The source's file table describes the DeepSpeed files: the new manifest lists (and checksums)
    # the converted folder's own files, written last like every checkpoint's.
    manifest = {k: v for k, v in manifest.items() if k != "files"}
    write_manifest(staging, {**manifest, "format": "dcp", "engine": f"{manifest['engine']} (converted)",
                             "converted_from": str(checkpoint)})
    if out.exists():
        shutil.rmtree(out)
    staging.rename(out)
    return out
