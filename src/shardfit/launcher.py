"""The one torchrun launcher: train, profile, fit --verify, bench, calibrate and the tests start their
ranks here, so every launch gets the same environment (runtime_env.launch_env) and a job that
overruns its timeout is stopped whole, ranks included.

    done = torchrun(["-m", "shardfit.measure.worker", configs, out], 2, timeout=900, capture=True)
    done.returncode   # None: stopped at the timeout
"""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

from shardfit.errors import ShardfitError
from shardfit.runtime_env import launch_env

# NOTE: tests/conftest.py sets this for every test not marked `multirank`, so such a test that
# starts torchrun (even from a CLI subprocess: the variable is inherited) fails with a clear line.
FORBID_ENV = "SHARDFIT_FORBID_TORCHRUN"
TERM_GRACE_S = 30  # after SIGTERM at the timeout, torchrun gets this long to stop its ranks


@dataclass(frozen=True)
class Launched:
    """How a torchrun job ended. returncode None: it was stopped at the timeout."""
    returncode: int | None
    seconds: float
    command: tuple[str, ...]
    stdout: str = ""  # captured output (capture=True); partial when stopped at the timeout
    stderr: str = ""

    @property
    def timed_out(self) -> bool:
        return self.returncode is None


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def torchrun_command(target: Sequence[str], nproc: int, *, nnodes: int = 1, node_rank: int = 0,
                     endpoint: str | None = None, options: Sequence[str] = ()) -> list[str]:
    """`python -m torch.distributed.run ... TARGET` (TARGET: `-m module ARGS` or `script ARGS`).
    One node: --standalone, or --master-addr/--master-port at `endpoint` HOST:PORT; several nodes:
    c10d rendezvous at `endpoint` (the same on every node). `options` go to torchrun itself."""
    command = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}", *options]
    if nnodes > 1:
        if not endpoint:
            raise ShardfitError("several nodes need a rendezvous endpoint HOST:PORT, the same on every node "
                                "(--rdzv-endpoint)")
        command += [f"--nnodes={nnodes}", f"--node-rank={node_rank}", "--rdzv-backend=c10d",
                    f"--rdzv-endpoint={endpoint}"]
    elif endpoint:
        host, _, port = endpoint.partition(":")
        command += [f"--master-addr={host}", f"--master-port={port or 29500}"]
    else:
        command += ["--standalone"]
    return command + list(target)


def torchrun(target: Sequence[str], nproc: int, *, timeout: float | None, nnodes: int = 1, node_rank: int = 0,
             endpoint: str | None = None, options: Sequence[str] = (), env: dict | None = None,
             cwd: str | Path | None = None, log: Path | None = None, capture: bool = False,
             watch: Callable[[subprocess.Popen], None] | None = None) -> Launched:
    """Run one torchrun job and wait for it.

    timeout: seconds, then the job's whole process group is stopped (SIGTERM, then SIGKILL) and
        returncode is None. None: no limit, and the job stays in this process's group, so the
        terminal's Ctrl-C and a scheduler's signals reach torchrun as they would reach us (train).
    env: the ranks' environment (default runtime_env.launch_env()).
    log: append the command and the job's stdout + stderr to this file.
    capture: keep stdout and stderr (text) in the result instead.
    watch: called with the started process, whose stderr is a text pipe (train filters it live).
    """
    command = torchrun_command(target, nproc, nnodes=nnodes, node_rank=node_rank, endpoint=endpoint, options=options)
    if os.environ.get(FORBID_ENV):
        raise ShardfitError(f"torchrun refused: {FORBID_ENV} is set ({os.environ[FORBID_ENV]}): a test that starts "
                            "torchrun must be marked pytest.mark.multirank")
    streams: dict = {}
    sink = None
    if log is not None:
        sink = open(log, "a")
        sink.write("$ " + " ".join(command) + "\n")
        sink.flush()
        streams = {"stdout": sink, "stderr": subprocess.STDOUT}
    elif capture:
        streams = {"stdout": subprocess.PIPE, "stderr": subprocess.PIPE}
    elif watch is not None:
        streams = {"stderr": subprocess.PIPE}
    start = time.perf_counter()
    try:
        process = subprocess.Popen(command, env=launch_env() if env is None else env, cwd=cwd, text=True,
                                   errors="replace", start_new_session=timeout is not None, **streams)
        out, err, code = _wait(process, timeout, watch)
    finally:
        if sink is not None:
            sink.close()
    return Launched(returncode=code, seconds=time.perf_counter() - start, command=tuple(command),
                    stdout=out or "", stderr=err or "")


def _wait(process: subprocess.Popen, timeout: float | None, watch) -> tuple[str | None, str | None, int | None]:
    try:
        if watch is not None:
            watch(process)
        out, err = process.communicate(timeout=timeout)
        return out, err, process.returncode
    except subprocess.TimeoutExpired:
        # NOTE: torchrun starts each rank in a session of its own, out of this group's reach: SIGTERM
        # first lets torchrun stop its ranks (a SIGKILL alone left them hanging in a collective).
        os.killpg(process.pid, signal.SIGTERM)
        try:
            out, err = process.communicate(timeout=TERM_GRACE_S)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            out, err = process.communicate()
        return out, err, None
    except BaseException:  # Ctrl-C, or a failing watch: the job must not outlive us
        if timeout is not None:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
            raise
        # In our group (train): torchrun got the terminal's Ctrl-C too. SIGTERM, which it passes on
        # to its ranks, then the grace period; a SIGKILL alone would orphan the ranks.
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(timeout=TERM_GRACE_S)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        raise
