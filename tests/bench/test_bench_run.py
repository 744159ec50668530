"""The real bench on CPU: every strategy, one made to fail, and the figures checked against each
other and against theory (shared run: see conftest.py)."""
from __future__ import annotations

import csv

import pytest

from conftest import DEFAULT, DOOMED

pytestmark = [pytest.mark.multirank, pytest.mark.deepspeed, pytest.mark.slow]


def test_every_strategy_runs_and_the_doomed_one_is_reported_as_oom(bench_run):
    proc, by_label = bench_run["proc"], bench_run["by_label"]
    assert proc.returncode == 0, proc.stderr[-3000:]  # an OOM is a measured result, not a failure
    assert list(by_label) == DEFAULT + [DOOMED]
    for label in DEFAULT:
        assert by_label[label]["status"] == "ok", (label, by_label[label].get("error"))
        assert f"] {label}" in proc.stdout  # one progress line per strategy
    doomed = by_label[DOOMED]
    assert doomed["status"] == "oom" and "budget" in doomed["error"], doomed
    assert f"] {DOOMED}" in proc.stdout and "OOM" in proc.stdout
    # the OOM is explained as `shardfit profile` explains it: once, for the worst rank, with sized changes
    diagnosis = doomed["diagnosis"]
    assert diagnosis["phase"] in ("load", "forward", "backward", "optimizer") and diagnosis["limit_bytes"] == 1000
    assert diagnosis["fixes"] and all(f["flags"] for f in diagnosis["fixes"]), diagnosis
    assert proc.stdout.count("OUT OF MEMORY on rank") == 1 and "smallest changes (estimator)" in proc.stdout


def test_losses_match_the_ddp_reference_and_checkpoints_round_trip_exactly(bench_run):
    for label in DEFAULT:
        result = bench_run["by_label"][label]
        assert result["correctness"]["status"] == "match", (label, result["correctness"])
        assert result["loss"]["final"] < result["loss"]["curve"][0]  # it trains
        ckpt = result["checkpoint"]
        assert ckpt["exact_at_load"] is True, (label, ckpt.get("restored"), ckpt.get("details"))
        # Measured: DeepSpeed's CPU Adam (offload) updates differ by ~1 ulp between processes.
        assert ckpt["exact"] is True or (label == "zero3+offload" and ckpt["resumed_step_max_abs_diff"] < 1e-6), \
            (label, ckpt["restored"], ckpt["resumed_step_max_abs_diff"])
        assert set(ckpt["restored"]) >= {"model", "optimizer", "scheduler", "step", "next_loss", "optimizer_after_step"}
        assert ckpt["bytes"] > 0 and ckpt["save_s"] > 0 and ckpt["load_s"] > 0


def test_step_time_memory_and_prediction_are_recorded(bench_run):
    for label in DEFAULT:
        result = bench_run["by_label"][label]
        times = result["step_time_s"]
        assert len(times["all"]) == bench_run["report"]["settings"]["steps"]
        assert times["min"] <= times["median"] <= times["max"] and result["tokens_per_s"] > 0
        memory = result["memory"]
        assert memory["peak_bytes"] == sum(memory["by_phase"][memory["peak_phase"]].values()) > 0
        assert result["predicted"]["peak_bytes"] > 0
        assert result["memory_error"]["rel_error"] == pytest.approx(
            (result["predicted"]["peak_bytes"] - memory["peak_bytes"]) / memory["peak_bytes"])
    by = bench_run["by_label"]
    n_params = bench_run["report"]["plan"]["model"]["n_params"]
    # fp32 on 2 ranks: DDP holds every parameter, full sharding half of them.
    assert by["ddp"]["memory"]["by_category_max"]["params"] >= 4 * n_params
    for label in ("fsdp:full_shard", "fsdp2", "zero3"):
        assert by[label]["memory"]["by_phase"]["optimizer"]["params"] < 0.75 * 4 * n_params, label
    # ZeRO-1/2/3 and FSDP shard the AdamW state: about half of DDP's 8 B/param.
    for label in ("zero1", "zero2", "zero3", "fsdp:full_shard"):
        assert by[label]["memory"]["by_category_max"]["optimizer"] < 0.75 * by["ddp"]["memory"]["by_category_max"]["optimizer"], label
    # Optimizer offload moves the AdamW state to host memory.
    assert by["zero3+offload"]["memory"]["by_category_max"]["optimizer"] < by["zero3"]["memory"]["by_category_max"]["optimizer"]


def test_collectives_match_theory(bench_run):
    by = bench_run["by_label"]
    n_params = bench_run["report"]["plan"]["model"]["n_params"]
    grads = 4 * n_params  # fp32
    assert by["ddp"]["comm"]["per_kind"]["all_reduce"]["bytes"] == grads  # DDP's C++ reducer is seen
    # ZeRO paper: ZeRO-3 moves ~1.5x the bytes of ZeRO-2 (one more parameter all-gather in backward).
    ratio = by["zero3"]["comm"]["bytes"] / by["zero2"]["comm"]["bytes"]
    assert 1.3 <= ratio <= 1.6, ratio
    assert by["zero3"]["comm"]["by_phase"]["backward"].get("all_gather", 0) > 0
    # FSDP full_shard gathers parameters again in backward; shard_grad_op keeps them from forward.
    full, grad_op = by["fsdp:full_shard"]["comm"]["by_phase"], by["fsdp:shard_grad_op"]["comm"]["by_phase"]
    assert full["backward"].get("all_gather", 0) > 0.5 * grads
    assert grad_op["backward"].get("all_gather", 0) == 0
    for label in ("fsdp:full_shard", "fsdp:shard_grad_op", "fsdp2"):
        assert by[label]["comm"]["by_phase"]["forward"]["all_gather"] == grads, label
        assert by[label]["comm"]["per_kind"]["reduce_scatter"]["bytes"] == grads, label
    for label in DEFAULT:
        theory = by[label]["comm_theory"]
        assert 0.8 <= by[label]["comm"]["bytes"] / theory["bytes"] <= 1.25, (label, by[label]["comm"], theory)


def test_outputs_hold_every_figure_and_the_environment(bench_run):
    out, report = bench_run["out"], bench_run["report"]
    env = report["environment"]
    assert env["torch"] and env["deepspeed"] and env["world_size"] == 2 and env["device"] == "cpu"
    assert report["plan"]["model"]["name"] == "tiny-llama"
    with open(out / "report.csv") as handle:
        rows = list(csv.DictReader(handle))
    assert [row["strategy"] for row in rows] == DEFAULT + [DOOMED]
    ddp = rows[0]
    assert float(ddp["memory.peak_bytes"]) == bench_run["by_label"]["ddp"]["memory"]["peak_bytes"]
    assert ddp["env.torch"] == env["torch"] and ddp["plan.model.name"] == "tiny-llama"
    for name in ("memory", "step_time", "comm"):
        assert (out / "charts" / f"{name}.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # The terminal table shows the JSON's numbers.
    from shardfit.bench.report import fmt
    assert fmt(bench_run["by_label"]["zero2"]["memory"]["peak_bytes"], "bytes") in bench_run["proc"].stdout
