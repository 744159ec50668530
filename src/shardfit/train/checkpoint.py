"""Resume checkpoints: OUT/checkpoints/step-K, each complete or absent.

Every rank writes into `.tmp-step-K`; once all ranks agree the writes succeeded, rank 0 writes
`manifest.json` (last) and renames the folder into place, so a crash or a failed write mid-save
never replaces the last good checkpoint (the save itself: train/saver.py). The
folder holds the engine's sharded state (DCP or DeepSpeed), the scheduler / loss scaler, the step,
the data position, every rank's RNG states, the Plan (YAML) and the model's HF config.
"""
from __future__ import annotations

import io
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
from shardfit.spec.planfile import plan_to_data
from shardfit.train import manifest as integrity
from shardfit.train.manifest import MANIFEST, step_folders
from shardfit.spec.plan import is_deepspeed_kind


def rng_state() -> dict:
    """Every RNG as tensors and plain lists, so torch.load(weights_only=True) reads it back: numpy's
    state is an ndarray inside a tuple, which the safe unpickler refuses."""
    version, keys, gauss = random.getstate()
    name, np_keys, pos, has_gauss, cached = np.random.get_state()
    state = {"torch": torch.get_rng_state(), "python": [version, list(keys), gauss],
             "numpy": {"name": name, "keys": torch.from_numpy(np_keys.astype(np.int64)), "pos": int(pos),
                       "has_gauss": int(has_gauss), "cached_gaussian": float(cached)}}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    version, keys, gauss = state["python"]
    random.setstate((version, tuple(keys), gauss))
    n = state["numpy"]
    np.random.set_state((n["name"], n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"], n["cached_gaussian"]))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def write_manifest(folder: Path, data: dict, known: dict | None = None) -> dict:
    """Add the size and XXH3-128 checksum of every file and write the manifest last, atomically. known: the
    entries this rank computed while writing ({path: entry}, absolute or relative to folder); the
    rest are hashed from disk. Collective under a process group (every rank hashes its share): call
    it on every rank."""
    folder = Path(folder)
    relative = {Path(os.path.relpath(path, folder)).as_posix(): entry for path, entry in (known or {}).items()}
    data = {**data, "files": integrity.file_table(folder, relative)}
    if not dist.is_initialized() or dist.get_rank() == 0:
        tmp = folder / f".{MANIFEST}.tmp"
        tmp.write_text(json.dumps(data, indent=2))
        os.replace(tmp, folder / MANIFEST)
    return data


def plan_yaml(plan) -> str:
    """The plan as the checkpoint's plan.yaml: the same data `fit -o` and `dump_plan` write."""
    import yaml

    return yaml.safe_dump(plan_to_data(plan), sort_keys=False)


def write_trainer_files(engine, tmp: Path, step: int, position: Position) -> None:
    """Everything but the engine's state: this rank's RNG; on rank 0 the trainer state, the plan, the
    model config. Small, written synchronously even by an asynchronous save (the RNG of this step)."""
    ctx = engine.ctx
    _write(tmp / "rng" / f"rank-{ctx.rank}.pt", _torch_bytes(rng_state()))
    if ctx.is_main:
        _write(tmp / "trainer.pt", _torch_bytes({"step": step, "position": position.to_dict(),
                                                  "engine": engine.extra_state()}))
        _write(tmp / "plan.yaml", plan_yaml(engine.plan).encode())
        config = getattr(engine.module, "config", None)
        if config is not None:
            _write(tmp / "config.json", config.to_json_string().encode())


def _torch_bytes(obj) -> memoryview:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getbuffer()


def _write(path: Path, data) -> None:
    """Small files through Python's own write: a full disk is an OSError naming the file (torch.save
    to a path reports it as a RuntimeError without errno or name)."""
    try:
        with open(path, "wb") as handle:
            handle.write(data)
    except OSError as exc:
        if exc.filename is None:
            raise OSError(exc.errno, exc.strerror, str(path)) from exc
        raise


def manifest_fields(engine, step: int, position: Position) -> dict:
    ctx = engine.ctx
    return {"step": step, "engine": engine.kind, "format": "deepspeed" if is_deepspeed_kind(engine.kind) else "dcp",
            "world_size": ctx.world_size, "position": position.to_dict(),
            "lora": engine.plan.training.lora is not None, "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}


def list_checkpoints(root: Path) -> list[Path]:
    """Complete checkpoints (with a manifest), oldest first."""
    return [folder for folder in step_folders(root) if (folder / MANIFEST).is_file()]


TRASH = ".trash-"  # a checkpoint retention has let go of, renamed out of every listing, being deleted


def prune(root: Path, keep: int) -> list[Path]:
    """Keep the newest `keep` checkpoints that are intact (sizes and checksums; checked once per
    process, on this rank alone); delete older intact ones and damaged ones older than the oldest
    kept. A damaged checkpoint never counts, so the newest intact one is never deleted for it.
    Returns what was deleted."""
    doomed = retire(root, keep)
    delete_retired(root)
    return doomed


def retire(root: Path, keep: int) -> list[Path]:
    """prune's choice, renamed to `.trash-step-K` (one rename each: no listing, resume or retention
    sees them again) but not yet deleted: `delete_retired` frees their bytes, possibly later, in
    the background. Returns the checkpoints retired."""
    if not keep or keep <= 0:
        return []
    complete = list_checkpoints(root)
    intact = [p for p in complete if integrity.intact_here(p)]
    kept = intact[-keep:]
    if not kept:
        return []
    oldest = int(kept[0].name[5:])
    doomed = [p for p in complete if p not in kept and int(p.name[5:]) < oldest]
    for old in doomed:
        trash = old.with_name(TRASH + old.name)
        shutil.rmtree(trash, ignore_errors=True)  # one left by a run that died while deleting it
        os.replace(old, trash)
    return doomed


def delete_retired(root: Path) -> None:
    """Delete every retired checkpoint under root, including those a crashed run left."""
    for trash in Path(root).glob(TRASH + "*"):
        shutil.rmtree(trash, ignore_errors=True)


def resolve_resume(ref: str, out_dir: Path, log=None, verify: bool = True) -> Path | None:
    """`latest` (newest complete checkpoint under OUT/checkpoints), `latest-valid` (the newest that
    passes its checksums, skipping damaged ones), `auto` (latest-valid, or None for a fresh start:
    what a restarted job uses), a run folder, or a step folder. verify=False only looks for a
    manifest (to read a plan; loading verifies anyway)."""
    if ref in ("latest-valid", "auto"):
        root = Path(out_dir) / "checkpoints"
        complete = list_checkpoints(root)
        found = integrity.latest_valid(root, log=log) if verify else (complete[-1] if complete else None)
        if found is None and ref == "latest-valid":
            raise ShardfitError(f"--resume latest-valid: no intact checkpoint under {root}")
        return found
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
    raise ShardfitError(f"'{ref}' is not a checkpoint folder (no {MANIFEST}) nor a run folder with checkpoints")


def read_manifest(path: Path, verify: bool = True) -> dict:
    """The manifest, after checking every file against its size and checksum (one line naming the
    first bad file otherwise; verify=False leaves that to the caller). Collective under a process
    group: call it on every rank."""
    manifest = integrity.read_manifest_file(path)
    if verify and "files" in manifest:  # NOTE: manifests written before checksums existed are read as they are
        integrity.verify(path, manifest)
    for key in ("step", "format", "engine"):
        if key not in manifest:
            raise integrity.CorruptCheckpoint(f"{Path(path) / MANIFEST} has no '{key}': not a shardfit checkpoint")
    return manifest


def load_checkpoint(engine, path: Path) -> tuple[int, Position]:
    """Restore everything save_checkpoint wrote; returns (step, data position).

    The manifest and every file's presence and size are checked first, so a partial or truncated
    checkpoint never reaches the loader. The contents are hashed while the state loads (in a
    background thread, where the host has a core to spare) or right after it (from the page cache
    the load just filled, not from the disk again), and confirmed on every rank before this returns:
    a damaged file raises CorruptCheckpoint naming it, before any training step. DeepSpeed
    checkpoints are verified completely before the load. DCP's `.metadata` is unpickled with an
    allowlist (engines.dcp_io), the tensors with weights_only: no code named by a file runs."""
    checks = integrity.Checks(path, read_manifest(path, verify=False))
    if checks.manifest["format"] == "deepspeed":
        checks.finish()  # DeepSpeed's state files are full pickles: verified before DeepSpeed opens them
    try:
        result = _load(engine, Path(path), checks.manifest)
    except Exception:
        checks.raise_local()  # a damaged file may be why the load failed: then that is the error
        raise
    checks.finish()
    return result


def _load(engine, path: Path, manifest: dict) -> tuple[int, Position]:
    ctx = engine.ctx
    # DeepSpeed engines also read DCP (switching engines mid-run); the others read only DCP.
    if manifest["format"] == "deepspeed" and not is_deepspeed_kind(engine.kind):
        raise ShardfitError(f"checkpoint {path} was written by DeepSpeed ({manifest['engine']}); {engine.kind} reads "
                            "DCP: convert it with `shardfit convert` first")
    if manifest["format"] == "deepspeed" and manifest["world_size"] != ctx.world_size:
        raise ShardfitError(f"DeepSpeed checkpoint {path} was written by {manifest['world_size']} ranks: resume on "
                            f"{manifest['world_size']}, or convert it to DCP (`shardfit convert`) to change the world size")
    engine.load(path)
    trainer = torch.load(path / "trainer.pt", weights_only=True)
    engine.load_extra_state(trainer["engine"])
    rng_file = path / "rng" / f"rank-{ctx.rank}.pt"
    if not rng_file.is_file():  # another world size: ranks beyond the old ones start from rank 0's state
        rng_file = path / "rng" / "rank-0.pt"
    set_rng_state(torch.load(rng_file, weights_only=True))
    return int(trainer["step"]), Position(**trainer["position"])
