"""`shardfit train [PLAN.yaml]`: train a Plan on one device (single), DDP, FSDP, FSDP2 or DeepSpeed ZeRO.

Outside a distributed launch it starts itself under torchrun (--nproc ranks per node; several
nodes with --nnodes/--node-rank/--rdzv-endpoint), so one command works on a laptop and a cluster.
A single-device plan runs under torchrun too, with one rank: the same loop, checkpoints and restarts.
"""
from __future__ import annotations

import os
import sys
from dataclasses import fields, replace

from shardfit.commands.kernel_flags import add_kernel_arguments
from shardfit.commands.lora_flags import add_lora_arguments
from shardfit.errors import ShardfitError
from shardfit.runtime_env import leave
from shardfit.spec.sizes import size_type
from shardfit.train import autopilot, preempt, supervise
from shardfit.train.flags import TrainFlags
from shardfit.train.launch import build_plan, default_nproc, inside_launch


def add_arguments(parser) -> None:
    parser.add_argument("plan", nargs="?", help="plan YAML (default: tiny-llama on CPU, fp32, 20 steps)")
    group = parser.add_argument_group("plan overrides")
    group.add_argument("--model", help="preset name, local config/model directory, or pkg.module:fn")
    group.add_argument("--strategy", help="single (one device), ddp, fsdp[:hybrid_shard], fsdp2[:no_reshard], zero1, "
                                          "zero2, zero3, +offload")
    group.add_argument("--precision", help="fp32, bf16, fp16, bf16-pure")
    group.add_argument("--steps", type=int)
    group.add_argument("--micro-batch", type=int, dest="micro_batch")
    group.add_argument("--seq", type=int, help="maximum sequence length (batches are padded to their longest)")
    group.add_argument("--grad-accum", type=int, dest="grad_accum")
    group.add_argument("--ac", help="activation checkpointing: none, selective (per-op), full, every-N")
    add_kernel_arguments(group)
    group.add_argument("--lr", type=float)
    group.add_argument("--seed", type=int)
    add_lora_arguments(group, base_default_text="fp32 for train")
    group.add_argument("--shard-group-size", type=int, dest="shard_group_size", help="HSDP: ranks per shard group")
    group.add_argument("--tp", type=int, help="tensor-parallel degree (fsdp2 only): ranks of one node that share each "
                       "layer, the rest data parallel; a checkpoint resumes under another --tp / --nproc")
    group.add_argument("--pp", type=int, help="pipeline stages (torch.distributed.pipelining, 1F1B over the "
                       "--grad-accum micro-batches; ddp / fsdp2 inside a stage); a checkpoint resumes under another --pp")
    group.add_argument("--pp-schedule", dest="pp_schedule",
                       help="pipeline schedule: 1f1b (default), gpipe, interleaved, zero-bubble, zbv, dualpipev (the V "
                            "schedules run 2 chunks per rank)")
    group.add_argument("--data", help="local .txt or .jsonl file (default: the embedded corpus)")
    group.add_argument("--tokenizer", help="local HF tokenizer directory (default: byte-level)")
    group.add_argument("--log-every", type=int, dest="log_every")
    group.add_argument("--eval-every", type=int, dest="eval_every")
    group.add_argument("--save-every", type=int, dest="save_every")
    group.add_argument("--keep", type=int, help="checkpoints to keep")
    group.add_argument("--nan-policy", choices=("stop", "skip"), dest="nan_policy")
    group.add_argument("--save-mode", choices=("sync", "async"), dest="save_mode",
                       help="async: checkpoints are written by DCP's writer process while training goes on")
    group.add_argument("--on-save-error", choices=("stop", "continue"), dest="on_save_error",
                       help="a save that fails (disk full, I/O error): stop the run (default) or train on")
    run = parser.add_argument_group("run")
    run.add_argument("--out", default="shardfit-run", help="output folder: metrics.jsonl, checkpoints/ (default: shardfit-run)")
    run.add_argument("--resume", help="'latest', 'latest-valid' (skip damaged checkpoints), 'auto' (latest-valid or a "
                                      "fresh start), a run folder, or a checkpoint folder")
    run.add_argument("--export", help="write a Hugging Face model folder at the end")
    run.add_argument("--prompt", default=None, help="prompt of the sample generated at each evaluation")
    run.add_argument("--no-progress", action="store_true", help="no progress bar (log lines only; also the case when stderr is not a terminal)")
    safety = parser.add_argument_group("reliability")
    safety.add_argument("--autopilot", action="store_true",
                        help="on out-of-memory, change the plan (micro-batch, checkpointing, sharding, offload) and retry")
    safety.add_argument("--memory-budget", type=size_type("B", "--memory-budget"), dest="memory_budget",
                        help="tensor memory per rank: a size (3MiB, 2.5GB) or plain bytes; above it "
                             "torch.OutOfMemoryError is raised (rehearse a GPU on CPU)")
    safety.add_argument("--collective-timeout", type=float, dest="collective_timeout",
                        help="seconds a step's collectives may wait for a silent rank before the job stops (default 600)")
    safety.add_argument("--stop-signals", dest="stop_signals",
                        help="signals that stop the run after the current step with a checkpoint, exit 75 "
                             "(default SIGTERM,SIGUSR1; 'none' to leave them alone)")
    safety.add_argument("--max-restarts", type=int, dest="max_restarts",
                        help="torchrun restarts after a failure; each resumes from the newest intact checkpoint "
                             "(default 0, 4 with --autopilot)")
    launch = parser.add_argument_group("launch")
    launch.add_argument("--nproc", type=int, default=None, help="ranks per node (default 2; 1 for strategy single)")
    launch.add_argument("--nnodes", type=int, default=1)
    launch.add_argument("--node-rank", type=int, default=0, dest="node_rank")
    launch.add_argument("--rdzv-endpoint", dest="rdzv_endpoint", help="HOST:PORT of node 0 (multi-node)")


