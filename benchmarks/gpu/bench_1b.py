"""GPU bench: a ~1B Llama (the llama-1b preset, 1.10B parameters) under every strategy that runs on
ONE GPU, each as its own torchrun job, in under 5 minutes on one H200.

    bash scripts/setup.sh            # or any venv with a CUDA torch, deepspeed, transformers
    python benchmarks/gpu/bench_1b.py [--out runs/bench-1b] [--strategies ...] [--checkpoint]

What to expect and why:
- One GPU means a world size of 1: nothing is sharded and the collectives are local, so this
  compares the engines' own costs (wrapping, bucket and flat-buffer memory, ZeRO-3's gather
  machinery, CPU offload over PCIe), not sharding. FSDP1 switches full_shard to NO_SHARD at
  world size 1 (it warns); the memory by category shows each engine's overheads.
- bf16 mixed precision, micro-batch 4 x 1024 tokens, AdamW; DeepSpeed's own default buckets
  (5e8 elements) so its figures are what a user gets out of the box.
- MFU = 6 N tokens/s over the H200's dense bf16 peak (989 TFLOP/s).
- zero3+offload runs last: its CPU Adam op compiles on first use (about a minute on a fresh
  machine, cached in TORCH_EXTENSIONS_DIR afterwards). Strategies that would start after the
  time budget (--budget-s, 270 s by default) are reported as skipped rather than overrun it.
- The checkpoint round trip is off by default: 1.1B parameters with AdamW state are ~13 GB per
  checkpoint, tens of seconds to write and read per strategy. --checkpoint turns it on (then
  expect ~10 minutes and ~15 GB of free disk; checkpoints are deleted after the check).
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

STRATEGIES = ("ddp", "fsdp:full_shard", "fsdp:shard_grad_op", "fsdp2", "zero1", "zero2", "zero3", "zero3+offload")


def plan_1b():
    from shardfit.spec.models import load_model_spec
    from shardfit.spec.plan import Cluster, Plan, Schedule, Strategy, Training

    return Plan(model=load_model_spec("llama-1b"), strategy=Strategy(),
                training=Training(micro_batch=4, seq_len=1024, precision="bf16"),
                cluster=Cluster(nodes=1, gpus_per_node=1, gpu="H200"),
                schedule=Schedule(lr=1e-4, warmup_steps=2, steps=50, seed=1234))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="runs/bench-1b")
    parser.add_argument("--strategies", default=",".join(STRATEGIES))
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--budget-s", type=float, default=270, help="start no strategy after this many seconds")
    parser.add_argument("--timeout", type=float, default=150, help="seconds per torchrun job")
    parser.add_argument("--checkpoint", action="store_true", help="also run the checkpoint round trip (slow)")
    args = parser.parse_args(argv)

    import torch

    if not torch.cuda.is_available():
        print("bench_1b: no CUDA device: this benchmark needs one GPU (use `shardfit bench` on CPU)", file=sys.stderr)
        return 2
    from shardfit.bench import report
    from shardfit.bench.run import bench

    started = time.perf_counter()
    out = Path(args.out)
    labels = [s.strip() for s in args.strategies.split(",") if s.strip()]
    print(f"# bench_1b: llama-1b, 1 x {torch.cuda.get_device_name(0)}, torch {torch.__version__}, "
          f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}", flush=True)
    result = bench(plan_1b(), labels, out=out, nproc=1, warmup=args.warmup, steps=args.steps,
                   timeout=args.timeout, checkpoint=args.checkpoint, deadline_s=args.budget_s,
                   progress=lambda line, end="\n": end == "\n" and print(line, flush=True))
    files = report.write_all(result, out)
    print()
    print(report.table(result))
    print()
    for r in result["results"]:
        if r.get("status") == "ok":
            cuda = r["memory"].get("cuda") or {}
            print(f"{r['strategy']:<20} MFU {100 * (r.get('mfu') or 0):5.1f}%  "
                  f"CUDA max allocated {cuda.get('max_allocated', 0) / 2**30:6.2f} GiB  "
                  f"max reserved {cuda.get('max_reserved', 0) / 2**30:6.2f} GiB")
    print(f"\nwall {time.perf_counter() - started:.0f} s; report: {files['html']}")
    return 0 if all(r.get("status") in ("ok", "skipped") for r in result["results"]) else 1


if __name__ == "__main__":
    sys.exit(main())
