"""The bench orchestrator: each strategy is its own torchrun job, bounded by a timeout; a failing or
out-of-memory strategy becomes a row in the report and never stops the others. Then one fresh job
reloads every checkpoint (a strategy whose check does not come back is retried alone). Then it compares: losses against the DDP/fp32 reference,
measured memory against the estimator, collectives against theory.

A `single` row always runs as a one-process job at the plan's micro-batch, whatever --nproc is: its
memory is per device like every other row's. On more than one rank its loss is over another batch
(one rank's share), so it is not compared with the reference; with --nproc 1 it is.
"""
from __future__ import annotations

import dataclasses
import json
import shutil
import time
from pathlib import Path

from shardfit.bench import analysis
from shardfit.errors import ShardfitError
from shardfit.launcher import torchrun
from shardfit.runtime_env import launch_env
from shardfit.spec.models import load_model_spec
from shardfit.spec.plan import Cluster, parse_strategy, Plan, Schedule, Strategy, Training, validate_plan
from shardfit.spec.planfile import load_plan
from shardfit.spec.sizes import parse_size

# With --nproc 1, `single` comes first (see default_strategies).
DEFAULT_STRATEGIES = ("ddp", "fsdp:full_shard", "fsdp:shard_grad_op", "fsdp2", "zero1", "zero2", "zero3",
                      "zero3+offload")
OOM_EXIT = 3  # shardfit.bench.worker's exit code for "out of memory / over budget"


def default_strategies(nproc: int) -> tuple[str, ...]:
    return (("single",) if nproc == 1 else ()) + DEFAULT_STRATEGIES


def default_plan(nproc: int = 2):
    """The embedded default: the tiny Llama preset, fp32 on CPU, one node of `nproc` ranks.

    NOTE: DeepSpeed's defaults are sized for billions of parameters, and at this model's size they
    would measure something no large run sees: 5e8-element buckets (about 1 GB per rank for a
    0.2M-parameter model), a 1e5-element persistence threshold under which ZeRO-3 never partitions
    a parameter (every tensor here), and 1e9 live parameters / reuse distance that keep the whole
    model gathered from forward to backward. The bench scales them to the model: buckets of 5e5,
    threshold 0, about one block (5e4) live, reuse distance 0, prefetch 1e4.
    """
    return Plan(model=load_model_spec("tiny-llama"),
                strategy=Strategy(reduce_bucket_size=500_000, allgather_bucket_size=500_000,
                                  prefetch_bucket_size=10_000, param_persistence_threshold=0,
                                  max_live_parameters=50_000, max_reuse_distance=0),
                training=Training(micro_batch=2, seq_len=64, precision="fp32"),
                cluster=Cluster(nodes=1, gpus_per_node=nproc, gpu="H100-80GB"),
                schedule=Schedule(lr=1e-3, weight_decay=0.0, seed=1234))


def load_bench_plan(path: str | None, nproc: int):
    """The plan file's model, training and knobs (its strategy and cluster are replaced per run),
    or the embedded default."""
    if path is None:
        return default_plan(nproc)

    return load_plan(path)


def strategy_plan(plan, label: str, nproc: int):
    """The plan with `label`'s kind, sharding and offload; bucket sizes and the rest stay the
    plan's, and the cluster becomes what is measured (one node of nproc ranks; one rank for single)."""
    parsed = parse_strategy(label)
    if parsed.kind == "single":
        nproc = 1
    strategy = dataclasses.replace(plan.strategy, kind=parsed.kind, sharding=parsed.sharding,
                                   reshard_after_forward=parsed.reshard_after_forward,
                                   offload_optimizer=parsed.offload_optimizer,
                                   offload_params=parsed.offload_params,
                                   nvme_path=parsed.nvme_path or plan.strategy.nvme_path)
    changed = plan.with_changes(strategy=strategy, cluster={"nodes": 1, "gpus_per_node": nproc})
    validate_plan(changed)
    return changed


def parse_budgets(text: str | None, labels: list[str]) -> dict[str, int]:
    """`--budget-bytes 2e6` (every strategy) or `--budget-bytes zero3=1e3,ddp=5e6`."""
    if not text:
        return {}
    budgets = {}
    for item in str(text).split(","):
        label, _, value = item.rpartition("=")
        try:
            size = parse_size(value, "B", "--memory-budget")
        except ShardfitError as exc:
            raise ShardfitError(f"--memory-budget '{item}': {exc}; give a size (2GB, 3MiB, 2e9 bytes) or "
                                "strategy=size (zero3=2GiB)") from None
        for target in ([label] if label else labels):
            if target not in labels:
                raise ShardfitError(f"--budget-bytes names '{target}', which is not among --strategies {','.join(labels)}")
            budgets[target] = size
    return budgets


