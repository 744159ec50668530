"""Hang detection: a rank that stops answering ends the job with one clear line, not a silent hang.

Each rank runs a daemon thread. The loop wraps every part of a step that contains collectives in
`dog.watch(step, "all_reduce(loss)")`; entering and leaving are also posted to the c10d store (the
key-value store torchrun's rendezvous already runs), so when a rank has waited longer than the
timeout, its watchdog can name the rank(s) that fell behind and what they last did:

    shardfit: error: hang: rank 0 waited 20 s in step 3 all_reduce(loss); rank 1 is stuck after
    step 3 forward/backward 1/1 (last heard 21 s ago). Stopping the job (--collective-timeout 20).

then exits the process; torchrun stops the other ranks. The process group gets the same timeout
(init_process_group(timeout=...)) as a second line of defence inside the collectives themselves.
"""
from __future__ import annotations

import json
import os
import sys
import threading
import time
from contextlib import contextmanager

from shardfit.runtime_env import configured_timeout

EXIT_HANG = 124  # like timeout(1)
_KEY = "shardfit/progress/rank-{}"


def _store():
    try:
        from torch.distributed import distributed_c10d as c10d

        return c10d._get_default_store()
    except Exception:  # noqa: BLE001 - no store: the message just can't name the other ranks
        return None


class Watchdog:
    def __init__(self, rank: int, world_size: int, timeout_s: float | None, store=None, exit_process: bool = True):
        self.rank, self.world_size, self.timeout_s = rank, world_size, timeout_s
        self.store = store
        self.exit_process = exit_process
        self.fired: str | None = None
        self._current: tuple | None = None  # (step, what, started, limit)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = None
        if timeout_s:
            self._thread = threading.Thread(target=self._run, name="shardfit-watchdog", daemon=True)
            self._thread.start()

    @classmethod
    def for_context(cls, ctx, timeout_s: float | None = None) -> "Watchdog":
        timeout_s = configured_timeout() if timeout_s is None else timeout_s
        return cls(ctx.rank, ctx.world_size, timeout_s, _store() if timeout_s else None)

    def close(self) -> None:
        """Stop the thread and drop the store before the process group goes away: a c10d store still
        referenced from a live thread at interpreter exit is one more C++ object torn down late."""
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=5)
        self.store = None

    def _post(self, step: int, what: str, state: str) -> None:
        if self.store is None:
            return
        try:
            self.store.set(_KEY.format(self.rank), json.dumps({"step": step, "what": what, "state": state,
                                                               "t": time.time()}))
        except Exception:  # noqa: BLE001 - progress reports are advisory
            pass

    @contextmanager
    def watch(self, step: int, what: str, scale: float = 1.0):
        """`scale` stretches the timeout for parts that are legitimately slow (a checkpoint of a large
        model written to network storage) without loosening it for the step itself."""
        if not self.timeout_s:
            yield
            return
        self._post(step, what, "in")
        with self._lock:
            self._current = (step, what, time.monotonic(), self.timeout_s * scale)
        try:
            yield
        finally:
            with self._lock:
                self._current = None
            self._post(step, what, "done")

    # ---- the thread ------------------------------------------------------------------------------
    def _run(self) -> None:
        while not self._stop.wait(min(1.0, self.timeout_s / 10)):
            with self._lock:
                current = self._current
            if current is None:
                continue
            step, what, started, limit = current
            waited = time.monotonic() - started
            if waited > limit:
                self._fire(step, what, waited, limit)
                return

    def _peers(self, limit: float) -> list[str]:
        if self.store is None:
            return ["the other ranks did not answer"]
        now, notes = time.time(), []
        for rank in range(self.world_size):
            if rank == self.rank:
                continue
            key = _KEY.format(rank)
            try:
                if not self.store.check([key]):
                    notes.append(f"rank {rank} never reported progress")
                    continue
                info = json.loads(self.store.get(key))
            except Exception:  # noqa: BLE001
                notes.append(f"rank {rank} can't be reached")
                continue
            ago = now - info["t"]
            if ago < limit / 2:
                continue  # recently alive: also waiting, or fine
            where = "in" if info["state"] == "in" else "after"
            notes.append(f"rank {rank} is stuck {where} step {info['step']} {info['what']} (last heard {ago:.0f} s ago)")
        return notes or ["every other rank is waiting too (a lost message, or a rank outside the loop)"]

    def _fire(self, step: int, what: str, waited: float, limit: float) -> None:
        scaled = "" if limit == self.timeout_s else f", x{limit / self.timeout_s:g} for this part"
        line = (f"shardfit: error: hang: rank {self.rank} waited {waited:.0f} s in step {step} {what}; "
                + "; ".join(self._peers(limit))
                + f". Stopping the job (--collective-timeout {self.timeout_s:g}{scaled}).")
        self.fired = line
        print(line, file=sys.stderr, flush=True)
        if self.exit_process:
            os._exit(EXIT_HANG)
