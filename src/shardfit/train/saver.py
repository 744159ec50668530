"""Checkpoint saves, blocking or asynchronous, and what a failing disk does to them.

A save runs in phases; after each, the ranks agree (one tiny all-reduce) whether every rank's part
succeeded, so a rank whose write failed never leaves the others waiting in a collective:

    prepare   rank 0 makes OUT/checkpoints/.tmp-step-K
    write     every rank: the engine's shards (DCP or DeepSpeed), its RNG; rank 0 the trainer files
    manifest  every file's size and XXH3 checksum, the manifest written last
    publish   rank 0 renames the folder to step-K, then retention (what it lets go of is renamed
              `.trash-step-K` at once and deleted by an idle-priority thread before the next save)

A failure (ENOSPC, EIO, a read-only file system) removes the temporary folder, leaves every
earlier checkpoint as it was, and reports one line naming the path and the free space there;
schedule.on_save_error decides: `stop` (the default) ends the run, `continue` trains on and the
next save tries again.

save_mode async: the write phase only starts DCP's `async_save` (the state is copied into
shared-memory staging buffers, pinned where there is a GPU, and a writer process per rank writes
it) and training goes on; the step all-reduce counts ranks still writing (preempt.StepSlots), and
on the first step where none is, the manifest and publish phases run. Until then the checkpoint
has no manifest and no final name: a crash or SIGKILL mid-write leaves the previous checkpoint as
the resume point.
"""
from __future__ import annotations

import errno
import os
import shutil
import threading
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from shardfit.data import Position
from shardfit.errors import ShardfitError
from shardfit.train import checkpoint as ckpt
from shardfit.train import faults
from shardfit.train import manifest as integrity

SAVE_MODES = ("sync", "async")
ERROR_POLICIES = ("stop", "continue")


class SaveFailed(ShardfitError):
    """A checkpoint could not be written; the message names the path and the free space there."""

    every_rank = True


@dataclass(frozen=True)
class Pending:
    step: int
    tmp: Path
    final: Path
    future: object  # concurrent.futures.Future of DCP's async_save
    fields: dict  # the manifest's own fields, taken at the step the state is of


def save_checkpoint(engine, root: Path, step: int, position: Position, keep: int) -> Path | None:
    """One blocking save (benchmarks, bench): the loop uses a Saver."""
    return Saver(engine, root, keep).save(step, position)


