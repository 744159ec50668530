"""DCP I/O with two additions: saves that checksum every file while DCP writes it, and loads that
unpickle `.metadata` with an allowlist.

DCP's FileSystemWriter opens each file through its `fs.create_stream`; a FileSystem whose write
streams checksum the bytes on their way out gives each rank the XXH3-128 checksum of the files it
wrote in the same pass, so the checkpoint manifest doesn't read the shards back. Everything else
(planning, serialisation, fsync, the atomic rename of `.metadata`) is DCP's own.
"""
from __future__ import annotations

import threading
from contextlib import contextmanager
from pathlib import Path

from torch.distributed.checkpoint.filesystem import FileSystem, FileSystemReader

from shardfit.checksums import ChecksumWriter
from shardfit.errors import ShardfitError


class ChecksumFileSystem(FileSystem):
    """DCP's local FileSystem, recording {path: {"size", "xxh3_128"}} for each file it writes (None for a
    file written out of order: the manifest then hashes it from disk)."""

    def __init__(self):
        super().__init__()
        self.written: dict[Path, dict | None] = {}
        self.errors: list[OSError] = []  # what the file system said, before torch's serializer hides it
        self._lock = threading.Lock()  # DCP may write files from several threads (thread_count > 1)

    @contextmanager
    def create_stream(self, path, mode: str):
        with super().create_stream(path, mode) as raw:
            if "w" not in mode:
                yield raw
                return
            stream = ChecksumWriter(raw)
            try:
                yield stream
            finally:
                if stream.error is not None:
                    with self._lock:
                        self.errors.append(OSError(stream.error.errno, stream.error.strerror, str(path)))
        entry = stream.entry(Path(path))
        with self._lock:
            self.written[Path(path)] = entry

    def rename(self, path, new_path) -> None:
        super().rename(path, new_path)
        with self._lock:  # `.metadata` is written as `.metadata.tmp`, then renamed into place
            if Path(path) in self.written:
                self.written[Path(new_path)] = self.written.pop(Path(path))


def save_with_checksums(state: dict, folder: Path, **save_options) -> dict[Path, dict]:
    """dcp.save(state) into folder; returns the checksums of the files this rank wrote."""
    import torch.distributed.checkpoint as dcp

    writer = dcp.FileSystemWriter(str(folder))
    writer.fs = ChecksumFileSystem()
    try:
        dcp.save(state, storage_writer=writer, **save_options)
    except BaseException as exc:  # noqa: BLE001 - DCP's CheckpointException is a BaseException
        # NOTE: DCP serialises tensors with torch.save into our stream; an OSError from the write
        # (ENOSPC, EIO) comes out of it as a RuntimeError ("unexpected pos ..."), without errno or path.
        if writer.fs.errors and not isinstance(exc, (KeyboardInterrupt, SystemExit)):
            raise writer.fs.errors[0] from exc
        raise
    return {path: entry for path, entry in writer.fs.written.items() if entry is not None}


_STAGER = None  # one per process: its staging buffers are reused by every asynchronous save


def async_save_state(state: dict, folder: Path):
    """dcp.async_save(state) into folder, process-based: the state is copied into staging buffers
    in shared memory (pinned where there is a GPU) before this returns, so training may change the
    live tensors at once; a writer process per rank (its own gloo group, started by the first call)
    writes the files. Returns the Future of the write. NOTE: the writer process keeps no checksums
    for us (ChecksumFileSystem's table would stay in that process): the manifest hashes the shards
    from disk when the write is done."""
    global _STAGER
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
    from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

    if _STAGER is None:
        _quiet_writer()
        _STAGER = DefaultStager(StagingOptions(use_pinned_memory=torch.cuda.is_available(), use_shared_memory=True,
                                               use_async_staging=False, use_non_blocking_copy=False))
    return dcp.async_save(state, storage_writer=dcp.FileSystemWriter(str(folder)),
                          async_checkpointer_type=AsyncCheckpointerType.PROCESS, async_stager=_STAGER)


