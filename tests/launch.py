"""The one launcher helper for multi-rank tests: real torchrun processes on 127.0.0.1, bounded by a
timeout so a hang fails fast with a clear message instead of stalling the suite."""
from __future__ import annotations

import importlib.util
import json
import socket
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_env(**extra: str) -> dict:
    from shardfit.runtime_env import launch_env

    env = launch_env()
    env["PYTHONUNBUFFERED"] = "1"
    env.update(extra)
    return env


def torchrun(args: list[str], nproc: int = 2, timeout: float = 180, nnodes: int = 1, node_rank: int | None = None,
             port: int | None = None, env: dict | None = None, cwd: Path | None = None,
             check: bool = True) -> subprocess.CompletedProcess:
    """Run `torchrun --nproc-per-node nproc ARGS` (ARGS start with a script path or `-m module`)."""
    port = port or free_port()
    command = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}"]
    if nnodes > 1:
        command += [f"--nnodes={nnodes}", "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}",
                    f"--node-rank={node_rank or 0}"]
    else:
        command += ["--standalone"] if port is None else [f"--master-port={port}", "--master-addr=127.0.0.1"]
    return run(command + list(args), timeout=timeout, env=env, cwd=cwd, check=check)


def run(command: list[str], timeout: float = 180, env: dict | None = None, cwd: Path | None = None,
        check: bool = True) -> subprocess.CompletedProcess:
    try:
        result = subprocess.run(command, capture_output=True, text=True, timeout=timeout,
                                env=env or test_env(), cwd=cwd or REPO)
    except subprocess.TimeoutExpired as exc:
        out = (exc.stdout or b"")[-3000:] if isinstance(exc.stdout, bytes) else (exc.stdout or "")[-3000:]
        raise AssertionError(f"timed out after {timeout:.0f}s (a hang?): {' '.join(map(str, command))}\n{out}") from None
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
