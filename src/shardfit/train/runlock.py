"""One writer per run directory: OUT/.shardfit.lock, created with O_CREAT|O_EXCL (atomic on local file
systems and on NFSv3+/Lustre/GPFS, unlike flock, which NFS may not carry across nodes), holding the
host, pid, start time and job id of the job that writes there.

A second job on the same folder refuses with one line naming the holder. A lock is stale, and taken
over, when it was left by the same job (the same SLURM job id or torchrun run id: a restart or a
requeue) or by a process on this host that no longer exists. A lock held from another host by
another job is never taken over: that host may still be writing (remove the file by hand if it
is not). Rank 0 of the workers takes it (`shardfit train` also checks before starting torchrun).
"""
from __future__ import annotations

import json
import os
import socket
import time
from contextlib import contextmanager
from pathlib import Path

from shardfit.errors import ShardfitError

LOCK = ".shardfit.lock"


def job_id() -> str | None:
    """What stays the same across torchrun restarts and SLURM requeues of one job."""
    for var in ("SLURM_JOB_ID", "TORCHELASTIC_RUN_ID"):
        if os.environ.get(var):
            return f"{var}={os.environ[var]}"
    return None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process: alive
        return True
    return True


def read(out: Path) -> dict | None:
    try:
        data = json.loads((Path(out) / LOCK).read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError):
        return {}  # being written this instant, or damaged: treated as held, never silently replaced
    return data if isinstance(data, dict) else {}


def stale(holder: dict) -> bool:
    if not holder:
        return False
    mine = job_id()
    if mine is not None and holder.get("job") == mine:
        return True
    return holder.get("host") == socket.gethostname() and isinstance(holder.get("pid"), int) and not _alive(holder["pid"])


def describe(out: Path, holder: dict) -> str:
    if not holder:
        return (f"--out {out} is locked by another job ({Path(out) / LOCK} is unreadable): if no job writes there, "
                "remove that file")
    return (f"--out {out} is in use by another job: host {holder.get('host')}, pid {holder.get('pid')}, started "
            f"{holder.get('started')} ({Path(out) / LOCK}); wait for it, choose another --out, or remove the lock "
            "file if that job is gone")


def check(out: Path) -> None:
    """Raise the one-line refusal if a live job holds the folder (no lock is taken)."""
    holder = read(out)
    if holder is not None and not stale(holder):
        raise ShardfitError(describe(out, holder))


def acquire(out: Path) -> Path:
    """Take the lock or raise the one-line refusal. Returns the lock file."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / LOCK
    record = {"host": socket.gethostname(), "pid": os.getpid(),
              "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "job": job_id()}
    for _ in range(3):
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            holder = read(out)
            if holder is None:
                continue  # released between our open and our read: try again
            if not stale(holder):
                raise ShardfitError(describe(out, holder)) from None
            # NOTE: rename-then-unlink, so of two jobs that both found the same stale lock only the one
            # whose rename succeeds removes it; both then race on O_EXCL and exactly one wins.
            aside = out / f"{LOCK}.stale-{os.getpid()}"
            try:
                os.rename(path, aside)
                aside.unlink()
            except FileNotFoundError:
                pass
            continue
        with os.fdopen(fd, "w") as handle:
            handle.write(json.dumps(record) + "\n")
            handle.flush()
            os.fsync(handle.fileno())
        return path
    raise ShardfitError(f"--out {out}: could not take {path} (another job keeps creating it): choose another --out")


def release(out: Path) -> None:
    """Remove the lock if this process holds it."""
    holder = read(out)
    if holder and holder.get("pid") == os.getpid() and holder.get("host") == socket.gethostname():
        try:
            (Path(out) / LOCK).unlink()
        except FileNotFoundError:
            pass


@contextmanager
def held(out: Path, is_main: bool):
    """Collective: rank 0 takes the lock, every rank learns whether it did (a refusal is raised on
    every rank, printed once); the lock is released when the block ends, however it ends."""
    import torch.distributed as dist

    refusal = None
    if is_main:
        try:
            acquire(out)
        except ShardfitError as exc:
            refusal = str(exc)
    if dist.is_initialized():
        box = [refusal]
        dist.broadcast_object_list(box, src=0)
        refusal = box[0]
    if refusal is not None:
        error = ShardfitError(refusal)
        error.every_rank = True
        raise error
    try:
        yield
    finally:
        if is_main:
            release(out)
