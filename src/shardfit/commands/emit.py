"""`shardfit emit PLAN.yaml --format FORMAT [-o PATH] [--force]`: the plan as a config the real tool
accepts. No torch."""
from __future__ import annotations

import os
import sys
from pathlib import Path

from shardfit.emit import EmitOptions, emit, write_files
from shardfit.errors import ShardfitError
from shardfit.spec.planfile import load_plan

FORMAT_HELP = ("deepspeed (ds_config.json), accelerate (accelerate.yaml), fsdp / fsdp2 / ddp / single (runnable script), lightning "
               "(strategy args), hf-trainer (TrainingArguments JSON), torchrun (launch script), deepspeed-launcher "
               "(two files: run_deepspeed.sh + hostfile), slurm (sbatch script), torchtitan (its torchrun line: "
               "run_torchtitan.sh, torchtitan 0.3.0's CLI, any tp / cp / pp / ep layout)")
OUTPUT_HELP = ("where to write (default: print to stdout). One-file formats: PATH is the file to write (replaced if it "
               "exists); an existing folder, or a PATH ending in '/', gets the format's own file name inside it. "
               "deepspeed-launcher writes two files, so PATH is always a folder (created if missing). Files emit names "
               "itself inside a folder are never replaced unless --force. Each file written is printed on stderr.")


def add_arguments(parser) -> None:
    parser.add_argument("plan", help="plan YAML/JSON (e.g. from `shardfit fit ... -o plan.yaml`)")
    parser.add_argument("--format", "-f", required=True, dest="fmt", help=FORMAT_HELP)
    parser.add_argument("-o", "--output", metavar="PATH", help=OUTPUT_HELP)
    parser.add_argument("--force", action="store_true",
                        help="replace files of the same name already in the -o folder (default: refuse, write nothing)")
    parser.add_argument("--entry", help="training entry point for launch formats (default: -m shardfit train PLAN)")
    parser.add_argument("--hosts", help="comma-separated host names for the DeepSpeed hostfile")
    parser.add_argument("--master-addr", default="$MASTER_ADDR", dest="master_addr")
    parser.add_argument("--master-port", type=int, default=29500, dest="master_port")
    parser.add_argument("--weights", metavar="PATH",
                        help="fsdp / fsdp2 / ddp: start from the pretrained safetensors in this save_pretrained folder, read "
                             "shard by shard on each rank (default: the model's own init on the meta-built model)")
    parser.add_argument("--data", metavar="PATH",
                        help="fsdp / fsdp2 / ddp: train on this .txt / .jsonl file or save_to_disk dataset folder "
                             "(default: the plan's data.path; none: random tokens), as `shardfit train --data`")
    parser.add_argument("--tokenizer", metavar="DIR",
                        help="with --data: a local tokenizer folder (default: the plan's data.tokenizer; none: byte-level)")
    parser.add_argument("--pack", action="store_true",
                        help="with --data: pack documents into full seq_len rows instead of padded, length-grouped batches")
    parser.add_argument("--time", default="24:00:00", help="SLURM time limit (default 24:00:00)")


def run(args) -> int:
    if not 1 <= args.master_port <= 65535:
        raise ShardfitError(f"--master-port must be between 1 and 65535, got {args.master_port}")
    plan = load_plan(args.plan)
    hosts = tuple(h.strip() for h in args.hosts.split(",") if h.strip()) if args.hosts else ()
    options = EmitOptions(plan_path=args.plan, entry=args.entry, hosts=hosts, master_addr=args.master_addr,
                          master_port=args.master_port, time_limit=args.time,
                          weights=args.weights, data=args.data, tokenizer=args.tokenizer, pack=args.pack)
    result = emit(plan, args.fmt, options)
    if args.output:
        target, single = output_target(args.output, result.files, args.fmt, args.force)
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


def output_target(output: str, files: dict[str, str], fmt: str, force: bool) -> tuple[Path, bool]:
    """Where `-o PATH` puts the files, checked before anything is written: (path, True) for the file
    itself, (folder, False) for a folder that gets each file under its own name."""
    target = Path(output)
    if len(files) == 1 and not target.is_dir() and not output.endswith(("/", os.sep)):
        if target.exists() and not target.is_file():
            raise ShardfitError(f"-o {output} exists and is not a regular file: give a file or folder path, "
                                "or omit -o to print to stdout")
        return target, True
    if target.exists() and not target.is_dir():
        what = (f"--format {fmt} writes {len(files)} files ({', '.join(files)}), so -o names a folder"
                if len(files) > 1 else "-o ends with '/', so it names a folder")
        raise ShardfitError(f"{what}, but {output} is a file: give a folder path (created if missing)")
    existing = [name for name in files if (target / name).exists()]
    if existing and not force:
        raise ShardfitError(f"{target} already holds {', '.join(existing)}: pass --force to replace "
                            f"{'it' if len(existing) == 1 else 'them'}, or choose another -o (nothing was written)")
    return target, False