def torchrun_job(args: list[str], nproc: int, timeout: float, log: Path,
                 module: str = "shardfit.bench.worker") -> tuple[int | None, float]:
    """Run one torchrun job of `module`, its output appended to `log`; the launcher stops the whole
    job at the timeout. Returns (exit code or None on timeout, seconds)."""
    env = launch_env()
    env["PYTHONUNBUFFERED"] = "1"
    done = torchrun(["-m", module, *args], nproc, timeout=timeout, env=env, log=log)
    return done.returncode, done.seconds


def _last_error(log: Path) -> str:
    lines = [line.strip() for line in log.read_text(errors="replace").splitlines() if line.strip()]
    for line in reversed(lines):
        if "Error" in line or "error" in line:
            return line[:300]
    return lines[-1][:300] if lines else "no output"


def _slug(label: str) -> str:
    return label.replace(":", "-").replace("+", "-")


def run_strategy(plan, label: str, *, out: Path, nproc: int, warmup: int, steps: int, budget: int,
                 timeout: float, checkpoint: bool = True, folder: str | None = None) -> dict:
    """The training job of one strategy. Never raises for a failing strategy: the result's status
    says ok / oom / failed / timeout."""
    work = out / "runs" / (folder or _slug(label))
    work.mkdir(parents=True, exist_ok=True)
    plan_file, result_file = work / "plan.json", work / "result.json"
    for stale in (result_file, work / "verify.json", *work.glob("*.rank*.json")):
        stale.unlink(missing_ok=True)
    shutil.rmtree(work / "checkpoint", ignore_errors=True)
    log = work / "log.txt"
    log.write_text("")
    plan_file.write_text(json.dumps(plan.to_dict(), indent=1))
    common = ["--plan", str(plan_file), "--ckpt", str(work / "checkpoint")]
    code, seconds = torchrun_job([*common, "--out", str(result_file), "--warmup", str(warmup), "--steps", str(steps),
                               "--budget-bytes", str(budget or 0), *([] if checkpoint else ["--no-checkpoint"])],
                              nproc, timeout, log)
    # A rank that failed alone writes result.rankN.json; torchrun then stops the others.
    written = [result_file] + sorted(work.glob("result.rank*.json"))
    written = [f for f in written if f.is_file()]
    if written:
        results = [json.loads(f.read_text()) for f in written]
        result = results[0]
        diagnoses = [r["diagnosis"] for r in results if r.get("diagnosis")]
        if diagnoses:  # each rank that ran out wrote its own: keep the one with the most memory live
            result["diagnosis"] = max(diagnoses, key=lambda d: (sum(d.get("live", {}).values()), -d.get("rank", 0)))
    else:
        result = {"strategy": label, "status": "timeout" if code is None else ("oom" if code == OOM_EXIT else "failed"),
                  "error": f"no result after {timeout:.0f} s" if code is None else _last_error(log)}
    if code not in (0, None) and result.get("status") == "ok":
        result["status"] = "failed"
        result["error"] = f"a rank exited with code {code} after the measurement: {_last_error(log)}"
    result.update(job_s=seconds, log=str(log), budget_bytes=budget or None)
    return result


def verify_checkpoints(results: list[dict], out: Path, nproc: int, timeout: float, progress=print) -> None:
    """Reload every saved checkpoint in a fresh torchrun job (one for all of a world size; a strategy
    whose check did not come back is retried alone, so one bad checkpoint cannot hide the others)."""
    pending = [r for r in results if r.get("status") == "ok" and r.get("checkpoint")]
    if not pending:
        return
    seconds = 0.0
    for world in sorted({r.get("world_size", nproc) for r in pending}):
        group = [r for r in pending if r.get("world_size", nproc) == world]
        seconds += _verify_group(group, out, world, timeout, "" if world == nproc else f"-{world}")
    loaded = sum(1 for r in pending if r["checkpoint"].get("exact_at_load"))
    exact = sum(1 for r in pending if r["checkpoint"].get("exact"))
    progress(f"checkpoints, reloaded in a fresh process ({seconds:.0f} s): {loaded}/{len(pending)} loaded bit-identically, "
             f"{exact}/{len(pending)} also resume bit-identically")


