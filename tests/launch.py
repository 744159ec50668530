"""The one launcher helper for multi-rank tests: real torchrun processes on 127.0.0.1, bounded by a
timeout so a hang fails fast with a clear message instead of stalling the suite."""
from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

from shardfit import launcher
from shardfit.launcher import free_port  # noqa: F401 - the tests' free port is the launcher's
from shardfit.runtime_env import launch_env

REPO = Path(__file__).resolve().parents[1]


def test_env(**extra: str) -> dict:
    env = launch_env()
    env["PYTHONUNBUFFERED"] = "1"
    env.update(extra)
    return env


def torchrun(args: list[str], nproc: int = 2, timeout: float = 180, nnodes: int = 1, node_rank: int | None = None,
             port: int | None = None, env: dict | None = None, cwd: Path | None = None,
             check: bool = True) -> subprocess.CompletedProcess:
    """Run `torchrun --nproc-per-node nproc ARGS` (ARGS start with a script path or `-m module`) through
    the product's one launcher: at the timeout the whole job, ranks included, is stopped. One node
    without a port: --standalone; with a port (or several nodes): 127.0.0.1:port."""
    endpoint = f"127.0.0.1:{port or free_port()}" if (port or nnodes > 1) else None
    done = launcher.torchrun(list(args), nproc, timeout=timeout, nnodes=nnodes, node_rank=node_rank or 0,
                             endpoint=endpoint, env=env or test_env(), cwd=cwd or REPO, capture=True)
    command = " ".join(map(str, done.command))
    if done.timed_out:
        raise AssertionError(f"timed out after {timeout:.0f}s (a hang?), every rank stopped: {command}\n"
                             f"{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    if check and done.returncode != 0:
        raise AssertionError(f"exit {done.returncode}: {command}\n"
                             f"--- stdout ---\n{done.stdout[-4000:]}\n--- stderr ---\n{done.stderr[-6000:]}")
    return subprocess.CompletedProcess(list(done.command), done.returncode, done.stdout, done.stderr)


def run(command: list[str], timeout: float = 180, env: dict | None = None, cwd: Path | None = None,
        check: bool = True) -> subprocess.CompletedProcess:
    """Run a command (a CLI that may itself start torchrun) in a process group of its own: at the
    timeout the whole group is killed, not only the command."""
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               env=env or test_env(), cwd=cwd or REPO, start_new_session=True)
    try:
        stdout, stderr = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        stdout, _ = process.communicate()
        raise AssertionError(f"timed out after {timeout:.0f}s (a hang?): {' '.join(map(str, command))}\n"
                             f"{stdout[-3000:]}") from None
    except BaseException:
        os.killpg(process.pid, signal.SIGKILL)
        raise
    result = subprocess.CompletedProcess(command, process.returncode, stdout, stderr)
    if check and result.returncode != 0:
        raise AssertionError(f"exit {result.returncode}: {' '.join(map(str, command))}\n"
                             f"--- stdout ---\n{result.stdout[-4000:]}\n--- stderr ---\n{result.stderr[-6000:]}")
    return result


def shardfit(*args: str, timeout: float = 120, check: bool = True, env: dict | None = None,
             cwd: Path | None = None) -> subprocess.CompletedProcess:
    """Run the real CLI in a subprocess."""
    return run([sys.executable, "-m", "shardfit", *args], timeout=timeout, check=check, env=env, cwd=cwd)


def run_losses(out: Path) -> dict:
    """step -> loss from a run's metrics.jsonl; a step replayed after a restart keeps its last value."""
    found = {}
    for line in (Path(out) / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        found[record["step"]] = record["loss"]
    return found


def load_benchmark(name: str):
    """A script of benchmarks/ as a module (its functions are what the tests check)."""
    spec = importlib.util.spec_from_file_location(name, REPO / "benchmarks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module
