"""A full or failing disk during a save: the previous checkpoint stays intact and loadable, one line
names the path and the free space, the run stops or trains on per schedule.on_save_error, and
retention never deletes the newest intact checkpoint for a damaged one.

For real: a 4 MiB tmpfs mounted as OUT/checkpoints (one tiny-llama checkpoint is ~3 MB, so the
second save runs out of space), later remounted read-only. Where mounting is not allowed that test
skips with the reason; the fault injected at the writer (EIO on one rank) always runs.
"""
from __future__ import annotations

import json
import subprocess

import pytest

import launch

TRAIN = ["train", "--model", "tiny-llama", "--strategy", "ddp", "--precision", "fp32", "--micro-batch", "2",
         "--seq", "64", "--steps", "6", "--save-every", "2", "--keep", "3", "--log-every", "1", "--eval-every", "0",
         "--lr", "3e-3", "--no-progress"]


def _problems(folder):
    from shardfit.train import manifest
    return manifest.problems(folder)


@pytest.fixture
def small_fs(tmp_path):
    out = tmp_path / "run"
    mount = out / "checkpoints"
    mount.mkdir(parents=True)
    made = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(mount)], capture_output=True, text=True)
    if made.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here ({made.stderr.strip() or made.returncode}): the injected-fault "
                    "test covers the writer")
    yield out, mount
    subprocess.run(["umount", "-l", str(mount)], capture_output=True)


@pytest.mark.multirank
@pytest.mark.slow
def test_full_then_read_only_disk_keeps_the_last_checkpoint(small_fs):
    out, mount = small_fs
    full = launch.shardfit(*TRAIN, "--out", str(out), timeout=300, check=False)
    log = full.stdout + full.stderr
    assert full.returncode != 0 and "Traceback" not in log, log[-3000:]
    lines = [line for line in log.splitlines() if "was not saved" in line]
    assert len(lines) == 1, log[-3000:]
    line = lines[0]
    assert line.startswith("shardfit: error: checkpoint step-4 was not saved: I/O error ENOSPC") and str(mount) in line
    assert "MiB free there" in line and f"the previous checkpoint {mount / 'step-2'} is intact" in line
    assert "the run stops" in line
    assert sorted(p.name for p in mount.iterdir()) == ["step-2"]  # no half-written step-4 left behind
    assert _problems(mount / "step-2") == []

    remounted = subprocess.run(["mount", "-o", "remount,ro", str(mount)], capture_output=True, text=True)
    if remounted.returncode != 0:
        pytest.skip(f"cannot remount read-only: {remounted.stderr.strip()}")
    going = launch.shardfit(*TRAIN, "--out", str(out), "--resume", "auto", "--on-save-error", "continue",
                            timeout=300, check=False)
    log = going.stdout + going.stderr
    assert going.returncode == 0, log[-3000:]
    assert "resumed from" in log and "at step 2" in log
    warnings = [line for line in log.splitlines() if "was not saved" in line]
    assert [w.split(" was not saved")[0][-6:] for w in warnings] == ["step-4", "step-6"], log[-3000:]
    assert all("EROFS" in w and "training goes on" in w and "MiB free there" in w for w in warnings), warnings
    steps = [json.loads(l)["step"] for l in (out / "metrics.jsonl").read_text().splitlines()]
    assert steps[-1] == 6  # the run went on to the end
    assert sorted(p.name for p in mount.iterdir()) == ["step-2"] and _problems(mount / "step-2") == []


