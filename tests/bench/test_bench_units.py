"""The orchestrator's pure parts: budgets, strategy plans, divergence diagnosis, formatting, and
the CLI's one-line errors (no torchrun)."""
from __future__ import annotations

import pytest

from launch import shardfit
from shardfit.bench import analysis
from shardfit.bench.report import fmt, get, table
from shardfit.bench.run import default_plan, parse_budgets, strategy_plan
from shardfit.errors import ShardfitError

LABELS = ["ddp", "zero3", "fsdp:full_shard"]


def test_budgets_apply_to_all_or_one_strategy():
    assert parse_budgets("2e6", LABELS) == dict.fromkeys(LABELS, 2_000_000)
    assert parse_budgets("zero3=1000,ddp=5e6", LABELS) == {"zero3": 1000, "ddp": 5_000_000}
    with pytest.raises(ShardfitError, match="not among --strategies"):
        parse_budgets("zero2=1", LABELS)
    with pytest.raises(ShardfitError, match="give a size"):
        parse_budgets("zero3=lots", LABELS)


def test_strategy_plan_keeps_the_plans_knobs_and_measures_one_node():
    plan = default_plan(nproc=2)
    z3 = strategy_plan(plan, "zero3+offload", 2)
    assert z3.strategy.kind == "zero3" and z3.strategy.offload_optimizer == "cpu" and z3.strategy.offload_params == "cpu"
    assert z3.strategy.reduce_bucket_size == 500_000 and z3.strategy.param_persistence_threshold == 0
    assert (z3.cluster.nodes, z3.cluster.gpus_per_node) == (1, 2)
    assert strategy_plan(plan, "fsdp:shard_grad_op", 2).strategy.sharding == "shard_grad_op"
    with pytest.raises(ShardfitError, match="unknown strategy"):
        strategy_plan(plan, "zero4", 2)


def test_divergence_names_the_likely_cause():
    plan = default_plan(2)
    pure = strategy_plan(plan.with_changes(training={"precision": "bf16-pure"}), "fsdp2", 2)
    assert "without fp32 master weights" in analysis.likely_cause(pure)
    offload = strategy_plan(plan, "zero3+offload", 2)
    assert "CPU Adam" in analysis.likely_cause(offload)
    results = [
        {"strategy": "ddp", "status": "ok", "world_size": 2, "loss": {"final": 4.0, "k": 7}, "memory": {"peak_bytes": 10}},
        {"strategy": "fsdp2", "status": "ok", "world_size": 2, "loss": {"final": 4.2, "k": 7}, "memory": {"peak_bytes": 10},
         "predicted": {"peak_bytes": 12}},
        {"strategy": "zero2", "status": "oom", "error": "over budget"},
    ]
    pure_plan = plan.with_changes(training={"precision": "bf16-pure"})
    analysis.compare(results, {label: strategy_plan(pure_plan, label, 2) for label in ("ddp", "fsdp2")})
    assert results[0]["correctness"]["status"] == "match"
    assert results[1]["correctness"]["status"] == "diverged"
    assert "master weights" in results[1]["correctness"]["likely_cause"]
    assert results[1]["memory_error"]["rel_error"] == pytest.approx(0.2)
    assert "correctness" not in results[2]
    shown = table({"results": results})
    assert "zero2: oom: over budget" in shown and "fsdp2: loss diverged" in shown


def test_formatting_and_paths():
    assert fmt(6_846_180, "bytes") == "6.846 MB" and fmt(None, "bytes") == "-"
    assert fmt(0.0123, "ms") == "12.30 ms" and fmt(-0.05, "pct") == "-5.00%" and fmt(True, "bool") == "yes"
    assert get({"a": [{"b": 3}]}, "a.0.b") == 3 and get({"a": {}}, "a.x.y") is None


def test_cli_rejects_bad_strategies_in_one_line(tmp_path):
    result = shardfit("bench", "--strategies", "ddp,zero9", "--out", str(tmp_path), check=False, timeout=60)
    assert result.returncode == 2
    assert result.stderr.count("\n") == 1 and "unknown strategy 'zero9'" in result.stderr
    result = shardfit("bench", "--strategies", "ddp", "--budget-bytes", "zero3=1", "--out", str(tmp_path),
                      check=False, timeout=60)
    assert result.returncode == 2 and "not among --strategies" in result.stderr


def test_a_plan_file_is_benched_as_written(tmp_path):
    from shardfit.bench.run import load_bench_plan
    from shardfit.spec.planfile import dump_plan

    plan = default_plan(2).with_changes(training={"seq_len": 32, "precision": "bf16"})
    path = dump_plan(plan, tmp_path / "plan.yaml")
    loaded = load_bench_plan(str(path), 2)
    assert loaded.training == plan.training and loaded.strategy == plan.strategy
    assert loaded.model.n_params == plan.model.n_params


def test_a_16_bit_plan_is_judged_against_a_separate_fp32_ddp_reference():
    plan = default_plan(2).with_changes(training={"precision": "bf16"})
    reference = {"strategy": "ddp", "status": "ok", "precision": "fp32", "loss": {"final": 4.00, "k": 7}}
    results = [{"strategy": "ddp", "status": "ok", "world_size": 2, "loss": {"final": 4.01, "k": 7}, "memory": {"peak_bytes": 1}},
               {"strategy": "zero2", "status": "ok", "world_size": 2, "loss": {"final": 4.30, "k": 7}, "memory": {"peak_bytes": 1}}]
    analysis.compare(results, {label: strategy_plan(plan, label, 2) for label in ("ddp", "zero2")}, reference)
    ddp, zero2 = (r["correctness"] for r in results)
    assert ddp["reference"] == "ddp/fp32" and ddp["status"] == "match" and ddp["rel_diff"] == pytest.approx(0.0025)
    assert zero2["status"] == "diverged" and zero2["likely_cause"]
