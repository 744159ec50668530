"""The environment every launched rank gets: one place, so train, profile and bench agree."""
from __future__ import annotations

import hashlib
import os
import sys
from pathlib import Path


def extensions_dir() -> str:
    """Where DeepSpeed caches its compiled CPU ops. NOTE: a build records absolute paths of the Python
    environment it was built against, so two environments sharing one folder rebuild each other's
    ops (minutes each time); the folder is therefore keyed by the environment's prefix."""
    if os.environ.get("TORCH_EXTENSIONS_DIR"):
        return os.environ["TORCH_EXTENSIONS_DIR"]
    key = hashlib.sha1(sys.prefix.encode()).hexdigest()[:12]
    return str(Path.home() / ".cache" / "shardfit" / "torch_extensions" / key)


def launch_env(base: dict | None = None) -> dict:
    """A copy of the environment for torchrun ranks: one OpenMP thread per rank (ranks share the
    cores), the op cache above, and DeepSpeed told up front when there is no GPU (otherwise every
    rank prints a warning while it probes for one)."""
    env = dict(os.environ if base is None else base)
    env.setdefault("OMP_NUM_THREADS", "1")
    env.setdefault("TORCH_EXTENSIONS_DIR", extensions_dir())
    if not Path("/dev/nvidiactl").exists():
        env.setdefault("DS_ACCELERATOR", "cpu")
    return env
