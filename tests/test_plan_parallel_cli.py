"""`shardfit plan` with --tp / --pp / --cp / --sp: the per-rank layout table, the JSON section, and
bad layouts as one line with exit 2."""
import json

from launch import shardfit

GIB = 1024**3
LAYOUT_405B = ("plan", "llama-3.1-405b", "--gpus", "512", "--nodes", "64", "--tp", "8", "--pp", "8", "--seq", "8192",
               "--grad-accum", "16", "--sp", "--ac", "full", "--strategy", "fsdp2")


def test_405b_layout_prints_every_pipeline_rank_by_category():
    out = shardfit(*LAYOUT_405B).stdout
    assert "fsdp2: dp_replicate=1 dp_shard=8 tp=8+sp cp=1 pp=8 1f1b m=16 (world 512)" in out
    stages = [line.split() for line in out.splitlines() if line.startswith("  ") and line.split()[0].isdigit()]
    assert [int(row[0]) for row in stages] == list(range(8))
    assert [int(row[1]) for row in stages] == [15, 16, 16, 16, 16, 16, 16, 15]
    activations = [float(row[5]) for row in stages]
    assert activations[0] > activations[3] > activations[6]  # 1F1B: rank i holds 8 - i micro-batches
    # The summary row is the most loaded rank (the first holds 8 micro-batches but one layer less than
    # the next: which of them peaks higher is the estimate's to say).
    summary = next(line for line in out.splitlines() if line.startswith("fsdp2 "))
    assert float(summary.split()[8]) == max(float(row[8]) for row in stages)


def test_json_carries_the_layout_and_the_plan_section():
    doc = json.loads(shardfit(*LAYOUT_405B, "--json").stdout)
    assert doc["plan"]["parallelism"]["tp"] == 8 and doc["plan"]["parallelism"]["sequence_parallel"] is True
    ranks = doc["parallelism"]["fsdp2"]["ranks"]
    assert len(ranks) == 8 and max(r["device_peak"] for r in ranks) == doc["strategies"][0]["device_peak_bytes"]


def test_default_layout_adds_nothing():
    doc = json.loads(shardfit("plan", "llama-3.1-8b", "--strategy", "fsdp2", "--json").stdout)
    assert "parallelism" not in doc and "parallelism" not in doc["plan"]


def test_bad_layout_is_one_line_exit_2():
    result = shardfit("plan", "llama-3.1-405b", "--gpus", "512", "--nodes", "64", "--tp", "16", "--strategy", "fsdp2",
                      check=False)
    assert result.returncode == 2
    assert result.stderr.strip().count("\n") == 0 and "tp = 16 must divide the 8 GPUs of one node" in result.stderr