class Saver:
    def __init__(self, engine, root: Path, keep: int, mode: str = "sync", on_error: str = "stop", log=None):
        if mode not in SAVE_MODES:
            raise ShardfitError(f"schedule.save_mode '{mode}' is not known: use sync or async")
        if on_error not in ERROR_POLICIES:
            raise ShardfitError(f"schedule.on_save_error '{on_error}' is not known: use stop or continue")
        if mode == "async" and getattr(engine, "save_async", None) is None:
            raise ShardfitError(f"schedule.save_mode async is not supported by {engine.kind}: DeepSpeed's asynchronous "
                                "engines need its async_io op (libaio, a GPU); use save_mode sync")
        self.engine, self.root, self.keep = engine, Path(root), keep
        self.mode, self.on_error, self.log = mode, on_error, log or (lambda text: None)
        self.pending: Pending | None = None
        self.deleting: threading.Thread | None = None  # rank 0: retired checkpoints being deleted

    def writing(self) -> int:
        """1 while this rank's asynchronous write is in flight."""
        return int(self.pending is not None and not self.pending.future.done())

    def save(self, step: int, position: Position, blocking: bool = False) -> Path | None:
        """The checkpoint of `step`: its path once published; None when it is being written
        asynchronously, or failed under on_save_error: continue. Collective."""
        if self.pending is not None:
            self.finish()  # one asynchronous save at a time: the previous one is published first
        self._deleted()  # the space retention frees is free before the next save takes more
        ctx = self.engine.ctx
        final, tmp = self.root / f"step-{step}", self.root / f".tmp-step-{step}"
        error = self._agree(lambda: _prepare(tmp) if ctx.is_main else None)
        if error:
            return self._failed(step, tmp, error)
        if self.mode == "async" and not blocking:
            box = {}

            def start():
                box["future"] = self.engine.save_async(tmp)
                ckpt.write_trainer_files(self.engine, tmp, step, position)
                faults.hit("save", step, ctx.rank, path=tmp)

            error = self._agree(start)
            if error:
                return self._failed(step, tmp, error)
            self.pending = Pending(step, tmp, final, box["future"], ckpt.manifest_fields(self.engine, step, position))
            faults.hit("async", step, ctx.rank)  # a kill here lands while the writer process writes
            return None
        written = {}

        def write():
            written.update(self.engine.save(tmp) or {})  # checksums taken while writing the shards
            ckpt.write_trainer_files(self.engine, tmp, step, position)
            faults.hit("save", step, ctx.rank, path=tmp)

        error = self._agree(write)
        if error:
            return self._failed(step, tmp, error)
        return self._publish(step, tmp, final, ckpt.manifest_fields(self.engine, step, position), written,
                             background=not blocking)

    def finish(self) -> Path | None:
        """Wait for the asynchronous save in flight (if any) and publish it. Collective."""
        pending, self.pending = self.pending, None
        if pending is None:
            return None
        error = self._agree(pending.future.result)
        if error:
            return self._failed(pending.step, pending.tmp, error)
        return self._publish(pending.step, pending.tmp, pending.final, pending.fields, {}, background=True)

    def close(self) -> None:
        """The end of the run: the save in flight published, retention's deletions done. Collective."""
        self.finish()
        self._deleted()

    def _deleted(self) -> None:
        if self.deleting is None:
            return
        if self.deleting.is_alive():
            # NOTE: no join: on a host busy with other work the idle-priority thread may get no core
            # for seconds. What it has not deleted yet is deleted here, at this thread's priority
            # (deleting is idempotent; the late thread only meets folders already gone).
            ckpt.delete_retired(self.root)
        self.deleting = None

    def _publish(self, step: int, tmp: Path, final: Path, fields: dict, written: dict,
                 background: bool = False) -> Path | None:
        ctx = self.engine.ctx
        # Collective: the checksums of the files not hashed while written (all of them after an
        # asynchronous write: its writer process kept its own) are split over the ranks.
        error = self._agree(lambda: ckpt.write_manifest(tmp, fields, known=written))
        if error:
            return self._failed(step, tmp, error)

        def rename():
            if ctx.is_main:
                if final.exists():
                    shutil.rmtree(final)
                os.replace(tmp, final)
                integrity.mark_verified(final)
                ckpt.retire(self.root, self.keep)
                if not background:
                    ckpt.delete_retired(self.root)
                    return
                # Deleting a checkpoint frees its page cache and blocks: ~0.25 s for 670 MiB here, which
                # every rank would wait for at the next collective. Between saves it runs in a thread
                # that takes only idle cores (until the next save, which deletes whatever is left).
                self.deleting = threading.Thread(target=_delete_idle, args=(self.root,), daemon=True,
                                                 name="shardfit-retention")
                self.deleting.start()

        error = self._agree(rename)
        if error:
            return self._failed(step, tmp, error)
        self.log(f"saved {final}")
        return final

    def _agree(self, work) -> str | None:
        """Run this rank's part; then every rank learns whether any rank failed, and the first
        failure's one-line description."""
        error = None
        try:
            work()
        except BaseException as exc:  # noqa: BLE001 - DCP's CheckpointException is a BaseException
            if isinstance(exc, (KeyboardInterrupt, SystemExit, GeneratorExit)):
                raise
            error = describe(exc, self.root)
        if not dist.is_initialized():
            return error
        flag = torch.tensor([0.0 if error is None else 1.0], dtype=torch.float64, device=self.engine.ctx.device)
        dist.all_reduce(flag)
        if float(flag) == 0:
            return None
        texts = [None] * dist.get_world_size()
        dist.all_gather_object(texts, error)
        # What the file system said beats what a rank saw of it (DCP's summary of another rank's error).
        return next((t for t in texts if t and t.startswith(_IO_PREFIX)), None) or next(t for t in texts if t)

    def _failed(self, step: int, tmp: Path, error: str) -> None:
        if self.engine.ctx.is_main:
            shutil.rmtree(tmp, ignore_errors=True)
        previous = [p for p in ckpt.list_checkpoints(self.root) if p.name != f"step-{step}"]
        kept = f"the previous checkpoint {previous[-1]} is intact" if previous else "there is no earlier checkpoint"
        line = f"checkpoint step-{step} was not saved: {error}; {kept}"
        if self.on_error == "stop":
            raise SaveFailed(f"{line}; the run stops (free space, then --resume auto; or set schedule.on_save_error: "
                             "continue to train on)")
        self.log(f"warning: {line}; training goes on (schedule.on_save_error: continue), the next save tries again")
        return None


_IO_PREFIX = "I/O error "


def io_error(exc: BaseException) -> OSError | None:
    """The OSError behind an exception: itself, its cause or context, or inside DCP's
    CheckpointException (failures: {rank: (exception, traceback)})."""
    seen, todo = set(), [exc]
    while todo:
        item = todo.pop(0)
        if item is None or id(item) in seen:
            continue
        seen.add(id(item))
        if isinstance(item, OSError) and item.errno is not None:
            return item
        for failure in (getattr(item, "failures", None) or {}).values():
            todo.append(failure[0] if isinstance(failure, tuple) else failure)
        todo += [item.__cause__, item.__context__]
    return None


def _free_bytes(path: Path) -> int | None:
    for candidate in (Path(path), *Path(path).parents):
        try:
            return shutil.disk_usage(candidate).free
        except OSError:
            continue
    return None


def describe(exc: BaseException, root: Path) -> str:
    found = io_error(exc)
    if found is None:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        free = _free_bytes(root)
        # DeepSpeed and torch.save to a path hide the OSError: the free space still tells the story.
        room = f" ({free / 2**20:.1f} MiB free on {root})" if free is not None and free < 64 * 2**20 else ""
        return f"{type(exc).__name__}: {first}"[:300] + room
    path = Path(found.filename) if found.filename else Path(root)
    free = _free_bytes(path)
    room = f"{free / 2**20:.1f} MiB free there" if free is not None else "free space unknown"
    name = errno.errorcode.get(found.errno, str(found.errno))
    return f"{_IO_PREFIX}{name} ({os.strerror(found.errno)}) writing {path} ({room})"


def _delete_idle(root: Path) -> None:
    if hasattr(os, "sched_setscheduler"):  # on Linux, this thread alone
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
    ckpt.delete_retired(root)


def _prepare(tmp: Path) -> None:
    shutil.rmtree(tmp, ignore_errors=True)
    (tmp / "rng").mkdir(parents=True)
