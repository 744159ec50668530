"""The one torchrun launcher (shardfit/launcher.py): the command it builds, its refusal inside a test
not marked multirank, and a real job stopped whole at its timeout, ranks included."""
from __future__ import annotations

import os
import sys
import textwrap
import time

import pytest

import launch
from shardfit import launcher
from shardfit.errors import ShardfitError


def test_the_command_for_one_node_an_endpoint_and_several_nodes():
    one = launcher.torchrun_command(["-m", "pkg.worker", "a"], 2)
    assert one[1] == "-m" and one[2].startswith("torch.distributed") and "--standalone" in one and one[-3:] == ["-m", "pkg.worker", "a"]
    pinned = launcher.torchrun_command(["s.py"], 1, endpoint="127.0.0.1:29511", options=["--max-restarts=2"])
    assert "--master-addr=127.0.0.1" in pinned and "--master-port=29511" in pinned and "--standalone" not in pinned
    assert pinned.index("--max-restarts=2") < pinned.index("s.py")
    nodes = launcher.torchrun_command(["s.py"], 8, nnodes=2, node_rank=1, endpoint="h:1")
    assert {"--nnodes=2", "--node-rank=1", "--rdzv-backend=c10d", "--rdzv-endpoint=h:1"} <= set(nodes)
    with pytest.raises(ShardfitError, match="rendezvous endpoint"):
        launcher.torchrun_command(["s.py"], 8, nnodes=2)


def test_a_test_not_marked_multirank_cannot_start_torchrun(tmp_path):
    # tests/conftest.py set the variable for this (unmarked) test: nothing is started.
    assert os.environ.get(launcher.FORBID_ENV) == os.environ.get("PYTEST_CURRENT_TEST", "").rsplit(" ", 1)[0]
    with pytest.raises(ShardfitError, match="multirank"):
        launcher.torchrun([str(tmp_path / "never.py")], 1, timeout=5)
    assert not any(tmp_path.iterdir())


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie (exited, not yet reaped by its parent) is gone for our purpose.
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().split()[2] != "Z"
    except FileNotFoundError:
        return False


@pytest.mark.multirank
def test_a_job_past_its_timeout_is_stopped_with_its_ranks(tmp_path):
    script = tmp_path / "hang.py"
    script.write_text(textwrap.dedent("""
        import os, sys, time
        open(os.path.join(sys.argv[1], f"rank{os.environ['RANK']}.pid"), "w").write(str(os.getpid()))
        time.sleep(600)  # a hang
    """))
    started = time.monotonic()
    done = launcher.torchrun([str(script), str(tmp_path)], 2, timeout=25, env=launch.test_env(), cwd=launch.REPO, capture=True)
    assert done.timed_out and done.returncode is None
    assert done.seconds < 25 + launcher.TERM_GRACE_S + 15
    pids = [int(path.read_text()) for path in sorted(tmp_path.glob("rank*.pid"))]
    assert len(pids) == 2, f"the ranks did not start within the timeout: {done.stderr[-2000:]}"
    deadline = time.monotonic() + 20
    while any(_alive(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not any(_alive(pid) for pid in pids), f"ranks outlived the launcher ({time.monotonic() - started:.0f}s)"
    assert sys.executable in done.command[0]


def test_a_build_lock_nobody_holds_is_removed_and_a_held_one_kept(tmp_path):
    """What a killed DeepSpeed op build leaves (tests/launch.py removes it after a launcher run): a
    lock file no live process has open. A live builder keeps its lock open until it releases it."""
    from torch.utils.file_baton import FileBaton

    (tmp_path / "cpu_adam").mkdir()
    (tmp_path / "cpu_adam" / "lock").touch()  # its builder was killed
    (tmp_path / "fused_adam").mkdir()
    held = FileBaton(str(tmp_path / "fused_adam" / "lock"))
    assert held.try_acquire()  # torch's own lock, as a building rank holds it
    try:
        assert launch.remove_stale_locks(tmp_path) == [tmp_path / "cpu_adam" / "lock"]
        assert (tmp_path / "fused_adam" / "lock").exists() and not (tmp_path / "cpu_adam" / "lock").exists()
    finally:
        held.release()
    assert launch.remove_stale_locks(tmp_path) == []
