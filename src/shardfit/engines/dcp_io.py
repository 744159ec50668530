"""DCP saves that checksum every file while DCP writes it.

DCP's FileSystemWriter opens each file through its `fs.create_stream`; a FileSystem whose write
streams checksum the bytes on their way out gives each rank the XXH3-128 checksum of the files it wrote in the
same pass, so the checkpoint manifest doesn't read the shards back. Everything else (planning,
serialisation, fsync, the atomic rename of `.metadata`) is DCP's own.
"""
from __future__ import annotations

import threading
from contextlib import contextmanager
from pathlib import Path

from torch.distributed.checkpoint.filesystem import FileSystem

from shardfit.checksums import ChecksumWriter


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
