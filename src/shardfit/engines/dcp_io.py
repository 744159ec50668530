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
        self._lock = threading.Lock()  # DCP may write files from several threads (thread_count > 1)

    @contextmanager
    def create_stream(self, path, mode: str):
        with super().create_stream(path, mode) as raw:
            if "w" not in mode:
                yield raw
                return
            stream = ChecksumWriter(raw)
            yield stream
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
    dcp.save(state, storage_writer=writer, **save_options)
    return {path: entry for path, entry in writer.fs.written.items() if entry is not None}


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
