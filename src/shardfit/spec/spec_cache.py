"""The on-disk cache of derived model specs and their traced activation coefficients. No torch here.

A spec derived from transformers' own code (a meta-device build, traced forwards) costs seconds the
first time; the cache makes every later `plan` of the same config as fast as a preset. One JSON file
per config, named by its key: sha256 of the config's canonical JSON, the installed transformers
version and DERIVATION_VERSION (bumped whenever what we derive changes), so a new transformers or a
new shardfit never reads a stale entry. The file holds the config itself (so coefficients can be
derived again from the cache alone), the spec, and one coefficient set per (regime, attention, LoRA).

Where: $SHARDFIT_CACHE_DIR, else $XDG_CACHE_HOME/shardfit, else ~/.cache/shardfit; `specs/` below it.
Clear it with `shardfit models --clear-cache` (or delete the folder): entries are re-derived on use.
"""
from __future__ import annotations

import hashlib
import json
import os
import threading
from functools import lru_cache
from importlib.util import find_spec
from pathlib import Path

# NOTE: bump when derive.py or the traced coefficients change meaning: old entries are then ignored.
DERIVATION_VERSION = 17  # 5: forward_inside (traced peak instants inside blocks); 6: block_ops; 7: param_order;
# 8: tp_plan, layer_kinds; 9: sp_norm_kinds (what the norms between the TP regions save);
# 10: sp_extra_gathers; 11: kind_expert_params; 12-14: the backward trace's gradient-hook moments;
# 15: the first block's backward ends at its input's gradient; 16: SAC keeps addmm as a matmul, traces run torch's linear;
# 17: a recompute ends when its forwards raise (an early stop), as the tracker's window


def cache_dir() -> Path:
    root = os.environ.get("SHARDFIT_CACHE_DIR")
    if root:
        return Path(root).expanduser() / "specs"
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "shardfit" / "specs"


@lru_cache(maxsize=1)
def transformers_version() -> str:
    """The installed transformers version, without importing transformers. NOTE: the dist-info folder
    beside the package is found by name (a directory listing): importlib.metadata scans every
    installed distribution and costs ~0.1 s of a cached `plan`, which takes ~0.1 s in all."""
    spec = find_spec("transformers")
    if spec is None or not spec.origin:
        return "none"
    site = Path(spec.origin).resolve().parent.parent
    found = sorted(site.glob("transformers-*.dist-info"))
    if len(found) == 1:
        return found[0].name[len("transformers-"):-len(".dist-info")]
    from importlib import metadata  # an editable or unusual install: ask the slow way

    try:
        return metadata.version("transformers")
    except metadata.PackageNotFoundError:
        return "none"


def config_key(cfg: dict, model_class: str = "") -> str:
    canonical = json.dumps(cfg, sort_keys=True, separators=(",", ":"), default=str)
    text = f"{canonical}|{model_class}|{transformers_version()}|{DERIVATION_VERSION}"
    return hashlib.sha256(text.encode()).hexdigest()[:24]


def entry_path(key: str) -> Path:
    return cache_dir() / f"{key}.json"


def read_entry(key: str) -> dict | None:
    """The cached entry, or None when absent or unreadable (a damaged entry is simply derived again)."""
    path = entry_path(key)
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(data, dict) or data.get("key") != key:
        return None
    return data


def write_entry(key: str, entry: dict) -> None:
    """Atomic write (temporary file + rename): concurrent ranks or commands never read half a file.
    A cache that cannot be written (read-only home) is not an error: the next run derives again."""
    path = entry_path(key)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_text_atomically(path, json.dumps({**entry, "key": key}, sort_keys=True))
    except OSError:
        return


def write_text_atomically(path: Path, text: str) -> None:
    """Write a file through a temporary one beside it and a rename: a reader (another rank, another
    command) sees the old file or the new one, never half of it. The temporary name is unique per
    process and thread. NOTE: not tempfile.mkstemp: importing tempfile (random, shutil, bz2, lzma)
    costs more than the rest of a cached `plan`'s own work (benchmarks/bench_plan.py)."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_NOFOLLOW", 0), 0o600)
    try:
        with os.fdopen(fd, "w") as handle:
            handle.write(text)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def clear() -> int:
    """Remove every cached entry; returns how many were removed."""
    removed = 0
    folder = cache_dir()
    if folder.is_dir():
        for path in folder.glob("*.json"):
            path.unlink(missing_ok=True)
            removed += 1
    return removed
