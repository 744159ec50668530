"""Crash-safe training with 2 real ranks: kill -9 mid-save and mid-step under torchrun restarts,
damaged checkpoints, weights-only loading, and a hung rank that must end the job in bounded time.

Three torchrun jobs in all (the machine is small): an uninterrupted reference run, one job that is
killed twice (attempt 0 dies in the step-4 save, attempt 1 mid-step 5) and must still finish with
the reference's losses, and one job where a rank stops answering.
"""
from __future__ import annotations

import re
import shutil
import time

import pytest
import torch

import launch

pytestmark = [pytest.mark.multirank, pytest.mark.slow]

# NOTE: through `shardfit train` (torchrun --standalone, the c10d rendezvous): torchrun's static
# rendezvous (--master-port) reuses one store across restarts, and a restarted gloo group can read
# the dead ranks' stale addresses from it and hang in init_process_group.
TRAIN = ["train", "--model", "tiny-llama", "--strategy", "ddp", "--precision", "fp32",
         "--micro-batch", "2", "--seq", "64", "--steps", "6", "--save-every", "2", "--keep", "3", "--log-every", "1",
         "--eval-every", "0", "--lr", "3e-3", "--no-progress"]



@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    out = tmp_path_factory.mktemp("crash") / "reference"
    launch.shardfit(*TRAIN, "--out", str(out), timeout=240)
    return out


@pytest.fixture(scope="module")
def killed_twice(tmp_path_factory):
    out = tmp_path_factory.mktemp("crash") / "killed"
    env = launch.test_env(SHARDFIT_TEST_KILL_AT="save:4:rank:1:attempt:0,step:5:rank:1:attempt:1")
    result = launch.shardfit(*TRAIN, "--max-restarts", "2", "--out", str(out), "--resume", "auto", env=env,
                             timeout=400)
    return out, result


def test_killed_mid_save_and_mid_step_resumes_and_matches(reference, killed_twice):
    out, result = killed_twice
    log = result.stdout + result.stderr
    assert "[fault] rank 1: kill at save 4 (attempt 0)" in log
    assert "[fault] rank 1: kill at step 5 (attempt 1)" in log
    assert "Traceback" not in log and "lost contact with another rank" in log
    # Attempt 1 resumed from step 2 (step 4 was never completed), attempt 2 from step 4.
    resumed = re.findall(r"resumed from \S+/(step-\d+) at step (\d+)", log)
    assert resumed == [("step-2", "2"), ("step-4", "4")], log[-3000:]
    expected, got = launch.run_losses(reference), launch.run_losses(out)
    assert sorted(got) == list(range(1, 7))
    # DDP in fp32 on CPU is deterministic and the RNG/data position are restored: exact continuation.
    assert got == expected


def test_partial_checkpoint_never_listed_and_all_verify(killed_twice):
    from shardfit.train import manifest

    out, _ = killed_twice
    root = out / "checkpoints"
    assert sorted(p.name for p in root.iterdir() if p.name.startswith("step-")) == ["step-2", "step-4", "step-6"]
    for folder in manifest.step_folders(root):
        assert manifest.problems(folder) == []
        table = manifest.read_manifest_file(folder)["files"]
        assert any(name.startswith("dcp/") for name in table) and "rng/rank-1.pt" in table


def test_checkpoint_files_load_weights_only(reference):
    from shardfit.train.checkpoint import set_rng_state

    step = reference / "checkpoints" / "step-6"
    trainer = torch.load(step / "trainer.pt", weights_only=True)
    assert trainer["step"] == 6
    state = torch.load(step / "rng" / "rank-0.pt", weights_only=True)
    set_rng_state(state)  # round trip: python, numpy and torch states restore from the safe form


