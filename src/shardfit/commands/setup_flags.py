"""`--from-trainer-args args.json` / `--from-accelerate-config cfg.yaml` / `--deepspeed ds.json` on plan and
fit: size (or improve) the run an existing setup describes, read through doctor's reader. No torch."""
from __future__ import annotations

import sys

from shardfit.integrations.setup_plan import check_kind, plan_from_files

# flag -> (argparse dest, what the file must read as)
SETUP_FLAGS = {"--from-trainer-args": ("from_trainer_args", ("hf-trainer",)),
               "--from-accelerate-config": ("from_accelerate_config", ("accelerate",)),
               "--deepspeed": ("from_deepspeed", ("deepspeed",))}


def add_setup_arguments(parser) -> None:
    parser.add_argument("--from-trainer-args", dest="from_trainer_args", metavar="ARGS.json",
                        help="size the run these HF TrainingArguments describe (JSON: TrainingArguments.to_dict(), "
                             "or what `emit --format hf-trainer` writes)")
    parser.add_argument("--from-accelerate-config", dest="from_accelerate_config", metavar="CFG.yaml",
                        help="size the run this `accelerate launch --config_file` YAML describes")
    parser.add_argument("--deepspeed", dest="from_deepspeed", metavar="DS.json",
                        help="size the run this DeepSpeed config describes (\"auto\" values from the other files or flags)")


def setup_paths(args) -> list[str]:
    """The setup files given, each checked to be what its flag says (one line otherwise)."""

    paths = []
    for flag, (dest, kinds) in SETUP_FLAGS.items():
        path = getattr(args, dest, None)
        if path:
            check_kind(path, kinds, flag)
            paths.append(path)
    return paths


def plan_from_args(args, model, base=None, **known):
    """The SetupPlan of the files given (None when none is), the "read/assumed" lines on stderr."""
    paths = setup_paths(args)
    if not paths:
        return None

    result = plan_from_files(paths, model, base=base, **{k: v for k, v in known.items() if v is not None})
    print("read: " + ", ".join(f"{path} ({kind})" for path, kind in result.files), file=sys.stderr)
    for line in result.assumed:
        print(f"assumed: {line}", file=sys.stderr)
    return result
