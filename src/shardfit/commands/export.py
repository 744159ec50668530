"""`shardfit export CHECKPOINT --out DIR`: a training checkpoint (DCP or DeepSpeed) becomes a
Hugging Face model folder (config.json + safetensors) that from_pretrained loads. One process,
no GPU, tensor by tensor."""
from __future__ import annotations

from pathlib import Path

from shardfit.errors import ShardfitError
from shardfit.spec.planfile import read_plan_data
from shardfit.spec.sizes import gib_type
from shardfit.train.export import copy_tokenizer_note, export_checkpoint


def add_arguments(parser) -> None:
    parser.add_argument("checkpoint", help="a checkpoint folder (OUT/checkpoints/step-K), or a run folder (its latest)")
    parser.add_argument("--out", required=True, help="the Hugging Face folder to write")
    parser.add_argument("--max-shard-gb", "--max-shard-size", type=gib_type("--max-shard-gb"), default=2.0,
                        dest="max_shard_gb", help="split the weights into files of at most this size: a size "
                                                  "(500MB, 1GiB) or plain GiB (default 2)")


def run(args) -> int:
    from shardfit.train.checkpoint import resolve_resume  # torch: only when exporting

    if args.max_shard_gb <= 0:
        raise ShardfitError("--max-shard-gb must be positive")
    source = resolve_resume(args.checkpoint, Path(args.checkpoint))
    files = export_checkpoint(source, Path(args.out), max_shard_bytes=int(args.max_shard_gb * 1024**3))
    total = sum(f.stat().st_size for f in files)
    print(f"exported {source} -> {args.out}: {len(files)} safetensors file(s), {total / 2**20:.1f} MiB")
    tokenizer = recorded_tokenizer(source)  # after export_checkpoint, which checks the checkpoint's files first
    if tokenizer is not None:
        copy_tokenizer_note(Path(args.out), tokenizer)  # what `shardfit train --export` writes next to the weights
    return 0


def recorded_tokenizer(checkpoint) -> str | None:
    """The tokenizer the checkpoint was trained with (its plan.yaml `data.tokenizer`): "bytes" for the
    byte-level default, else the folder as training named it. None, after one warning line on stderr,
    when that is unknown or the folder is gone (the weights are exported all the same)."""
    import sys
    from pathlib import Path

    plan_file = Path(checkpoint) / "plan.yaml"
    if not plan_file.is_file():
        print(f"warning: {checkpoint} has no plan.yaml, so its tokenizer is unknown: no tokenizer files were "
              "written next to the weights", file=sys.stderr)
        return None
    data = read_plan_data(plan_file).get("data")
    name = data.get("tokenizer") if isinstance(data, dict) else None
    if name in (None, "", "bytes", "byte"):  # what load_tokenizer reads as the byte-level tokenizer
        return "bytes"
    folder = Path(str(name)).expanduser()
    if not folder.is_dir():
        print(f"warning: tokenizer folder '{name}' recorded in {plan_file} no longer exists: the weights are "
              "exported without tokenizer files; copy them into the output folder yourself", file=sys.stderr)
        return None
    return str(folder)
