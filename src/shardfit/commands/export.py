"""`shardfit export CHECKPOINT --out DIR`: a training checkpoint (DCP or DeepSpeed) becomes a
Hugging Face model folder (config.json + safetensors) that from_pretrained loads. One process,
no GPU, tensor by tensor."""
from __future__ import annotations


def add_arguments(parser) -> None:
    parser.add_argument("checkpoint", help="a checkpoint folder (OUT/checkpoints/step-K), or a run folder (its latest)")
    parser.add_argument("--out", required=True, help="the Hugging Face folder to write")
    parser.add_argument("--max-shard-gb", type=float, default=2.0, dest="max_shard_gb",
                        help="split the weights into files of at most this size (default 2)")


def run(args) -> int:
    from pathlib import Path

    from shardfit.errors import ShardfitError
    from shardfit.train.checkpoint import resolve_resume
    from shardfit.train.export import export_checkpoint

    if args.max_shard_gb <= 0:
        raise ShardfitError("--max-shard-gb must be positive")
    source = resolve_resume(args.checkpoint, Path(args.checkpoint))
    files = export_checkpoint(source, Path(args.out), max_shard_bytes=int(args.max_shard_gb * 1024**3))
    total = sum(f.stat().st_size for f in files)
    print(f"exported {source} -> {args.out}: {len(files)} safetensors file(s), {total / 2**20:.1f} MiB")
    return 0
