"""How fast is the analytic path? Plans evaluated per second on one core (target >= 20,000) and the
wall time of `shardfit plan llama-3.1-405b --gpus 1024` as a user runs it (target < 1 s), with a
check that torch is never imported on the way; and for a config no preset covers (Qwen3-8B's
published config.json), the first `plan` including the derivation and traces (target < 15 s) and the
cached one (target < 0.2 s wall, torch not imported).

Run: .venv/bin/python benchmarks/bench_plan.py [--seconds 3]
"""
from __future__ import annotations

import argparse
import itertools
import os
import platform
import statistics
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


def installed_env(**extra) -> dict:
    """The environment of a `shardfit` run as an installed package sees it: its bytecode cached (the
    first run writes __pycache__, as Python does by default). NOTE: pip byte-compiles a package when it
    installs it; under PYTHONDONTWRITEBYTECODE=1 (CI, containers) every run of a source checkout would
    compile each imported shardfit module again (~0.1 s of a cached plan on the development machine)."""
    env = {key: value for key, value in os.environ.items() if key != "PYTHONDONTWRITEBYTECODE"}
    return {**env, **extra}


def timed(command: list[str], env: dict, runs: int) -> list[float]:
    """Wall seconds of each of `runs` runs of a command that must succeed."""
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
        times.append(time.perf_counter() - start)
        if result.returncode != 0:
            raise SystemExit(f"{' '.join(command[2:])} failed: {result.stderr.strip()}")
    return times


def cli_wall_time(runs: int = 3) -> float:
    command = [sys.executable, "-m", "shardfit", "plan", "llama-3.1-405b", "--gpus", "1024"]
    env = installed_env()
    timed(command, env, 1)  # writes the bytecode
    return min(timed(command, env, runs))


# Qwen3-8B's published config.json (the sizes that matter): a model type without hand-written rules.
QWEN3_8B = {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": 4096,
            "intermediate_size": 12288, "num_hidden_layers": 36, "num_attention_heads": 32,
            "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 151936, "max_position_embeddings": 40960,
            "rms_norm_eps": 1e-6, "rope_theta": 1000000, "tie_word_embeddings": False, "attention_bias": False}


def unseen_config_times(runs: int = 5) -> tuple[float, float, bool]:
    """(first plan incl. derivation, median cached plan, torch or transformers imported by the cached plan)."""
    import json
    import tempfile

    with tempfile.TemporaryDirectory() as folder:
        config = os.path.join(folder, "qwen3-8b", "config.json")
        os.makedirs(os.path.dirname(config))
        with open(config, "w") as handle:
            json.dump(QWEN3_8B, handle)
        env = installed_env(SHARDFIT_CACHE_DIR=os.path.join(folder, "cache"))
        argv = ["plan", os.path.dirname(config), "--gpus", "8", "--seq", "4096"]
        command = [sys.executable, "-m", "shardfit", *argv]
        first_wall = timed(command, env, 1)[0]
        cached = statistics.median(timed(command, env, runs))
        probe = ("import sys; from shardfit.cli import main\n"
                 f"try: main({argv!r})\nexcept SystemExit: pass\n"
                 "print('torch' in sys.modules or 'transformers' in sys.modules, file=sys.stderr)")
        checked = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=60)
        return first_wall, cached, checked.stderr.strip().endswith("True")


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
    first, cached, torch_used = unseen_config_times()
    print(f"shardfit plan <Qwen3-8B config.json> --gpus 8: first {first:.2f} s wall incl. derivation (target < 15 s), "
          f"cached {cached:.3f} s wall, median of 5, bytecode cached as installed (target < 0.2 s); "
          f"torch/transformers imported when cached: {'yes' if torch_used else 'no'}")
    ok = rate >= 20_000 and wall < 1.0 and first < 15 and cached < 0.2 and not torch_used
    print("PASS" if ok else "BELOW TARGET")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