@pytest.mark.multirank
@pytest.mark.slow
def test_injected_io_error_on_one_rank_skips_that_save_only(tmp_path):
    out = tmp_path / "run"
    env = launch.test_env(SHARDFIT_TEST_IOERROR_AT="save:4:rank:1:errno:5")  # EIO, rank 1 alone
    result = launch.shardfit(*TRAIN, "--out", str(out), "--on-save-error", "continue", env=env, timeout=300)
    log = result.stdout + result.stderr
    warnings = [line for line in log.splitlines() if "was not saved" in line]
    assert len(warnings) == 1 and "Traceback" not in log, log[-3000:]
    assert "I/O error EIO" in warnings[0] and str(out / "checkpoints" / ".tmp-step-4") in warnings[0]
    assert f"the previous checkpoint {out / 'checkpoints' / 'step-2'} is intact" in warnings[0]
    root = out / "checkpoints"
    assert sorted(p.name for p in root.iterdir()) == ["step-2", "step-6"]
    assert _problems(root / "step-2") == [] and _problems(root / "step-6") == []


def _checkpoint(root, step: int, payload: bytes):
    from shardfit.train.checkpoint import write_manifest

    folder = root / f"step-{step}"
    folder.mkdir(parents=True)
    (folder / "state.bin").write_bytes(payload)
    write_manifest(folder, {"step": step, "format": "dcp", "engine": "ddp"})
    return folder


def test_retention_counts_only_intact_checkpoints(tmp_path):
    from shardfit.train.checkpoint import prune

    root = tmp_path / "checkpoints"
    folders = [_checkpoint(root, step, bytes([step]) * 1000) for step in (1, 2, 3, 4)]
    (folders[3] / "state.bin").write_bytes(b"\0" * 1000)  # step-4: same size, other bytes
    (folders[2] / "manifest.json").unlink()  # step-3: a save that never finished
    deleted = prune(root, keep=1)
    # The newest intact one is step-2: kept, though two newer folders exist; step-1 goes.
    assert [p.name for p in deleted] == ["step-1"]
    assert sorted(p.name for p in root.iterdir()) == ["step-2", "step-3", "step-4"]
    _checkpoint(root, 5, b"5" * 1000)
    deleted = prune(root, keep=2)
    assert deleted == [] and (root / "step-2").is_dir() and (root / "step-5").is_dir()
    _checkpoint(root, 6, b"6" * 1000)
    deleted = prune(root, keep=2)
    # step-2 is now beyond the two newest intact (5, 6); the damaged step-4 older than them goes too.
    assert sorted(p.name for p in deleted) == ["step-2", "step-4"]
    assert sorted(p.name for p in root.iterdir()) == ["step-3", "step-5", "step-6"]


def test_retired_checkpoints_leave_every_listing_at_once_and_are_deleted_later(tmp_path):
    from shardfit.train.checkpoint import delete_retired, list_checkpoints, retire
    from shardfit.train.manifest import latest_valid

    root = tmp_path / "checkpoints"
    for step in (1, 2, 3):
        _checkpoint(root, step, bytes([step]) * 1000)
    (root / ".trash-step-0").mkdir()  # what a run that died while deleting leaves
    retired = retire(root, keep=1)
    assert [p.name for p in retired] == ["step-1", "step-2"]
    # Renamed, not yet deleted: no listing, resume or retention sees them.
    assert [p.name for p in list_checkpoints(root)] == ["step-3"] and latest_valid(root).name == "step-3"
    assert sorted(p.name for p in root.iterdir()) == [".trash-step-0", ".trash-step-1", ".trash-step-2", "step-3"]
    delete_retired(root)
    assert sorted(p.name for p in root.iterdir()) == ["step-3"]


def test_a_checkpoint_exception_is_described_by_its_os_error(tmp_path):
    import errno

    from torch.distributed.checkpoint.api import CheckpointException

    from shardfit.train.saver import describe

    target = tmp_path / "dcp" / "__1_0.distcp"
    inner = OSError(errno.ENOSPC, "No space left on device", str(target))
    text = describe(CheckpointException("write failed", {1: (inner, None)}), tmp_path)
    assert text.startswith("I/O error ENOSPC (No space left on device) writing ") and str(target) in text
    assert "MiB free there" in text
    assert describe(ValueError("bad\nsecond line"), tmp_path) == "ValueError: bad"