def _copy(reference, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(reference, run)
    return run


def test_truncated_file_named_and_latest_valid_falls_back(reference, tmp_path, capsys):
    from shardfit.cli import main
    from shardfit.train.checkpoint import resolve_resume

    run = _copy(reference, tmp_path)
    shard = sorted((run / "checkpoints" / "step-6" / "dcp").glob("*.distcp"))[0]
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    rc = main(["export", str(run / "checkpoints" / "step-6"), "--out", str(tmp_path / "hf")])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1, err
    assert str(shard) in err[0] and "truncated" in err[0] and "latest-valid" in err[0]
    assert not (tmp_path / "hf").exists()
    skipped = []
    assert resolve_resume("latest-valid", run, log=skipped.append) == run / "checkpoints" / "step-4"
    assert len(skipped) == 1 and "step-6" in skipped[0] and shard.name in skipped[0]


def test_flipped_byte_and_missing_manifest(reference, tmp_path):
    from shardfit.errors import ShardfitError
    from shardfit.train.checkpoint import read_manifest, resolve_resume

    run = _copy(reference, tmp_path)
    rng = run / "checkpoints" / "step-6" / "rng" / "rank-1.pt"
    data = bytearray(rng.read_bytes())
    data[len(data) // 2] ^= 0xFF  # same size, different content
    rng.write_bytes(bytes(data))
    with pytest.raises(ShardfitError, match=r"rank-1\.pt is corrupted: its xxh3_128 differs"):
        read_manifest(run / "checkpoints" / "step-6")
    (run / "checkpoints" / "step-4" / "manifest.json").unlink()  # a save that never finished
    assert resolve_resume("latest-valid", run) == run / "checkpoints" / "step-2"
    assert resolve_resume("auto", tmp_path / "empty") is None
    with pytest.raises(ShardfitError, match="no intact checkpoint"):
        resolve_resume("latest-valid", tmp_path / "empty")


def test_hung_rank_ends_within_timeout(tmp_path):
    timeout = 8
    env = launch.test_env(SHARDFIT_TEST_HANG_AT="step:3:rank:1")
    started = time.monotonic()
    result = launch.shardfit(*TRAIN, "--out", str(tmp_path / "hang"), "--save-every", "0",
                             "--collective-timeout", str(timeout), env=env, timeout=240, check=False)
    wall = time.monotonic() - started
    log = result.stdout + result.stderr
    assert result.returncode != 0
    assert "[fault] rank 1: hang at step 3" in log
    line = next((l for l in log.splitlines() if "shardfit: error: hang:" in l), None)
    assert line is not None, log[-3000:]
    # Rank 0 names where it waited, which rank is missing and where that rank was last seen.
    assert "rank 0 waited" in line and "step 3 all_reduce(loss)" in line, line
    assert "rank 1 is stuck after step 3 forward/backward" in line, line
    # torchrun's own traceback and failure table are replaced by one summary line.
    assert "Traceback" not in log and "training stopped: rank 0 exited with code 124" in log, log[-3000:]
    waited = float(re.search(r"waited (\d+) s", line).group(1))
    assert timeout <= waited <= timeout + 5
    assert wall < 200, f"the job took {wall:.0f} s to end"


@pytest.mark.parametrize("nproc", [2, 1])
def test_resume_from_a_flipped_shard_stops_before_writing(reference, tmp_path, nproc):
    """The size is right, so only the contents can tell: with 1 rank on this 2-core machine they are
    hashed in a thread during the load, with 2 ranks right after it. Either way the run stops before
    its first step with one line naming the shard (printed once), and nothing new is written."""
    run = _copy(reference, tmp_path)
    shard = run / "checkpoints" / "step-6" / "dcp" / "__1_0.distcp"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x01
    shard.write_bytes(bytes(data))
    before = sorted(p.name for p in (run / "checkpoints").iterdir())
    lines = len((run / "metrics.jsonl").read_text().splitlines())
    result = launch.shardfit(*TRAIN, "--steps", "8", "--nproc", str(nproc), "--resume", "latest", "--out", str(run),
                             timeout=240, check=False)
    log = result.stdout + result.stderr
    assert result.returncode != 0 and "Traceback" not in log, log[-3000:]
    errors = [l for l in log.splitlines() if "is corrupted" in l]
    assert len(errors) == 1 and f"{shard} is corrupted: its xxh3_128 differs from the manifest" in errors[0], log[-3000:]
    assert "latest-valid" in errors[0] and "resumed from" not in log and "step 7/8" not in log
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == before
    assert len((run / "metrics.jsonl").read_text().splitlines()) == lines
