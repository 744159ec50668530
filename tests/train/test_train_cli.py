"""`shardfit train / export` as a user runs them: the command relaunches itself under torchrun."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest
import launch
from launch import REPO, free_port, shardfit

pytestmark = [pytest.mark.multirank, pytest.mark.slow]


def _metrics(out):
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def default_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("cli") / "run"
    result = shardfit("train", "--out", str(out), "--no-progress", "--export", str(out / "hf"), timeout=300)
    return out, result


def test_default_train_runs_and_logs(default_run):
    out, result = default_run
    records = _metrics(out)
    assert [r["step"] for r in records] == list(range(1, 21))
    assert records[-1]["loss"] < records[0]["loss"] - 1.0
    assert "step 20/20 | loss" in result.stdout and "tok/s | rss " in result.stdout
    evals = [r for r in records if "val_loss" in r]
    assert [r["step"] for r in evals] == [10, 20] and evals[1]["val_loss"] < evals[0]["val_loss"]
    assert isinstance(evals[1]["sample"], str) and "sample 'In the morning, the baker' ->" in result.stdout
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step-10", "step-20"]


def test_resume_latest_continues(default_run, tmp_path):
    out, _ = default_run
    resumed = tmp_path / "resumed"
    # Resume the step-10 checkpoint into a fresh folder: steps 11..20 equal the original run exactly.
    result = shardfit("train", "--out", str(resumed), "--no-progress", "--resume", str(out / "checkpoints" / "step-10"),
                      timeout=300)
    assert "resumed from" in result.stdout
    original = {r["step"]: r["loss"] for r in _metrics(out)}
    again = {r["step"]: r["loss"] for r in _metrics(resumed)}
    assert sorted(again) == list(range(11, 21))
    assert all(again[k] == original[k] for k in again)


def test_export_command_loads_in_transformers(default_run, tmp_path):
    import torch
    from transformers import AutoModelForCausalLM

    out, _ = default_run
    result = shardfit("export", str(out), "--out", str(tmp_path / "hf"))
    assert "exported" in result.stdout and "step-20" in result.stdout
    offline = AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf")).eval()
    live = AutoModelForCausalLM.from_pretrained(str(out / "hf")).eval()
    ids = torch.tensor([[256, *b"In the morning"]])
    with torch.no_grad():
        assert torch.equal(offline(input_ids=ids).logits, live(input_ids=ids).logits)
    assert (out / "hf" / "TOKENIZER.txt").is_file()
    assert (tmp_path / "hf" / "TOKENIZER.txt").read_text() == (out / "hf" / "TOKENIZER.txt").read_text()


def test_two_nodes_hybrid_shard_match_one_node(default_run, tmp_path):
    """Two torchrun agents (one rank each) meet through c10d on 127.0.0.1; FSDP2 over a (2, 1) mesh
    (2 replicas of 1 shard) must give the same losses as the one-node run."""
    out, _ = default_run
    port = free_port()
    command = [sys.executable, "-m", "shardfit", "train", "--nproc", "1", "--nnodes", "2",
               "--rdzv-endpoint", f"127.0.0.1:{port}", "--shard-group-size", "1", "--save-every", "0",
               "--eval-every", "0", "--no-progress"]
    # NOTE: the two agents must run at once, so not through launch.run (one command at a time); each
    # in a process group of its own, killed whole (its torchrun and ranks too) if it overruns.
    nodes = [subprocess.Popen(command + ["--node-rank", str(rank), "--out", str(tmp_path / f"node{rank}")],
                              cwd=REPO, env=launch.test_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              start_new_session=True)
             for rank in (0, 1)]
    logs = []
    try:
        for node in nodes:
            logs.append(node.communicate(timeout=300)[0])
    finally:
        for node in nodes:
            if node.poll() is None:
                os.killpg(node.pid, signal.SIGKILL)
    assert [n.returncode for n in nodes] == [0, 0], "\n".join(log[-3000:] for log in logs)
    written = [p for p in (tmp_path / "node0", tmp_path / "node1") if (p / "metrics.jsonl").is_file()]
    assert len(written) == 1  # only global rank 0 writes
    two_nodes = [r["loss"] for r in _metrics(written[0])]
    one_node = [r["loss"] for r in _metrics(out)]
    assert two_nodes == pytest.approx(one_node, rel=1e-5)


def test_bad_flags_fail_fast_with_one_line():
    result = shardfit("train", "--strategy", "zero9", check=False)
    assert result.returncode == 2 and "unknown strategy 'zero9'" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1
    result = shardfit("train", "no-such-plan.yaml", check=False)
    assert result.returncode == 2 and "does not exist" in result.stderr
    result = shardfit("export", "/nonexistent", "--out", "/tmp/x", check=False)
    assert result.returncode == 2 and "not a checkpoint folder" in result.stderr


def test_a_second_run_never_writes_over_the_first(tmp_path):
    out = tmp_path / "run"
    (out / "checkpoints" / "step-10").mkdir(parents=True)
    (out / "checkpoints" / "step-10" / "manifest.json").write_text("{}")
    (out / "metrics.jsonl").write_text('{"step": 1}\n')
    result = shardfit("train", "--out", str(out), "--steps", "2", check=False)
    assert result.returncode == 2 and "--resume latest" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1
    assert (out / "metrics.jsonl").read_text() == '{"step": 1}\n'
