"""Checkpoint integrity: the size and XXH3-128 checksum of every file, recorded in the manifest (written last),
checked before the checkpoint is trusted.

A checkpoint folder is trusted only when every file the manifest lists is present with the same
size and checksum: a crash mid-save (no manifest), a truncated copy or a flipped byte gives one
error naming the file, and `--resume latest-valid` steps back to the newest checkpoint that passes.
Checksums of DCP shards come from the save itself (shardfit.engines.dcp_io); other files are hashed
from disk, split over the ranks (file i goes to rank i mod world). Without a process group one
process does it all (export, tests).

Two ways to verify: `verify` checks everything at once (choosing a checkpoint, export, convert);
`Checks` wraps a resume: listing and sizes before the load, the contents during it (a background
thread, where the host has a spare core) or right after it, from the page cache the load filled.
"""
from __future__ import annotations

import json
import threading
from pathlib import Path

from shardfit.checksums import algorithm_of, content_matches, file_entry
from shardfit.errors import ShardfitError
from shardfit.runtime_env import local_world_size

MANIFEST = "manifest.json"
# Folders this process verified, keyed by the manifest's identity: resume checks a checkpoint while
# choosing it (latest-valid) and again while loading it; the second pass would hash everything twice.
# Every rank takes the same decisions in the same order, so the collective calls stay matched.
_VERIFIED: set = set()


class CorruptCheckpoint(ShardfitError):
    """A checkpoint file is missing, truncated or altered: the message names it."""


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


def file_table(folder: Path, known: dict | None = None) -> dict:
    """{relative path: {"size", "xxh3_128"}}. known: entries this rank computed while writing (relative
    path -> entry); every other file is hashed from disk. Collective when a process group is up: call
    on every rank after every rank has finished writing (a barrier); every rank gets the whole table."""
    folder = Path(folder)
    dist = _dist()
    names = checkpoint_files(folder)
    if dist is not None:  # every rank must list the same files: take rank 0's listing
        box = [names]
        dist.broadcast_object_list(box, src=0)
        names = box[0]
    table: dict = {}
    for part in _gather(dict(known or {}), dist):
        table.update(part)
    rest = [name for name in names if name not in table]
    local = {name: file_entry(folder / name) for name in _share(rest, dist)}
    for part in _gather(local, dist):
        table.update(part)
    return {name: table[name] for name in names if name in table}


def read_manifest_file(folder: Path) -> dict:
    """The manifest's JSON as written, unverified (train.checkpoint.read_manifest checks the files)."""
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


def listing_problems(folder: Path, manifest: dict) -> list[str]:
    """What a listing shows (cheap, no collective): files missing, of the wrong size, or not in the
    manifest. Content is `content_problems`' job."""
    folder = Path(folder)
    table = manifest.get("files")
    if not isinstance(table, dict):
        return [f"{folder / MANIFEST} has no file checksums (written by an older shardfit?): it can't be verified"]
    found = []
    for name in sorted(table):
        path, expected = folder / name, table[name] or {}
        if not path.is_file():
            found.append(f"checkpoint file {path} is missing")
        elif (size := path.stat().st_size) != expected.get("size"):
            found.append(f"checkpoint file {path} is truncated or altered: {size} bytes, the manifest says "
                         f"{expected.get('size')}")
    extra = sorted(set(checkpoint_files(folder)) - set(table))
    # NOTE: a stray extra file is harmless to the loaders we use, but it means someone wrote into a
    # finished checkpoint; report it so a mixed-up folder is not trusted silently.
    found += [f"checkpoint file {folder / name} is not in the manifest" for name in extra if not name.endswith(".tmp")]
    return found


def content_problems(folder: Path, table: dict, names: list[str]) -> list[str]:
    """The named files whose bytes don't match their checksum (sizes already checked)."""
    folder = Path(folder)
    return [f"checkpoint file {folder / name} is corrupted: its {algorithm_of(table[name] or {})} differs from the manifest"
            for name in names if not content_matches(folder / name, table[name] or {})]


def problems(folder: Path, manifest: dict | None = None) -> list[str]:
    """Everything wrong with a checkpoint folder (empty list = intact). Collective under a process group."""
    folder = Path(folder)
    if manifest is None:
        try:
            manifest = read_manifest_file(folder)
        except CorruptCheckpoint as exc:
            return [str(exc)]
    key = _identity(folder)
    if key in _VERIFIED:
        return []
    found = listing_problems(folder, manifest)
    if found:  # every rank sees the same listing, so every rank returns here alike
        return found
    dist = _dist()
    table = manifest["files"]
    local = content_problems(folder, table, _share(sorted(table), dist))
    found = [p for part in _gather(local, dist) for p in part]
    if not found and key is not None:
        _VERIFIED.add(key)
    return found


