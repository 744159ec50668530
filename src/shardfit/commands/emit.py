"""`shardfit emit PLAN.yaml --format FORMAT [-o PATH]`: the plan as a config the real tool accepts. No torch."""
from __future__ import annotations

import sys
from pathlib import Path

FORMAT_HELP = ("deepspeed (ds_config.json), accelerate (accelerate.yaml), fsdp / fsdp2 (runnable script), lightning "
               "(strategy args), hf-trainer (TrainingArguments JSON), torchrun (launch script), deepspeed-launcher "
               "(script + hostfile), slurm (sbatch script)")


def add_arguments(parser) -> None:
    parser.add_argument("plan", help="plan YAML/JSON (e.g. from `shardfit fit ... -o plan.yaml`)")
    parser.add_argument("--format", "-f", required=True, dest="fmt", help=FORMAT_HELP)
    parser.add_argument("-o", "--output", help="file (one-file formats) or folder; default: print to stdout")
    parser.add_argument("--entry", help="training entry point for launch formats (default: -m shardfit train PLAN)")
    parser.add_argument("--hosts", help="comma-separated host names for the DeepSpeed hostfile")
    parser.add_argument("--master-addr", default="$MASTER_ADDR", dest="master_addr")
    parser.add_argument("--master-port", type=int, default=29500, dest="master_port")
    parser.add_argument("--time", default="24:00:00", help="SLURM time limit (default 24:00:00)")


def run(args) -> int:
    from shardfit.emit import EmitOptions, emit, write_files
    from shardfit.spec.planfile import load_plan

    if not 1 <= args.master_port <= 65535:
        from shardfit.errors import ShardfitError
        raise ShardfitError(f"--master-port must be between 1 and 65535, got {args.master_port}")
    plan = load_plan(args.plan)
    hosts = tuple(h.strip() for h in args.hosts.split(",") if h.strip()) if args.hosts else ()
    options = EmitOptions(plan_path=args.plan, entry=args.entry, hosts=hosts, master_addr=args.master_addr,
                          master_port=args.master_port, time_limit=args.time)
    result = emit(plan, args.fmt, options)
    if args.output:
        target = Path(args.output)
        single = len(result.files) == 1 and not target.is_dir() and not args.output.endswith("/")
        for path in write_files(result.files, target, single):
            print(f"wrote {path}", file=sys.stderr)
    elif len(result.files) == 1:
        sys.stdout.write(result.main)
    else:
        for name, text in result.files.items():
            sys.stdout.write(f"# ---- {name} ----\n{text}")
    for note in result.notes:
        print(f"note: {note}", file=sys.stderr)
    return 0
