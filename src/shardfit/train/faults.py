"""Fault injection for the reliability tests: a rank kills itself or stops answering at a chosen point.

    SHARDFIT_TEST_KILL_AT="step:3:rank:1"           rank 1 SIGKILLs itself in step 3 (after backward)
    SHARDFIT_TEST_KILL_AT="save:4:rank:1"           ... while saving the step-4 checkpoint (its shard
                                                    written, the manifest not yet)
    SHARDFIT_TEST_HANG_AT="step:2:rank:1"           rank 1 sleeps forever in step 2
    SHARDFIT_TEST_OOM_AT="step:2:rank:0"            rank 0 raises torch.OutOfMemoryError in step 2
    SHARDFIT_TEST_SIGNAL_AT="micro:3:rank:1"        rank 1 sends itself SIGTERM mid-step 3 (`:signal:10`
                                                    for another signal number: a preemption)
    SHARDFIT_TEST_IOERROR_AT="save:4:rank:1"        rank 1's step-4 save fails with ENOSPC (`:errno:30`
                                                    for EROFS, 5 for EIO): the fallback of the full-disk tests

Several points are separated by commas; `:attempt:N` fires only in torchrun's N-th (re)start
(default 0, the first), so a restarted job runs clean. Unset variables cost one dict lookup.
"""
from __future__ import annotations

import errno
import os
import signal
import sys
import time

_VARS = {"kill": "SHARDFIT_TEST_KILL_AT", "hang": "SHARDFIT_TEST_HANG_AT", "oom": "SHARDFIT_TEST_OOM_AT",
         "signal": "SHARDFIT_TEST_SIGNAL_AT", "ioerror": "SHARDFIT_TEST_IOERROR_AT"}


def _points(text: str) -> list[dict]:
    points = []
    for item in filter(None, (part.strip() for part in text.split(","))):
        words = item.split(":")
        point = {"where": words[0], "at": int(words[1]), "rank": None, "attempt": 0}
        for key, value in zip(words[2::2], words[3::2]):
            point[key] = int(value)
        points.append(point)
    return points


def _attempt() -> int:
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)


def hit(where: str, at: int, rank: int, path=None) -> None:
    """Call at each injection point; does nothing unless a test asked for a fault here. path: the
    file an injected I/O error names."""
    for kind, var in _VARS.items():
        text = os.environ.get(var)
        if not text:
            continue
        for point in _points(text):
            if point["where"] != where or point["at"] != at or point["attempt"] != _attempt():
                continue
            if point["rank"] is not None and point["rank"] != rank:
                continue
            _fire(kind, where, at, rank, point, path)


def _fire(kind: str, where: str, at: int, rank: int, point: dict, path) -> None:
    print(f"[fault] rank {rank}: {kind} at {where} {at} (attempt {_attempt()})", file=sys.stderr, flush=True)
    if kind == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    elif kind == "hang":
        while True:  # a rank that stops answering: alive, but never reaches the next collective
            time.sleep(3600)
    elif kind == "oom":
        import torch

        raise torch.OutOfMemoryError(f"injected out-of-memory at {where} {at} on rank {rank}")
    elif kind == "signal":
        os.kill(os.getpid(), point.get("signal", int(signal.SIGTERM)))
    elif kind == "ioerror":
        code = point.get("errno", errno.ENOSPC)
        raise OSError(code, os.strerror(code), str(path) if path is not None else None)


if os.environ.get("SHARDFIT_TEST_STACKS"):  # `kill -USR1 PID` prints every thread's stack (debugging a hang)
    import faulthandler

    faulthandler.register(signal.SIGUSR1, all_threads=True)
