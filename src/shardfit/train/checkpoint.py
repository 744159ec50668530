"""Resume checkpoints: OUT/checkpoints/step-K, each complete or absent.

Every rank writes into `.tmp-step-K`; after a barrier rank 0 writes `manifest.json` (last) and
renames the folder into place, so a crash mid-save never replaces the last good checkpoint. The
folder holds the engine's sharded state (DCP or DeepSpeed), the scheduler / loss scaler, the step,
the data position, every rank's RNG states, the Plan (YAML) and the model's HF config.
"""
from __future__ import annotations

import json
import os
import random
import shutil
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from shardfit.data import Position
from shardfit.errors import ShardfitError

MANIFEST = "manifest.json"


def rng_state() -> dict:
    state = {"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": np.random.get_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def plan_yaml(plan) -> str:
    import yaml

    try:
        from shardfit.spec.planfile import dump_plan
        return dump_plan(plan)
    except (ImportError, TypeError):
        return yaml.safe_dump(_plain(plan.to_dict()), sort_keys=False)


def _plain(value):
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


def save_checkpoint(engine, root: Path, step: int, position: Position, keep: int) -> Path:
    ctx = engine.ctx
    root = Path(root)
    final, tmp = root / f"step-{step}", root / f".tmp-step-{step}"
    if ctx.is_main:
        shutil.rmtree(tmp, ignore_errors=True)
        (tmp / "rng").mkdir(parents=True)
    dist.barrier()
    engine.save(tmp)
    torch.save(rng_state(), tmp / "rng" / f"rank-{ctx.rank}.pt")
    if ctx.is_main:
        torch.save({"step": step, "position": position.to_dict(), "engine": engine.extra_state()}, tmp / "trainer.pt")
        (tmp / "plan.yaml").write_text(plan_yaml(engine.plan))
        config = getattr(engine.module, "config", None)
        if config is not None:
            config.to_json_file(str(tmp / "config.json"))
    dist.barrier()
    if ctx.is_main:
        manifest = {"step": step, "engine": engine.kind,
                    "format": "deepspeed" if engine.kind.startswith("zero") else "dcp",
                    "world_size": ctx.world_size, "position": position.to_dict(),
                    "lora": engine.plan.training.lora is not None, "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=2))
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        prune(root, keep)
    dist.barrier()
    return final


def list_checkpoints(root: Path) -> list[Path]:
    """Complete checkpoints (with a manifest), oldest first."""
    root = Path(root)
    found = [p for p in root.glob("step-*") if (p / MANIFEST).is_file() and p.name[5:].isdigit()]
    return sorted(found, key=lambda p: int(p.name[5:]))


def prune(root: Path, keep: int) -> None:
    if keep and keep > 0:
        for old in list_checkpoints(root)[:-keep]:
            shutil.rmtree(old, ignore_errors=True)


def resolve_resume(ref: str, out_dir: Path) -> Path:
    """`latest` (newest complete checkpoint under OUT/checkpoints), a run folder, or a step folder."""
    if ref == "latest":
        found = list_checkpoints(Path(out_dir) / "checkpoints")
        if not found:
            raise ShardfitError(f"--resume latest: no complete checkpoint under {Path(out_dir) / 'checkpoints'}")
        return found[-1]
    path = Path(ref)
    if (path / MANIFEST).is_file():
        return path
    found = list_checkpoints(path / "checkpoints") if path.is_dir() else []
    if found:
        return found[-1]
    raise ShardfitError(f"--resume {ref}: not a checkpoint folder (no {MANIFEST}) nor a run folder with checkpoints")


def read_manifest(path: Path) -> dict:
    return json.loads((Path(path) / MANIFEST).read_text())


def load_checkpoint(engine, path: Path) -> tuple[int, Position]:
    """Restore everything save_checkpoint wrote; returns (step, data position)."""
    ctx = engine.ctx
    manifest = read_manifest(path)
    # DeepSpeed engines also read DCP (switching engines mid-run); the others read only DCP.
    if manifest["format"] == "deepspeed" and not engine.kind.startswith("zero"):
        raise ShardfitError(f"checkpoint {path} was written by DeepSpeed ({manifest['engine']}); {engine.kind} reads "
                            "DCP: convert it with `shardfit convert` first")
    if manifest["format"] == "deepspeed" and manifest["world_size"] != ctx.world_size:
        raise ShardfitError(f"DeepSpeed checkpoint {path} was written by {manifest['world_size']} ranks: resume on "
                            f"{manifest['world_size']}, or convert it to DCP (`shardfit convert`) to change the world size")
    engine.load(path)
    trainer = torch.load(Path(path) / "trainer.pt", weights_only=False)
    engine.load_extra_state(trainer["engine"])
    rng_file = Path(path) / "rng" / f"rank-{ctx.rank}.pt"
    if not rng_file.is_file():  # another world size: ranks beyond the old ones start from rank 0's state
        rng_file = Path(path) / "rng" / "rank-0.pt"
    set_rng_state(torch.load(rng_file, weights_only=False))
    return int(trainer["step"]), Position(**trainer["position"])