def _writer_process(*args):
    """The writer process's entry: DCP's own, with its INFO lines off (it logs every request on
    the root logger, two lines per save per rank), ending quietly when its training process died
    (a closed pipe). Runs in the fresh process, where DCP's class is unpatched."""
    import logging
    import os

    from torch.distributed.checkpoint import _async_process_executor as executor

    logging.disable(logging.INFO)
    # The write has until the next save to finish; training has the next step. Under SCHED_IDLE
    # (before any thread starts: threads inherit it) the writer runs only on a core that nothing
    # else wants, i.e. while training waits on a collective or I/O, instead of slowing every step.
    if hasattr(os, "sched_setscheduler"):
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
    else:
        os.nice(19)
    try:
        executor._AsyncCheckpointProcess._checkpointing_subprocess(*args)
    except (EOFError, BrokenPipeError, ConnectionResetError):
        pass  # the training process is gone (killed): nothing left to write for, nobody to answer


def _quiet_writer() -> None:
    # NOTE: DCP starts its writer with `target=self._checkpointing_subprocess`; a module-level
    # function pickles by name, so the spawned process imports this module and runs it.
    from torch.distributed.checkpoint import _async_process_executor as executor

    executor._AsyncCheckpointProcess._checkpointing_subprocess = staticmethod(_writer_process)


def close_async_writer() -> None:
    """End this process's DCP writer process (if one was started) and free the staging buffers.
    NOTE: DCP ends its writer only from a finalizer, which a worker leaving through os._exit never
    runs; the orphan then dies on a closed pipe with a traceback. Asked to stop, it leaves quietly."""
    global _STAGER
    from torch.distributed.checkpoint import _async_process_executor as executor

    writer = executor._CHECKPOINT_PROCESS
    if writer is not None:
        executor._CHECKPOINT_PROCESS = None
        try:
            writer._send(executor._CheckpointSaveProcessControlOpts.TERMINATE)
            writer._save_process.join(timeout=30)
        except (OSError, ValueError):  # its pipe is already closed: it is gone
            pass
        if writer._save_process.is_alive():
            writer._save_process.terminate()
    if _STAGER is not None:
        _STAGER.close()
        _STAGER = None


# What a DCP `.metadata` pickle may name: DCP's own metadata records, torch sizes, dtypes and
# layouts, paths. Anything else (os.system, builtins.eval, ...) is refused before it is called.
_METADATA_MODULES = ("torch.distributed.checkpoint.metadata", "torch.distributed.checkpoint.filesystem",
                     "torch.distributed.checkpoint.planner", "torch.distributed.checkpoint._extension")
_METADATA_GLOBALS = {("torch", "Size"), ("torch.serialization", "_get_layout"), ("collections", "OrderedDict"),
                     ("pathlib", "PosixPath"), ("pathlib", "PurePosixPath"), ("pathlib", "WindowsPath"),
                     ("pathlib", "PureWindowsPath")}


class UnsafeMetadata(ShardfitError):
    """A checkpoint's metadata names something other than DCP's own records."""


def _allowed(module: str, name: str) -> bool:
    import importlib

    import torch

    if (module, name) in _METADATA_GLOBALS:
        return True
    if module in _METADATA_MODULES:  # classes and enums only, not the modules' functions
        return isinstance(getattr(importlib.import_module(module), name, None), type)
    if module == "torch":
        return isinstance(getattr(torch, name, None), (torch.dtype, torch.layout, torch.memory_format))
    return False


def _metadata_unpickler(handle, path):
    import pickle

    class MetadataUnpickler(pickle.Unpickler):
        def find_class(self, module, name):
            if not _allowed(module, name):
                raise UnsafeMetadata(f"{path} names {module}.{name}, which is not part of DCP's metadata: shardfit "
                                     "does not unpickle it (that could run code); is it from a DCP save you trust?")
            return super().find_class(module, name)

    return MetadataUnpickler(handle)


class SafeMetadataReader(FileSystemReader):
    """DCP's FileSystemReader, except that `.metadata` is unpickled with an allowlist of the classes
    DCP writes into it, so loading a checkpoint runs no code named by the file (the tensor data is
    already read with torch.load(weights_only=True) by DCP itself)."""

    def read_metadata(self, *args, **kwargs):
        from torch.distributed.checkpoint.metadata import StorageMeta

        path = self._get_metadata_path(kwargs.get("rank"))
        try:
            with self.fs.create_stream(path, "rb") as handle:
                metadata = _metadata_unpickler(handle, path).load()
        except UnsafeMetadata:
            raise
        except Exception as exc:  # noqa: BLE001 - a damaged pickle fails in many ways
            raise ShardfitError(f"{path} is unreadable ({type(exc).__name__}: {exc}): the checkpoint is damaged") from None
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata
