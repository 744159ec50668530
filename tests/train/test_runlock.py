"""One writer per run folder: an O_EXCL lock file naming host, pid and start time; stale locks (a dead
pid on this host, or the same job restarted) are taken over; a live one refuses with one line."""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import pytest

import launch
from shardfit.errors import ShardfitError
from shardfit.train import runlock


def _write(out, **holder):
    out.mkdir(parents=True, exist_ok=True)
    (out / runlock.LOCK).write_text(json.dumps(holder))


def _dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def test_second_writer_refused_with_holder_then_released(tmp_path, monkeypatch):
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    out = tmp_path / "run"
    path = runlock.acquire(out)
    holder = json.loads(path.read_text())
    assert holder["host"] == socket.gethostname() and holder["pid"] == os.getpid() and holder["started"]
    # Another live process on this host holds it: refused, naming host, pid and start time.
    _write(out, host=socket.gethostname(), pid=os.getppid(), started="2026-01-01T00:00:00Z", job=None)
    with pytest.raises(ShardfitError) as err:
        runlock.acquire(out)
    message = str(err.value)
    assert "\n" not in message and f"pid {os.getppid()}" in message and socket.gethostname() in message
    assert "2026-01-01T00:00:00Z" in message and str(out / runlock.LOCK) in message
    runlock.release(out)  # not ours: left alone
    assert (out / runlock.LOCK).exists()


def test_stale_locks_are_taken_over_and_other_hosts_are_not(tmp_path, monkeypatch):
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "run-a")
    out = tmp_path / "run"
    _write(out, host=socket.gethostname(), pid=_dead_pid(), started="x", job=None)
    runlock.acquire(out)  # same host, dead pid: stale
    assert json.loads((out / runlock.LOCK).read_text())["pid"] == os.getpid()
    runlock.release(out)
    assert not (out / runlock.LOCK).exists()
    # Another host (a shared file system): its pid can't be checked from here, so it holds...
    _write(out, host="node-7", pid=1, started="y", job="TORCHELASTIC_RUN_ID=run-b")
    with pytest.raises(ShardfitError, match="host node-7, pid 1, started y"):
        runlock.acquire(out)
    # ... unless it was this same job before a restart on another node.
    _write(out, host="node-7", pid=1, started="y", job="TORCHELASTIC_RUN_ID=run-a")
    runlock.acquire(out)
    assert json.loads((out / runlock.LOCK).read_text())["host"] == socket.gethostname()


def test_unreadable_lock_is_held_not_replaced(tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    (out / runlock.LOCK).write_text("{not json")
    with pytest.raises(ShardfitError, match="unreadable"):
        runlock.acquire(out)


def test_train_refuses_a_run_folder_in_use(tmp_path):
    """The CLI says it in one line before torchrun starts (the workers' rank 0 would refuse too)."""
    out = tmp_path / "run"
    _write(out, host=socket.gethostname(), pid=os.getpid(), started="2026-12-02T00:00:00Z", job="SLURM_JOB_ID=1")
    result = launch.shardfit("train", "--model", "tiny-llama", "--steps", "2", "--out", str(out), "--no-progress",
                             check=False, timeout=120)
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert result.returncode == 2 and len(lines) == 1, result.stderr
    assert f"is in use by another job: host {socket.gethostname()}, pid {os.getpid()}" in lines[0]
    assert not (out / "metrics.jsonl").exists()
