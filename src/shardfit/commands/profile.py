"""`shardfit profile [PLAN.yaml]`: run a few real steps under torchrun and print, per phase and
category, the measured bytes next to the estimator's prediction with the error of each term.
`shardfit profile --script train.py -- ARGS` profiles your own script through `shardfit.profile`.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
from pathlib import Path

from shardfit.commands.kernel_flags import add_kernel_arguments, kernel_changes
from shardfit.commands.lora_flags import add_lora_arguments
from shardfit.errors import ShardfitError
from shardfit.estimate.lora_targets import with_default_targets
from shardfit.measure.chart import write_chart
from shardfit.measure.compare import format_comparison
from shardfit.measure.oom import Diagnosis, format_diagnosis, worst_rank_diagnosis
from shardfit.measure.report import GatheredReport, RankReport, format_phase_table
from shardfit.measure.run import load_plan, run_plan_worker, run_script
from shardfit.spec.fields import lora_section
from shardfit.spec.plan import parse_strategy
from shardfit.spec.planfile import read_plan_data
from shardfit.spec.sizes import size_type

DEFAULT_PLAN = {"model": "tiny-llama", "strategy": {"kind": "ddp"},
                "training": {"micro_batch": 2, "seq_len": 128, "precision": "fp32"}}


def add_arguments(parser) -> None:
    parser.add_argument("plan", nargs="?", help="plan YAML/JSON (default: tiny-llama, ddp, fp32 on 2 CPU ranks)")
    group = parser.add_argument_group("plan overrides")
    group.add_argument("--model", help="preset name, local config path, or pkg.module:fn")
    group.add_argument("--strategy", help="single (one rank), ddp, fsdp[:shard_grad_op], fsdp2, zero1, zero2, zero3, "
                                          "+offload")
    group.add_argument("--precision", help="fp32, bf16, fp16, bf16-pure")
    group.add_argument("--micro-batch", type=int, dest="micro_batch")
    group.add_argument("--seq", type=int, help="sequence length")
    group.add_argument("--grad-accum", type=int, dest="grad_accum")
    group.add_argument("--ac", help="activation checkpointing: none, selective (per-op), full, every-N")
    add_kernel_arguments(group)
    add_lora_arguments(group, base_default_text="fp32 for profile")
    group.add_argument("--bucket", type=size_type("elements", "--bucket"),
                       help="DeepSpeed reduce/allgather/prefetch bucket size in elements (5e8, 500M)")
    run = parser.add_argument_group("run")
    run.add_argument("--steps", type=int, default=2, help="steps to run; the last is reported (default 2)")
    run.add_argument("--checkpoint", action="store_true", help="also measure a checkpoint save")
    run.add_argument("--memory-budget", "--budget", dest="budget", type=size_type("B", "--memory-budget"),
                     help="memory budget per rank: a size (3MiB, 2.5GB) or plain bytes; an OOM is raised (and explained) above it")
    run.add_argument("--nproc", type=int, default=None, help="ranks (default 2; 1 for strategy single)")
    run.add_argument("--timeout", type=float, default=900, help="seconds before the run is declared hung")
    out = parser.add_argument_group("output")
    out.add_argument("--json", action="store_true", help="print the full result as JSON")
    out.add_argument("--chart", help="write a PNG: stacked bars per phase, predicted beside measured")
    out.add_argument("--script", help="profile this Python script (arguments after --) instead of a plan")
    out.add_argument("script_args", nargs="*", help=argparse_suppress())


def argparse_suppress():
    return argparse.SUPPRESS


def build_plan_dict(args) -> dict:
    data = json.loads(json.dumps(DEFAULT_PLAN))
    if args.plan:
        path = Path(args.plan)
        if not path.is_file():
            raise ShardfitError(f"plan file '{args.plan}' not found: give a YAML/JSON plan or use --model/--strategy")
        data = read_plan_data(path)  # the one plan reader: one-line errors, duplicate keys refused
    training = dict(data.get("training") or {})
    strategy = data.get("strategy") or {}
    if args.model:
        data["model"] = args.model
    if args.strategy:
        parsed = parse_strategy(args.strategy)
        strategy = {f.name: getattr(parsed, f.name) for f in dataclasses.fields(parsed)
                    if getattr(parsed, f.name) != f.default}
        strategy["kind"] = parsed.kind
    if args.bucket:
        for key in ("reduce_bucket_size", "allgather_bucket_size", "prefetch_bucket_size"):
            strategy[key] = int(args.bucket)
    for flag, key in (("precision", "precision"), ("micro_batch", "micro_batch"), ("seq", "seq_len"),
                      ("grad_accum", "grad_accum"), ("ac", "activation_checkpointing")):
        if getattr(args, flag) is not None:
            training[key] = getattr(args, flag)
    training.update(kernel_changes(args))
    lora = lora_section(training.get("lora"), args.lora_r, args.lora_targets, args.lora_base, "fp32")
    if lora is not None:
        training["lora"] = with_default_targets(lora, data.get("model"))
    cluster = dict(data.get("cluster") or {})
    cluster.setdefault("nodes", 1)
    cluster["gpus_per_node"] = args.nproc or (1 if strategy.get("kind") == "single" else 2)
    data.update(training=training, strategy=strategy, cluster=cluster)
    return data


def run(args) -> int:
    if args.nproc is not None and args.nproc < 1:
        raise ShardfitError("--nproc must be at least 1")
    if args.budget is not None and (not math.isfinite(args.budget) or args.budget <= 0):
        raise ShardfitError(f"--budget must be a positive number of bytes, got {args.budget:g}")
    if args.steps < 1:
        raise ShardfitError(f"--steps must be at least 1, got {args.steps}")
    if not math.isfinite(args.timeout) or args.timeout <= 0:
        raise ShardfitError(f"--timeout must be a positive number of seconds, got {args.timeout:g}")
    if args.bucket is not None and (not math.isfinite(args.bucket) or args.bucket < 0):
        raise ShardfitError(f"--bucket must be a finite number of elements >= 0, got {args.bucket:g}")
    if args.chart and not Path(args.chart).resolve().parent.is_dir():
        raise ShardfitError(f"--chart {args.chart}: folder {Path(args.chart).parent} does not exist")
    if args.script:
        # After `--` argparse hands every word to the positionals: the first lands in `plan`.
        args.script_args = ([args.plan] if args.plan else []) + list(args.script_args)
        return _run_script(args)
    if args.script_args:
        raise ShardfitError(f"unexpected argument '{args.script_args[0]}': arguments after -- go with --script")
    data = build_plan_dict(args)
    plan = load_plan(data)  # fail fast, here, on a bad plan
    config = {"plan": data, "steps": args.steps, "checkpoint": args.checkpoint,
              "budget_bytes": int(args.budget) if args.budget else None, "label": plan.strategy.label}
    result = run_plan_worker(config, plan.cluster.world_size, args.timeout)
    return _print_result(result, plan, args)


def _print_result(result: dict, plan, args) -> int:
    if result.get("error") and result["error"] != "oom":
        raise ShardfitError(f"the profiled run failed: {result['error']}")
    if args.chart and result.get("measured"):
        write_chart(result["measured"], (result.get("estimate") or {}).get("phases"), args.chart,
                    title=f"{plan.model.name} {result['label']} {plan.training.precision} "
                          f"AC {plan.training.activation_checkpointing}")
    if args.json:
        print(json.dumps(result, indent=1))
        return 3 if result.get("error") == "oom" else 0
    title = (f"{plan.model.name} · {result['label']} · {plan.training.precision} · micro-batch "
             f"{plan.training.micro_batch} × seq {plan.training.seq_len} · AC {plan.training.activation_checkpointing}"
             f" · {plan.cluster.world_size} rank{'' if plan.cluster.world_size == 1 else 's'} · worst rank per phase")
    if result.get("error") == "oom":
        # A step cut short by the OOM can't be compared with a whole predicted step.
        print(format_phase_table(result["measured"], title=title + " · measured until the OOM"))
    elif result.get("comparison"):
        print(format_comparison(result["comparison"], title=title))
    else:
        print(format_phase_table(result["measured"], title=title + " (no estimator available)"))
    gathered = GatheredReport(ranks=tuple(RankReport.from_dict(r) for r in result["report"]["ranks"]))
    for line in gathered.imbalance_lines():
        print(f"imbalance: {line}")
    if result.get("diagnosis"):
        print(format_diagnosis(Diagnosis.from_dict(result["diagnosis"])))
    if args.chart:
        print(f"chart: {args.chart}")
    return 3 if result.get("error") == "oom" else 0


def _run_script(args) -> int:
    script = Path(args.script)
    if not script.is_file():
        raise ShardfitError(f"script '{args.script}' not found")
    datas, returncode = run_script(script, list(args.script_args), args.nproc or 2, args.timeout,
                                   int(args.budget) if args.budget else None)
    ranks = tuple(RankReport.from_dict(d) for d in datas)
    gathered = GatheredReport(ranks=ranks)
    failures = [(d["rank"], d["script"]) for d in datas if (d.get("script") or {}).get("exit_code")]
    if failures and not gathered.ooms:
        _print_script_failures(failures)
    if args.chart:
        write_chart(gathered.phases, None, args.chart, title=f"{script.name} (measured)")
    if args.json:
        print(json.dumps(dict(gathered.to_dict(), failures=[dict(s, rank=r) for r, s in failures]), indent=1))
    else:
        title = f"{script.name} · {len(ranks)} ranks · worst rank per phase"
        if failures:
            reached = max((s for _, s in failures), key=lambda s: s.get("step", 0))
            title += f" · measured until the failure (reached {reached['phase']}, step {reached['step']})"
        print(format_phase_table(gathered.phases, title=title))
        for line in gathered.imbalance_lines():
            print(f"imbalance: {line}")
        if gathered.ooms:
            print(format_diagnosis(worst_rank_diagnosis(ranks)))
    return 3 if gathered.ooms else (0 if returncode == 0 else 1)


def _print_script_failures(failures: list) -> None:
    """The script's own error, before the table of what it reached: per failing rank, its exit code
    and the tail of its stderr; ranks that failed alike are shown once."""
    alike: dict = {}
    for rank, script in failures:
        alike.setdefault((script["exit_code"], tuple(script.get("stderr_tail") or ())), []).append(rank)
    for (code, tail), ranks in alike.items():
        who = f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, sorted(ranks)))}"
        print(f"the script failed on {who} (exit code {code})" + (", its stderr ends:" if tail else ""), file=sys.stderr)
        for line in tail:
            print(f"  | {line}", file=sys.stderr)
    sys.stderr.flush()
