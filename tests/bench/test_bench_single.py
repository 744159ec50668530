"""`single` in the bench: a one-process row whatever --nproc is; with --nproc 1 it is compared with
DDP on one rank, which trains the same numbers and holds one more copy of the gradients."""
from __future__ import annotations

import json

import pytest

from launch import shardfit
from shardfit.bench import analysis
from shardfit.bench.comm import theoretical_comm
from shardfit.bench.run import DEFAULT_STRATEGIES, default_plan, default_strategies, strategy_plan


def test_single_row_is_one_process_and_only_a_default_on_one_rank():
    plan = default_plan(nproc=2)
    single = strategy_plan(plan, "single", 2)
    assert single.strategy.kind == "single" and single.cluster.world_size == 1
    assert single.strategy.reduce_bucket_size == plan.strategy.reduce_bucket_size  # the plan's knobs stay
    assert default_strategies(1) == ("single", *DEFAULT_STRATEGIES) and "single" not in default_strategies(2)
    assert theoretical_comm(single.strategy, 1000, grad_bytes=4, param_bytes=4)["volume_bytes"] == 0


def test_a_single_row_beside_two_ranks_is_not_compared_with_their_loss():
    plan = default_plan(2)
    results = [{"strategy": "ddp", "status": "ok", "world_size": 2, "loss": {"final": 4.0, "k": 7}, "memory": {"peak_bytes": 10}},
               {"strategy": "single", "status": "ok", "world_size": 1, "loss": {"final": 4.3, "k": 7},
                "memory": {"peak_bytes": 9}}]
    analysis.compare(results, {"ddp": strategy_plan(plan, "ddp", 2), "single": strategy_plan(plan, "single", 2)})
    assert results[0]["correctness"]["status"] == "match"
    assert results[1]["correctness"]["status"] == "not comparable"
    assert "--nproc 1" in results[1]["correctness"]["note"]


@pytest.mark.multirank
@pytest.mark.slow
def test_bench_single_against_ddp_on_one_rank(tmp_path):
    result = shardfit("bench", "--strategies", "single,ddp", "--nproc", "1", "--steps", "2", "--out", str(tmp_path),
                      timeout=600)
    report = json.loads((tmp_path / "report.json").read_text())
    by = {r["strategy"]: r for r in report["results"]}
    assert list(by) == ["single", "ddp"] and "[1/2] single" in result.stdout
    single, ddp = by["single"], by["ddp"]
    assert single["status"] == ddp["status"] == "ok" and single["world_size"] == ddp["world_size"] == 1
    assert single["loss"]["curve"] == ddp["loss"]["curve"]  # the same math, bit for bit
    assert single["correctness"]["status"] == "match"
    assert single["comm"]["bytes"] == 0 and ddp["comm"]["bytes"] > 0
    # DDP's reducer: a flat fp32 copy of every gradient (4 B/param) that one device never allocates.
    n_params = report["plan"]["model"]["n_params"]
    extra = ddp["memory"]["peak_bytes"] - single["memory"]["peak_bytes"]
    assert extra == pytest.approx(4 * n_params, rel=0.02)
    assert abs(single["memory_error"]["rel_error"]) < 0.05
    ckpt = single["checkpoint"]
    assert ckpt["exact_at_load"] is True and ckpt["exact"] is True, ckpt