def _verify_group(pending: list[dict], out: Path, nproc: int, timeout: float, suffix: str) -> float:
    """One verification job for the checkpoints written by `nproc` ranks; returns its seconds."""
    jobs = []
    for result in pending:
        work = Path(result["log"]).parent
        jobs.append({"plan": str(work / "plan.json"), "ckpt": str(work / "checkpoint"), "out": str(work / "verify.json")})
    log = out / "runs" / f"verify{suffix}-log.txt"
    log.write_text("")
    jobs_file = out / "runs" / f"verify{suffix}-jobs.json"
    jobs_file.write_text(json.dumps(jobs, indent=1))
    _, seconds = torchrun_job(["--verify", str(jobs_file)], nproc, timeout * max(1, len(jobs) / 2), log)
    for result, job in zip(pending, jobs):
        verify_file = Path(job["out"])
        if not verify_file.is_file():
            single = Path(job["out"]).with_name("verify-job.json")
            single.write_text(json.dumps([job]))
            _, more = torchrun_job(["--verify", str(single)], nproc, timeout, Path(result["log"]))
            seconds += more
        if verify_file.is_file():
            check = json.loads(verify_file.read_text())
            if "restored" in check:
                result["checkpoint"].update(check)
            else:
                result["checkpoint"].update(exact=False, restored=None, error=check.get("error"))
        else:
            result["checkpoint"].update(exact=False, restored=None, error=_last_error(log))
    return seconds


def bench(plan, strategies: list[str], *, out: Path, nproc: int = 2, warmup: int = 2, steps: int = 5,
          budgets: dict[str, int] | None = None, timeout: float = 300, checkpoint: bool = True,
          keep_checkpoints: bool = False, deadline_s: float | None = None, progress=print) -> dict:
    """Run every strategy and return the whole report (report.write_all writes it under `out`).
    deadline_s: strategies not started by then are reported as skipped (a time-boxed GPU run)."""
    budgets = budgets or {}
    plans = {label: strategy_plan(plan, label, nproc) for label in strategies}  # bad labels fail first
    out.mkdir(parents=True, exist_ok=True)
    results, started = [], time.perf_counter()
    for index, label in enumerate(strategies, 1):
        if deadline_s is not None and time.perf_counter() - started > deadline_s:
            results.append({"strategy": label, "status": "skipped", "error": f"time budget of {deadline_s:.0f} s spent"})
            progress(f"[{index}/{len(strategies)}] {analysis.progress_line(results[-1])}")
            continue
        progress(f"[{index}/{len(strategies)}] {label:<20} running ...", end="\r")
        result = run_strategy(plans[label], label, out=out, nproc=plans[label].cluster.world_size, warmup=warmup,
                              steps=steps, budget=budgets.get(label, 0), timeout=timeout, checkpoint=checkpoint)
        result["predicted"] = analysis.predicted(plans[label])
        result["comm_theory"] = analysis.comm_theory(plans[label])
        results.append(result)
        progress(f"[{index}/{len(strategies)}] {analysis.progress_line(result)}")
    if checkpoint:
        verify_checkpoints(results, out, nproc, timeout, progress)
    if not keep_checkpoints:
        for result in results:
            shutil.rmtree(out / "runs" / _slug(result["strategy"]) / "checkpoint", ignore_errors=True)
    reference = None
    if plan.training.precision != "fp32":
        # The correctness reference is DDP in fp32 whatever the plan's precision: a 16-bit strategy
        # is judged against exact arithmetic, not against DDP's own 16-bit drift.
        progress(f"[ref] {'ddp (fp32 reference)':<20} running ...", end="\r")
        reference = run_strategy(strategy_plan(plan.with_changes(training={"precision": "fp32"}), "ddp", nproc),
                                 "ddp", out=out, nproc=nproc, warmup=warmup, steps=steps, budget=0,
                                 timeout=timeout, checkpoint=False, folder="reference-ddp-fp32")
        reference["precision"] = "fp32"
        progress(f"[ref] {analysis.progress_line(reference)}")
    analysis.compare(results, plans, reference)
    return {"plan": plan.to_dict(), "strategies": list(strategies), "results": results, "reference": reference,
            "settings": {"nproc": nproc, "warmup": warmup, "steps": steps, "timeout_s": timeout,
                         "budgets": budgets, "checkpoint": checkpoint},
            "environment": analysis.environment(nproc),
            "wall_s": time.perf_counter() - started}
