"""Checkpoint integrity: the size and sha256 of every file, recorded in the manifest (written last),
checked before anything is loaded.

A checkpoint folder is trusted only when every file the manifest lists is present with the same
size and checksum: a crash mid-save (no manifest), a truncated copy or a flipped byte gives one
error naming the file, and `--resume latest-valid` steps back to the newest checkpoint that passes.
Hashing is split over the ranks (file i goes to rank i mod world) so a large checkpoint is not read
by rank 0 alone; without a process group one process does it all (export, tests).
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

from shardfit.errors import ShardfitError

MANIFEST = "manifest.json"
_CHUNK = 8 << 20
# Folders this process verified, keyed by the manifest's identity: resume checks a checkpoint while
# choosing it (latest-valid) and again while loading it; the second pass would hash everything twice.
# Every rank takes the same decisions in the same order, so the collective calls stay matched.
_VERIFIED: set = set()


class CorruptCheckpoint(ShardfitError):
    """A checkpoint file is missing, truncated or altered: the message names it."""


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while chunk := handle.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def checkpoint_files(folder: Path) -> list[str]:
    """Every regular file under the folder except the manifest, as sorted relative POSIX paths."""
    folder = Path(folder)
    return sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*")
                  if p.is_file() and p.name != MANIFEST and not p.name.startswith(f".{MANIFEST}"))


def _dist():
    try:
        import torch.distributed as dist
    except ImportError:  # the analytic install has no torch: one process does everything
        return None
    return dist if dist.is_available() and dist.is_initialized() else None


def _share(items: list, dist) -> list:
    if dist is None:
        return items
    rank, world = dist.get_rank(), dist.get_world_size()
    return [item for i, item in enumerate(items) if i % world == rank]


def _gather(local, dist) -> list:
    if dist is None:
        return [local]
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, local)
    return out


def file_table(folder: Path) -> dict:
    """{relative path: {"size", "sha256"}}. Collective when a process group is up: call on every rank
    after every rank has finished writing (a barrier), and every rank gets the whole table."""
    folder = Path(folder)
    dist = _dist()
    names = checkpoint_files(folder)
    if dist is not None:  # every rank must list the same files: take rank 0's listing
        box = [names]
        dist.broadcast_object_list(box, src=0)
        names = box[0]
    local = {name: {"size": (folder / name).stat().st_size, "sha256": sha256_file(folder / name)}
             for name in _share(names, dist)}
    table: dict = {}
    for part in _gather(local, dist):
        table.update(part)
    return dict(sorted(table.items()))


def read_manifest(folder: Path) -> dict:
    path = Path(folder) / MANIFEST
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise CorruptCheckpoint(f"{folder} is not a complete checkpoint: {MANIFEST} is missing "
                                "(a save that did not finish); use --resume latest-valid to take the previous one") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CorruptCheckpoint(f"{path} is unreadable ({type(exc).__name__}): the checkpoint is damaged; "
                                "use --resume latest-valid to take the previous one") from None
    if not isinstance(data, dict):
        raise CorruptCheckpoint(f"{path} is not a checkpoint manifest: use --resume latest-valid")
    return data


def _problem(folder: Path, name: str, expected: dict) -> str | None:
    path = folder / name
    if not path.is_file():
        return f"checkpoint file {path} is missing"
    size = path.stat().st_size
    if size != expected.get("size"):
        return f"checkpoint file {path} is truncated or altered: {size} bytes, the manifest says {expected.get('size')}"
    if sha256_file(path) != expected.get("sha256"):
        return f"checkpoint file {path} is corrupted: its sha256 differs from the manifest"
    return None


def problems(folder: Path, manifest: dict | None = None) -> list[str]:
    """Everything wrong with a checkpoint folder (empty list = intact). Collective under a process group."""
    folder = Path(folder)
    dist = _dist()
    if manifest is None:
        try:
            manifest = read_manifest(folder)
        except CorruptCheckpoint as exc:
            return [str(exc)]
    table = manifest.get("files")
    if not isinstance(table, dict):
        return [f"{folder / MANIFEST} has no file checksums (written by an older shardfit?): it can't be verified"]
    key = _identity(folder)
    if key in _VERIFIED:
        return []
    names = sorted(table)
    local = [p for name in _share(names, dist) if (p := _problem(folder, name, table[name] or {}))]
    found = [p for part in _gather(local, dist) for p in part]
    extra = sorted(set(checkpoint_files(folder)) - set(names))
    # NOTE: a stray extra file is harmless to the loaders we use, but it means someone wrote into a
    # finished checkpoint; report it so a mixed-up folder is not trusted silently.
    found += [f"checkpoint file {folder / name} is not in the manifest" for name in extra if not name.endswith(".tmp")]
    if not found and key is not None:
        _VERIFIED.add(key)
    return found


def _identity(folder: Path):
    try:
        stat = (Path(folder) / MANIFEST).stat()
    except OSError:
        return None
    return (str(Path(folder).resolve()), stat.st_mtime_ns, stat.st_size, stat.st_ino)


def verify(folder: Path, manifest: dict | None = None) -> dict:
    """Raise CorruptCheckpoint (one line, naming the first bad file) unless the folder is intact."""
    manifest = manifest if manifest is not None else read_manifest(folder)
    found = problems(folder, manifest)
    if found:
        more = f" (and {len(found) - 1} more)" if len(found) > 1 else ""
        raise CorruptCheckpoint(f"{found[0]}{more}: use --resume latest-valid to take the previous checkpoint")
    return manifest


def step_folders(root: Path) -> list[Path]:
    """Checkpoint folders `step-K` under root (with or without a manifest), oldest first."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = [p for p in root.glob("step-*") if p.is_dir() and p.name[5:].isdigit()]
    return sorted(found, key=lambda p: int(p.name[5:]))


def latest_valid(root: Path, log=None) -> Path | None:
    """The newest intact checkpoint under root, or None; each one skipped is reported through `log`."""
    for folder in reversed(step_folders(root)):
        found = problems(folder)
        if not found:
            return folder
        if log is not None:
            log(f"skipping {folder.name}: {found[0]}")
    return None
