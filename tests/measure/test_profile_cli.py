"""`shardfit profile`: a real 2-rank run from flags, JSON and chart; a user's script; bad input."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from launch import shardfit
from shardfit.measure.compare import format_comparison

pytest.importorskip("torch")
DATA = Path(__file__).parent / "data"


@pytest.mark.multirank  # a real `shardfit profile` run: torchrun with 1-2 ranks
@pytest.mark.slow
def test_profile_flags_json_chart_and_text(tmp_path):
    chart = tmp_path / "profile.png"
    done = shardfit("profile", "--model", "tiny-gpt2", "--strategy", "fsdp2", "--precision", "bf16", "--seq", "32",
                    "--ac", "full", "--checkpoint", "--json", "--chart", str(chart), timeout=300)
    result = json.loads(done.stdout)
    measured = result["measured"]
    assert set(measured) == {"load", "forward", "backward", "optimizer", "checkpoint"}
    assert measured["forward"]["activations"] > 0 and measured["optimizer"]["grads"] > 0
    assert len(result["report"]["ranks"]) == 2
    assert chart.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert result["estimate"] is not None, "the estimator gave no prediction for this plan"
    text = format_comparison(result["comparison"])
    assert "measured" in text and "predicted" in text and "peak:" in text
    assert result["comparison"]["forward"]["params"]["error"] == pytest.approx(0, abs=0.02)


@pytest.mark.multirank  # a real `shardfit profile` run: torchrun with 1-2 ranks
@pytest.mark.slow
def test_profile_single_runs_one_rank_without_nproc():
    done = shardfit("profile", "--strategy", "single", "--precision", "bf16", "--seq", "32", "--json", timeout=300)
    result = json.loads(done.stdout)
    assert result["label"] == "single" and len(result["report"]["ranks"]) == 1
    assert result["plan"]["cluster"]["gpus_per_node"] == 1
    assert result["measured"]["load"].get("grads", 0) == 0  # no reducer buckets, no grads between steps
    assert abs(result["comparison"]["peak"]["error"]) < 0.05
    text = shardfit("profile", "--strategy", "single", "--seq", "32", timeout=300).stdout
    assert "· single ·" in text and "· 1 rank ·" in text
    refused = shardfit("profile", "--strategy", "single", "--nproc", "2", check=False, timeout=60)
    lines = refused.stderr.strip().splitlines()
    assert refused.returncode == 2 and len(lines) == 1 and "single runs on one device" in lines[0]


@pytest.mark.multirank  # a real `shardfit profile` run: torchrun with 1-2 ranks
@pytest.mark.slow
def test_profile_script_reports_every_rank(tmp_path):
    width = 256
    done = shardfit("profile", "--script", str(DATA / "user_train.py"), "--json", "--", "--steps", "2",
                    "--width", str(width), timeout=300)
    result = json.loads(done.stdout)
    assert result["world_size"] == 2
    n = 2 * (width * 4 * width) + 4 * width + width
    forward = result["phases"]["forward"]
    assert forward["params"] == 4 * n  # discovered through the first forward, inside DDP
    assert forward["optimizer"] == 8 * n + 4 * 4  # AdamW moments + four step scalars
    assert result["phases"]["optimizer"]["grads"] == 4 * n


@pytest.mark.multirank  # a real `shardfit profile` run: torchrun with 2 ranks
@pytest.mark.slow
def test_profile_script_that_ends_with_os_exit_still_reports_every_rank():
    # The scripts `shardfit emit` writes end a CPU rank with os._exit(0): the report must survive it,
    # and the script's exit code must still be the run's.
    done = shardfit("profile", "--script", str(DATA / "user_train.py"), "--json", "--", "--steps", "2",
                    "--width", "64", "--os-exit", "0", timeout=300)
    result = json.loads(done.stdout)
    assert result["world_size"] == 2 and result["phases"]["optimizer"]["grads"] > 0
    failed = shardfit("profile", "--script", str(DATA / "user_train.py"), "--", "--steps", "2", "--width", "64",
                      "--os-exit", "3", timeout=300, check=False)
    assert failed.returncode != 0 and "exit code 3" in failed.stderr, failed.stderr[-2000:]


@pytest.mark.multirank  # a real `shardfit profile` run: torchrun with 1-2 ranks
@pytest.mark.slow
def test_profile_script_that_fails_shows_its_own_error_and_what_it_reached():
    done = shardfit("profile", "--script", str(DATA / "user_train.py"), "--", "--steps", "3", "--width", "64",
                    "--fail-at-step", "2", timeout=300, check=False)
    assert done.returncode == 1
    err = done.stderr
    # both ranks failed alike: shown once, with the exit code and the script's own traceback
    assert "the script failed on ranks 0, 1 (exit code 1), its stderr ends:" in err, err
    assert "RuntimeError: gradient check failed at step 2" in err and "user_train.py" in err
    assert "script_runner.py" not in err and "runpy" not in err  # the script's frames, not ours
    assert "  | checking the gradients" in err  # what the script wrote before raising
    head = done.stdout.splitlines()[0]
    assert "measured until the failure (reached backward, step 2)" in head, done.stdout
    table = {line.split()[0]: line for line in done.stdout.splitlines()[1:] if line.strip()}
    assert "backward" in table and "optimizer" in table  # step 1 completed: every phase was measured


@pytest.mark.parametrize("args, message", [
    (["--strategy", "zero9"], "unknown strategy"),
    (["no-such-plan.yaml"], "not found"),
    (["--script", "missing.py"], "not found"),
    (["--budget", "-5"], "budget"),
])
def test_bad_input_is_one_line(args, message):
    done = shardfit("profile", *args, check=False, timeout=60)
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], done.stderr
