"""`shardfit doctor CONFIG... [--model M --gpu G --gpus N]`: the classic mistakes in existing configs.

Exit status: 0 no errors found, 1 at least one error-severity finding, 2 unreadable input. No torch."""
from __future__ import annotations

import json

from shardfit.doctor.diagnose import diagnose
from shardfit.doctor.rules import Context
from shardfit.errors import ShardfitError
from shardfit.spec.gpus import get_gpu, split_gpus
from shardfit.spec.models import load_model_spec
from shardfit.spec.plan import parse_activation_checkpointing


def add_arguments(parser) -> None:
    parser.add_argument("configs", nargs="+", metavar="CONFIG",
                        help="DeepSpeed JSON, Accelerate YAML, TrainingArguments JSON, a plan, a model config.json, "
                             "or a training script (.py, read, never run)")
    parser.add_argument("--model", help="the model being trained (preset, config path): enables the size rules")
    parser.add_argument("--gpu", help="GPU catalog name or custom:SIZE (custom:24 is GiB; custom:80GB): enables the memory rules")
    parser.add_argument("--gpus", type=int, help="total GPUs (without --nodes, nodes of 8 above 8 GPUs)")
    parser.add_argument("--nodes", type=int, help="nodes (GPUs per node = --gpus / --nodes)")
    parser.add_argument("--seq", type=int, help="sequence length in tokens")
    parser.add_argument("--global-batch", type=int, dest="global_batch", help="intended sequences per optimizer step")
    parser.add_argument("--precision", choices=("bf16", "fp16", "fp32"),
                        help="the run's precision where the configs say \"auto\" or nothing (HF Trainer --bf16/--fp16)")
    parser.add_argument("--micro-batch", type=int, dest="micro_batch", help="sequences per GPU per micro-step "
                        "(per_device_train_batch_size) where the configs say \"auto\"")
    parser.add_argument("--grad-accum", type=int, dest="grad_accum", help="gradient accumulation steps")
    parser.add_argument("--ac", help="activation checkpointing: none | full | selective | every-N")
    parser.add_argument("--host-memory-gib", type=float, dest="host_memory_gib",
                        help="host RAM per node (a full-state-dict save gathers the model in rank 0's host RAM)")
    parser.add_argument("--json", action="store_true")


def format_report(report) -> str:
    lines = ["read: " + ", ".join(f"{path} ({kind})" for path, kind in report.files)]
    lines += [f"assumed: {line}" for line in report.assumed]
    if not report.findings:
        lines.append("no findings")
        return "\n".join(lines)
    for f in report.findings:
        where = f" [{f.where}]" if f.where else ""
        lines += [f"{f.severity.upper():7s} {f.rule}{where}", f"        {f.message}", f"        fix: {f.fix}"]
    counts = {s: sum(f.severity == s for f in report.findings) for s in ("error", "warning", "info")}
    lines.append(", ".join(f"{n} {s}{'s' if n != 1 else ''}" for s, n in counts.items()))
    return "\n".join(lines)


def run(args) -> int:
    for name in ("gpus", "nodes", "seq", "global_batch", "micro_batch", "grad_accum"):
        value = getattr(args, name)
        if value is not None and value < 1:
            raise ShardfitError(f"--{name.replace('_', '-')} must be at least 1, got {value}")
    model = gpu = None
    if args.model:
        model = load_model_spec(args.model)
    if args.gpu:
        gpu = get_gpu(args.gpu)
    nodes, per_node = args.nodes, None
    if args.gpus is not None:
        nodes, per_node = split_gpus(args.gpus, args.nodes)
    if args.host_memory_gib is not None and not args.host_memory_gib > 0:
        raise ShardfitError(f"--host-memory-gib must be a positive number of GiB, got {args.host_memory_gib}")
    ac = None
    if args.ac is not None:
        parse_activation_checkpointing(args.ac)  # a bad value is one line here
        ac = args.ac.strip().lower() != "none"
    ctx = Context(model=model, gpu=gpu, gpus_per_node=per_node, nodes=nodes, seq_len=args.seq,
                  global_batch=args.global_batch, host_memory_gib=args.host_memory_gib)
    flags = {"precision": args.precision, "micro_batch": args.micro_batch, "grad_accum": args.grad_accum,
             "global_batch": args.global_batch, "activation_checkpointing": ac}
    try:
        report = diagnose(args.configs, ctx, flags)
    except (AttributeError, TypeError, ValueError, OverflowError) as exc:
        # NOTE: each reader expects its tool's schema; a value of the wrong type or size (a number where
        # a section belongs, 1e400 as a bucket) is the file's mistake: one line, not a traceback.
        detail = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise ShardfitError(f"{', '.join(args.configs)}: a value has the wrong type or size for this kind of config "
                            f"({detail}): check it against the tool's documented schema") from None
    if args.json:
        print(json.dumps({"files": [{"path": p, "kind": k} for p, k in report.files], "assumed": list(report.assumed),
                          "findings": [{"rule": f.rule, "severity": f.severity, "message": f.message, "fix": f.fix,
                                        "where": f.where} for f in report.findings]}, indent=2))
    else:
        print(format_report(report))
    return 1 if report.errors else 0
