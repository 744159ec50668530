"""`shardfit convert CHECKPOINT --out DIR`: a DeepSpeed ZeRO checkpoint becomes a DCP checkpoint
(model + AdamW state + scheduler + data position + RNG), which DDP, FSDP and FSDP2 resume from on
any world size: `shardfit train --strategy fsdp2 --resume DIR`. The other way needs no command:
`shardfit train --strategy zero3 --resume DCP_CHECKPOINT` loads the DCP state into ZeRO's partitions."""
from __future__ import annotations

from shardfit.train.convert import deepspeed_to_dcp


def add_arguments(parser) -> None:
    parser.add_argument("checkpoint", help="a DeepSpeed checkpoint folder written by `shardfit train` (step-K)")
    parser.add_argument("--out", required=True, help="the DCP checkpoint folder to write")
    parser.add_argument("--to", default="dcp", choices=("dcp",),
                        help="target format: dcp (the other way needs no conversion: zero1/2/3 resume from a "
                             "DCP checkpoint directly)")


def run(args) -> int:
    from pathlib import Path

    from shardfit.train.checkpoint import resolve_resume

    source = resolve_resume(args.checkpoint, Path(args.checkpoint))
    out = deepspeed_to_dcp(source, Path(args.out))
    print(f"converted {source} (DeepSpeed) -> {out} (DCP): resume with `shardfit train --strategy fsdp2 --resume {out}`")
    return 0
