"""`shardfit bench [PLAN.yaml]`: the same training step under each strategy, side by side.

With no plan: the tiny preset on this machine, 2 ranks, every strategy that runs here."""
from __future__ import annotations

import sys
from pathlib import Path

from shardfit.bench import report as report_mod
from shardfit.bench.run import bench, default_strategies, load_bench_plan, parse_budgets, strategy_plan
from shardfit.errors import ShardfitError
from shardfit.fit.steptime import step_time
from shardfit.spec.device_profile import load_profile
from shardfit.spec.plan import parse_strategy


def add_arguments(parser) -> None:
    parser.add_argument("plan", nargs="?", help="plan YAML (default: the embedded tiny-llama plan)")
    parser.add_argument("--strategies", "--strategy", default=None, dest="strategies",
                        help="comma list, the same labels as plan --strategy and fit print (default: ddp,fsdp:full_shard,fsdp:shard_grad_op,fsdp2,zero1,zero2,zero3,zero3+offload; "
                             "single first with --nproc 1). A single row always runs one process")
    parser.add_argument("--steps", type=int, default=5, help="timed steps per strategy, after warm-up (default 5)")
    parser.add_argument("--warmup", type=int, default=2, help="warm-up steps; the last one is instrumented (default 2)")
    parser.add_argument("--out", default="runs/bench", help="output folder (default runs/bench)")
    parser.add_argument("--memory-budget", "--budget-bytes", dest="budget_bytes", default=None,
                        help="memory budget per rank: SIZE for all, or LABEL=SIZE[,LABEL=SIZE]; a size is 3MiB, 2GB or plain bytes; over it = OOM")
    parser.add_argument("--nproc", type=int, default=None, help="ranks per job (default: 2 on CPU, GPUs on CUDA)")
    parser.add_argument("--timeout", type=float, default=300, help="seconds per torchrun job (default 300)")
    parser.add_argument("--no-checkpoint", action="store_true", help="skip the checkpoint round trip (save + fresh-process reload)")
    parser.add_argument("--keep-checkpoints", action="store_true", help="keep each strategy's checkpoint under OUT/runs/")
    parser.add_argument("--device-profile", dest="device_profile",
                        help="print each strategy's predicted step time under this calibrated profile beside the measured one")


def run(args) -> int:
    if args.steps < 2 or args.warmup < 2:
        # NOTE: the instrumented step is the last warm-up step; on the first step optimizer states
        # are still being created lazily, so measuring it would not be a steady-state step.
        raise ShardfitError("--steps and --warmup must each be at least 2 (a spread of step times; a steady step to measure)")
    if args.nproc is not None and args.nproc < 1:
        raise ShardfitError(f"--nproc must be at least 1, got {args.nproc}")
    if not args.timeout > 0:
        raise ShardfitError(f"--timeout must be a positive number of seconds, got {args.timeout:g}")
    nproc = args.nproc or _default_nproc()
    labels = [s.strip() for s in (args.strategies or ",".join(default_strategies(nproc))).split(",") if s.strip()]
    if len(set(labels)) != len(labels):
        raise ShardfitError(f"--strategies lists a strategy twice: {','.join(labels)}")

    for label in labels:
        parse_strategy(label)  # an unknown strategy fails here, in one line, before any launch
    try:
        budgets = parse_budgets(args.budget_bytes, labels)
    except (OverflowError, ValueError):  # 1e400 / nan bytes
        raise ShardfitError(f"--budget-bytes '{args.budget_bytes}': give a finite number of bytes (2e9) "
                            "or strategy=bytes") from None
    bad = [f"{k}={v}" for k, v in budgets.items() if v <= 0]
    if bad:
        raise ShardfitError(f"--budget-bytes must be positive: {bad[0]}")
    plan = load_bench_plan(args.plan, nproc)
    profile = None
    if args.device_profile:
        profile = load_profile(args.device_profile).as_gpu()
    out = Path(args.out)
    print(f"shardfit bench: {plan.model.name}, {nproc} ranks, {len(labels)} strategies, "
          f"{args.warmup}+{args.steps} steps each -> {out}", flush=True)
    report = bench(plan, labels, out=out, nproc=nproc, warmup=args.warmup, steps=args.steps,
                   budgets=budgets, timeout=args.timeout,
                   checkpoint=not args.no_checkpoint, keep_checkpoints=args.keep_checkpoints, progress=_progress)
    lines = _predicted_times(report, plan, nproc, profile) if profile is not None else []
    files = report_mod.write_all(report, out)
    print()
    print(report_mod.table(report))
    if lines:
        print(f"\nstep time, measured vs predicted under {args.device_profile}:")
        print("\n".join(lines))
    print(f"\nwall {report['wall_s']:.0f} s; report: {files['html']}  (also {files['json'].name}, "
          f"{files['csv'].name}, charts/)")
    failed = [r["strategy"] for r in report["results"] if r.get("status") in ("failed", "timeout")]
    return 1 if failed else 0


def _predicted_times(report: dict, plan, nproc: int, gpu) -> list[str]:
    """Each ok row's predicted step time (fit's step-time model under the profile) beside its
    measured median, stored in the report as predicted_step_s."""
    lines = []
    for result in report["results"]:
        if result.get("status") != "ok" or not result.get("step_time_s"):
            continue
        predicted = step_time(strategy_plan(plan, result["strategy"], nproc), gpu).total_s
        measured = result["step_time_s"]["median"]
        result["predicted_step_s"] = predicted
        lines.append(f"  {result['strategy']:<20} measured {measured * 1e3:8.1f} ms  predicted {predicted * 1e3:8.1f} ms  "
                     f"(x{measured / predicted:.2f})")
    return lines


def _progress(line: str, end: str = "\n") -> None:
    if end == "\r" and not sys.stdout.isatty():
        return  # only terminals can overwrite the "running" line
    print(line.ljust(110) if end == "\r" else line.ljust(40), end=end, flush=True)


def _default_nproc() -> int:
    try:
        import torch

        if torch.cuda.is_available():
            return torch.cuda.device_count()
    except ImportError:
        raise ShardfitError("shardfit bench needs torch: pip install 'shardfit[run]'") from None
    return 2
