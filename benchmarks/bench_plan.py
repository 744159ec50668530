"""How fast is the analytic path? Plans evaluated per second on one core (target >= 20,000) and the
wall time of `shardfit plan llama-3.1-405b --gpus 1024` as a user runs it (target < 1 s), with a
check that torch is never imported on the way.

Run: .venv/bin/python benchmarks/bench_plan.py [--seconds 3]
"""
from __future__ import annotations

import argparse
import itertools
import os
import platform
import subprocess
import sys
import time

import shardfit.commands.plan  # noqa: F401  (the whole `plan` import path)
from shardfit.estimate import estimate
from shardfit.spec.models import load_model_spec
from shardfit.spec.plan import Cluster, Plan, Training, parse_strategy

STRATEGIES = ("ddp", "fsdp:full_shard", "fsdp:shard_grad_op", "fsdp2", "zero1", "zero2", "zero3", "zero3+offload")


def plans() -> list[Plan]:
    """A fit-like sweep: strategies x micro-batches x sequence lengths x AC x cluster sizes."""
    models = [load_model_spec(name) for name in ("llama-3.1-8b", "llama-3.1-70b", "mixtral-8x7b")]
    out = []
    for model, strategy, mb, seq, ac, nodes in itertools.product(models, STRATEGIES, (1, 2, 4), (2048, 8192),
                                                                 ("none", "full"), (1, 4)):
        out.append(Plan(model=model, strategy=parse_strategy(strategy),
                        training=Training(micro_batch=mb, seq_len=seq, activation_checkpointing=ac),
                        cluster=Cluster(nodes=nodes, gpus_per_node=8)))
    return out


def plans_per_second(seconds: float) -> tuple[float, int]:
    batch = plans()
    for plan in batch:  # warm the per-model caches, as fit's first pass would
        estimate(plan)
    count, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        for plan in batch:
            estimate(plan)
        count += len(batch)
    return count / (time.perf_counter() - start), len(batch)


def cli_wall_time(runs: int = 3) -> float:
    command = [sys.executable, "-m", "shardfit", "plan", "llama-3.1-405b", "--gpus", "1024"]
    best = float("inf")
    for _ in range(runs):
        start = time.perf_counter()
        result = subprocess.run(command, capture_output=True, text=True, timeout=60)
        best = min(best, time.perf_counter() - start)
        if result.returncode != 0:
            raise SystemExit(f"shardfit plan failed: {result.stderr.strip()}")
    return best


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=3.0)
    args = parser.parse_args()
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[0]})  # one core
    rate, distinct = plans_per_second(args.seconds)
    assert "torch" not in sys.modules, "the plan path imported torch"
    wall = cli_wall_time()
    print(f"host: {platform.node()} {platform.processor() or platform.machine()}, Python {platform.python_version()}, "
          f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}")
    print(f"estimate(plan): {rate:,.0f} plans/s on one core ({distinct} distinct plans; target >= 20,000)")
    print(f"shardfit plan llama-3.1-405b --gpus 1024: {wall:.3f} s wall, best of 3 (target < 1 s)")
    print("torch imported by the plan path: no")
    ok = rate >= 20_000 and wall < 1.0
    print("PASS" if ok else "BELOW TARGET")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
