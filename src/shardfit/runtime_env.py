"""The environment every launched rank gets, and how a rank joins its process group: one place, so
train, profile, bench and the engines agree (a leaf: no shardfit imports)."""
from __future__ import annotations

import datetime
import hashlib
import os
import sys
from pathlib import Path
from typing import NoReturn

COLLECTIVE_TIMEOUT_ENV = "SHARDFIT_COLLECTIVE_TIMEOUT"  # set by `train --collective-timeout`
DEFAULT_COLLECTIVE_TIMEOUT_S = 600.0


def extensions_dir() -> str:
    """Where DeepSpeed caches its compiled CPU ops. NOTE: a build records absolute paths of the Python
    environment it was built against, so two environments sharing one folder rebuild each other's
    ops (minutes each time); the folder is therefore keyed by the environment's prefix."""
    if os.environ.get("TORCH_EXTENSIONS_DIR"):
        return os.environ["TORCH_EXTENSIONS_DIR"]
    key = hashlib.sha1(sys.prefix.encode()).hexdigest()[:12]
    return str(Path.home() / ".cache" / "shardfit" / "torch_extensions" / key)


def local_world_size(default: int | None = None) -> int | None:
    """Ranks on this node, from the launcher that started them: torchrun sets LOCAL_WORLD_SIZE,
    DeepSpeed's launcher (`deepspeed --hostfile ...`) sets LOCAL_SIZE instead."""
    text = os.environ.get("LOCAL_WORLD_SIZE") or os.environ.get("LOCAL_SIZE")
    return int(text) if text else default


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


def configured_timeout() -> float | None:
    """Seconds from SHARDFIT_COLLECTIVE_TIMEOUT (set by `train --collective-timeout`); 0 disables."""
    text = os.environ.get(COLLECTIVE_TIMEOUT_ENV)
    value = float(text) if text else DEFAULT_COLLECTIVE_TIMEOUT_S
    return value if value > 0 else None


def process_group_kwargs() -> dict:
    """Extra init_process_group arguments: the collective timeout, and under torchrun's agent a store
    prefix per restart attempt. NOTE: the agent's store outlives the workers; without a prefix a
    restarted gloo group reads the dead ranks' addresses from the last attempt and fails (or hangs)
    connecting to them, which turns every torchrun restart into a coin toss."""
    kwargs = {}
    timeout = init_timeout()
    if timeout is not None:
        kwargs["timeout"] = timeout
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True" and "MASTER_ADDR" in os.environ:
        import torch.distributed as dist

        attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                              timeout=timeout or datetime.timedelta(minutes=30))
        kwargs.update(store=dist.PrefixStore(f"shardfit/attempt-{attempt}", store), rank=int(os.environ["RANK"]),
                      world_size=int(os.environ["WORLD_SIZE"]))
    return kwargs


def init_timeout():
    """The timedelta for init_process_group(timeout=...), or None for torch's default. A backstop
    behind the watchdog, never shorter than torch's own 30 minutes: a barrier in a long checkpoint
    save must not time out where the watchdog would have allowed it."""
    timeout = configured_timeout()
    return datetime.timedelta(seconds=max(6 * timeout, 1800.0)) if timeout else None


def leave(code: int) -> NoReturn:
    """End this rank's process now, stdout and stderr flushed, without the interpreter's teardown.
    NOTE: at that teardown, tensors still referenced from gloo's C++ work objects (the last barrier, a
    broadcast) are freed by gloo's worker thread while Python shuts down; taking the GIL then ends the
    thread, which aborts a rank whose run succeeded ("terminate called without an active exception",
    SIGABRT; 5 of 72 runs on a loaded 2-core CPU, torch 2.13). Call it only once everything this process
    writes is closed."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def finish_rank() -> NoReturn:
    """The end of a finished CPU/GPU rank's script: the process group torn down together (a barrier,
    then destroy) when one is up, then `leave(0)`."""
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    leave(0)
