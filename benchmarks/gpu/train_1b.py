"""One GPU (an H200 when lent one): train the ~1.1B `llama-1b` preset for a few steps under ddp,
fsdp2 and zero3 through `shardfit train`'s loop, and print tokens/s, MFU and peak memory.
Prepared to finish in under 5 minutes; nothing here runs on CPU.

    python benchmarks/gpu/train_1b.py                     # relaunches itself under torchrun (1 rank)
    python benchmarks/gpu/train_1b.py --steps 12 --micro-batch 4 --seq 2048 --strategies ddp,fsdp2,zero3

MFU = achieved model FLOP/s over the GPU's dense bf16 peak, with model FLOPs per token
6·N + 12·layers·hidden·seq (Kaplan/PaLM: matmuls forward and backward, plus attention scores);
activation-checkpoint recompute is not counted (the standard convention).
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time

PEAK_BF16_TFLOPS = {"H200": 989.0, "H100": 989.0, "A100": 312.0, "L40S": 362.0, "A10": 125.0}
WARMUP = 3


def parse():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="llama-1b")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--micro-batch", type=int, default=4, dest="micro_batch")
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--ac", default="full")
    parser.add_argument("--strategies", default="ddp,fsdp2,zero3")
    parser.add_argument("--cpu-smoke", action="store_true", dest="cpu_smoke",
                        help="run on CPU anyway (a code-path check with a tiny model; figures meaningless)")
    return parser.parse_args()


def peak_tflops(name: str) -> float:
    for key, value in PEAK_BF16_TFLOPS.items():
        if key in name:
            return value
    return float("nan")


def main() -> int:
    args = parse()
    if "LOCAL_RANK" not in os.environ:
        from shardfit.runtime_env import launch_env
        env = {**launch_env(), "OMP_NUM_THREADS": "8"}
        return subprocess.call([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=1", "--standalone",
                                __file__, *sys.argv[1:]], env=env)

    import torch
    import torch.distributed as dist

    from shardfit.engines.base import init_distributed
    from shardfit.spec.models import load_model_spec
    from shardfit.spec.plan import plan_from_dict
    from shardfit.train.loop import RunOptions, train

    cuda = torch.cuda.is_available()
    if not cuda and not args.cpu_smoke:
        print("train_1b.py needs a CUDA GPU (or --cpu-smoke with a tiny --model)", file=sys.stderr)
        return 2
    ctx = init_distributed()
    spec = load_model_spec(args.model)
    gpu = torch.cuda.get_device_name() if cuda else "CPU"
    flops_per_token = 6 * spec.n_params + 12 * spec.num_layers * spec.hidden_size * args.seq
    # Full-length examples: the shipped corpus's paragraphs joined until each exceeds seq bytes (the
    # byte tokenizer makes one token per byte), so every micro-batch is micro_batch x seq tokens.
    from shardfit.data import read_documents

    docs, _ = read_documents(None)
    long_docs, current = [], ""
    for doc in docs * 4:
        current = f"{current} {doc}" if current else doc
        if len(current) > args.seq + 2:
            long_docs.append(current)
            current = ""
    data_file = os.path.join(tempfile.gettempdir(), f"shardfit_train_1b_{args.seq}.txt")
    with open(data_file, "w") as fh:
        fh.write("\n\n".join(long_docs))
    rows = []
    for kind in args.strategies.split(","):
        plan = plan_from_dict({
            "model": args.model, "strategy": {"kind": kind},
            "training": {"micro_batch": args.micro_batch, "seq_len": args.seq, "precision": "bf16",
                         "activation_checkpointing": args.ac},
            "schedule": {"steps": args.steps, "warmup_steps": 2, "log_every": args.steps, "lr": 3e-4, "seed": 1},
            "cluster": {"nodes": 1, "gpus_per_node": 1, "gpu": "H100-80GB"},
            "data": {"path": data_file},
            # Small DeepSpeed buckets on CPU only: the defaults allocate ~2 GB of host memory.
            **({} if cuda else {"strategy": {"kind": kind, "reduce_bucket_size": 2_000_000,
                                             "allgather_bucket_size": 2_000_000, "prefetch_bucket_size": 200_000}}),
        }, resolve_model=load_model_spec)
        if cuda:
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
        started = time.perf_counter()
        try:
            with tempfile.TemporaryDirectory() as out:
                records = train(plan, out, RunOptions(progress=False, quiet=True), ctx=ctx)
        except Exception as exc:  # noqa: BLE001 - one failing engine must not hide the others' figures
            rows.append((kind, f"failed: {type(exc).__name__}: {str(exc)[:120]}"))
            continue
        step = statistics.median(r["step_time"] for r in records[WARMUP:])
        # Tokens actually in the batches (dynamic padding can make them fewer than micro_batch*seq).
        tokens = statistics.median(r["tokens"] for r in records[WARMUP:])
        tps = tokens / step
        mfu = tps * flops_per_token / (peak_tflops(gpu) * 1e12)
        rows.append((kind, f"{tps:10,.0f} tok/s  step {step * 1e3:7.1f} ms  MFU {mfu * 100:5.1f}%  "
                           f"peak {records[-1]['peak_mem_bytes'] / 2**30:6.2f} GiB  "
                           f"loss {records[0]['loss']:.3f} -> {records[-1]['loss']:.3f}  "
                           f"(total {time.perf_counter() - started:.0f} s)"))
    print(f"# {args.model} ({spec.n_params / 1e9:.2f}B params), 1x {gpu}, bf16, AC {args.ac}, micro_batch "
          f"{args.micro_batch}, seq {args.seq}, {args.steps} steps (median after {WARMUP}), torch {torch.__version__}, "
          f"{time.strftime('%Y-%m-%d')}")
    for kind, text in rows:
        print(f"{kind:6s} {text}")
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