def intact_here(folder: Path) -> bool:
    """Whether the folder is an intact checkpoint, checked by this process alone (no collective: for
    retention on rank 0). Each folder's contents are hashed at most once per process."""
    try:
        manifest = read_manifest_file(folder)
    except CorruptCheckpoint:
        return False
    if listing_problems(folder, manifest):
        return False
    key = _identity(folder)
    if key in _VERIFIED:
        return True
    if content_problems(folder, manifest["files"], sorted(manifest["files"])):
        return False
    if key is not None:
        _VERIFIED.add(key)
    return True


def mark_verified(folder: Path) -> None:
    """A checkpoint this process just wrote and checksummed: no need to hash it again."""
    key = _identity(folder)
    if key is not None:
        _VERIFIED.add(key)


def _identity(folder: Path):
    try:
        stat = (Path(folder) / MANIFEST).stat()
    except OSError:
        return None
    return (str(Path(folder).resolve()), stat.st_mtime_ns, stat.st_size, stat.st_ino)


def _raise_first(found: list[str], every_rank: bool = True) -> None:
    """every_rank: the findings are the same on every rank (a listing, or gathered from all ranks)."""
    if found:
        more = f" (and {len(found) - 1} more)" if len(found) > 1 else ""
        error = CorruptCheckpoint(f"{found[0]}{more}: use --resume latest-valid to take the previous checkpoint")
        error.every_rank = every_rank
        raise error


def verify(folder: Path, manifest: dict | None = None) -> dict:
    """Raise CorruptCheckpoint (one line, naming the first bad file) unless the folder is intact."""
    manifest = manifest if manifest is not None else read_manifest_file(folder)
    _raise_first(problems(folder, manifest))
    return manifest


def spare_cores() -> bool:
    """Whether this host has more cores than training processes. Only then does hashing in a
    background thread overlap the load; on a saturated host the thread competes with the load for
    the core and the memory bus, and hashing right after the load, from the page cache it has just
    filled, measured faster (bench_checkpoint on 2 ranks / 2 cores: 0.88-0.92 of raw DCP's load
    time against 0.79-0.83 with a thread)."""
    import os

    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cores = os.cpu_count() or 1
    return cores > local_world_size(1)


class Checks:
    """Verification around a load. Created before it: the listing and sizes are checked at once (a
    partial or truncated checkpoint never reaches the loader), and where the host has a spare core a
    background thread starts hashing this rank's share of the contents. `finish()` after the load
    (collective) hashes what is left, gathers every rank's findings and raises on every rank if any
    file is damaged."""

    def __init__(self, folder: Path, manifest: dict, background: bool | None = None):
        self.folder, self.manifest = Path(folder), manifest
        self._key = _identity(self.folder)
        self._found: list[str] = []
        self._thread = None
        self._names: list[str] | None = None  # this rank's share, while not hashed yet
        # NOTE: pre-checksum manifests are read as they are. Whether this process already verified the
        # folder differs between ranks (retention hashes on rank 0 alone, a rank may have written it), so
        # the skip is agreed: finish() is a collective only when every rank takes part in it.
        skip = self._key in _VERIFIED or "files" not in manifest
        if not all(_gather(skip, _dist())):
            skip = False
        if skip:
            return
        _raise_first(listing_problems(self.folder, manifest))
        self._names = _share(sorted(manifest["files"]), _dist())
        if spare_cores() if background is None else background:
            # xxhash and file reads release the GIL, so the hashing overlaps the load for real.
            self._thread = threading.Thread(target=self._hash, name="checkpoint-checksums", daemon=True)
            self._thread.start()

    @property
    def pending(self) -> bool:
        return self._names is not None

    def _hash(self) -> None:
        self._found.extend(content_problems(self.folder, self.manifest["files"], self._names))

    def _settle(self) -> None:
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        elif self._names is not None:
            self._hash()
        self._names = None

    def raise_local(self) -> None:
        """After a failed load, on this rank alone (no collective: the other ranks may not be here):
        if this rank's share of the files is damaged, that is the error to report."""
        pending = self.pending
        self._settle()
        if pending:
            _raise_first(self._found, every_rank=False)

    def finish(self) -> None:
        """Collective: every rank's share hashed and gathered; CorruptCheckpoint on every rank if any
        file is damaged."""
        if not self.pending:
            return
        self._settle()
        found = [p for part in _gather(self._found, _dist()) for p in part]
        _raise_first(found)
        if self._key is not None:
            _VERIFIED.add(self._key)


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