def run(args) -> int:
    if (args.nproc is not None and args.nproc < 1) or args.nnodes < 1:
        raise ShardfitError("--nproc and --nnodes must be at least 1")

    flags = train_flags(args)
    if not inside_launch():
        if flags.nproc is None:
            flags = replace(flags, nproc=default_nproc(flags))
        supervise.check_run(build_plan(flags), flags, inside=False)  # fail fast, here, on a bad plan or flag
        supervise.export_env(flags)
        restarts = args.max_restarts if args.max_restarts is not None else (4 if args.autopilot else 0)
        return supervise.relaunch(_worker_argv(sys.argv[1:]), flags, restarts)

    import warnings

    if not os.environ.get("SHARDFIT_DEBUG"):
        # Library deprecation notices (torch collectives called by DeepSpeed, transformers renames)
        # repeat on every rank and say nothing a user of `shardfit train` can act on.
        warnings.filterwarnings("ignore", category=FutureWarning)
    from shardfit.train.loop import DEFAULT_PROMPT, RunOptions, train

    supervise.export_env(flags)
    plan = build_plan(flags)
    supervise.check_run(plan, flags, inside=True)
    restarted = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0) > 0
    resume = args.resume or ("auto" if restarted else None)
    decisions = []
    if resume:  # the run's recorded autopilot changes hold for every resume of it, autopilot on or not
        plan, decisions = autopilot.apply_recorded(plan, args.out)
        if decisions and os.environ.get("RANK", "0") == "0":
            print(f"autopilot: training with {len(decisions)} recorded change(s): "
                  + "; ".join(d["change"] for d in decisions), flush=True)
    elif args.autopilot and os.environ.get("RANK", "0") == "0":
        autopilot.forget(args.out)
    options = RunOptions(resume=resume, progress=not args.no_progress, prompt=args.prompt or DEFAULT_PROMPT,
                         export=args.export)
    import torch

    profiler = None
    code = 0
    try:
        with autopilot.memory_budget(plan) as profiler:
            train(plan, args.out, options)
    except preempt.Preempted as exc:
        if os.environ.get("RANK", "0") == "0" and not os.environ.get("SHARDFIT_SUPERVISED"):
            print(f"shardfit: {exc}", file=sys.stderr, flush=True)  # under plain torchrun (SLURM): say it here
        code = preempt.PREEMPTED_EXIT
    except torch.OutOfMemoryError as exc:
        rank = int(os.environ.get("RANK", "0"))
        if not args.autopilot:
            return supervise.explain_oom(exc, profiler, plan, args.out, rank)
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if torch.cuda.is_available() else None
        return autopilot.handle_oom(plan, args.out, exc, rank, len(decisions), device, step=supervise.next_step(args.out))
    except RuntimeError as exc:
        error = supervise.lost_peer(exc)
        if error is None:
            raise
        raise error from None
    finally:
        import torch.distributed as dist
        if dist.is_initialized():
            dist.destroy_process_group()
    leave(code)  # without the interpreter's teardown, where gloo can abort a finished rank


_LAUNCH_FLAGS = ("--nproc", "--nnodes", "--node-rank", "--rdzv-endpoint", "--max-restarts")


def train_flags(args) -> TrainFlags:
    """The flags train/ reads, as plain values (a flag this parser lacks keeps its default)."""
    return TrainFlags(**{f.name: getattr(args, f.name) for f in fields(TrainFlags) if hasattr(args, f.name)})


def _worker_argv(argv: list[str]) -> list[str]:
    """The workers' arguments: the launch flags go to torchrun, not to them. NOTE: torchrun's argparse
    classifies every argument, even those after the script, so `--nproc` there is an 'ambiguous option'."""
    out, skip = [], False
    for arg in argv:
        if skip:
            skip = False
            continue
        name = arg.split("=", 1)[0]
        if name in _LAUNCH_FLAGS:
            skip = "=" not in arg
            continue
        out.append(arg)
    return out
