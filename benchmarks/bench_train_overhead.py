"""Overhead of `shardfit train` over hand-written loops on the same model, data and ranks.

    python benchmarks/bench_train_overhead.py                 # 2 CPU ranks (relaunches under torchrun)
    python benchmarks/bench_train_overhead.py --steps 40 --model tiny-llama --seq 256 --micro-batch 4

Runs, in one process group: our loop on fsdp2 vs a minimal FSDP2 loop (fully_shard per block and
root, AdamW, clip, step), and our loop on zero3 vs a raw DeepSpeed engine loop (engine(batch),
engine.backward, engine.step). Each pair runs three times, alternating, and the best median step time of
each side counts (the machine is shared: medians of alternating runs resist noise). Target: <= 1.03.
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time

WARMUP = 3


def parse():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny-llama")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--micro-batch", type=int, default=4, dest="micro_batch")
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--engines", default="fsdp2,zero3", help="which pairs to run: fsdp2, zero3")
    return parser.parse_args()


def plan_for(args, kind):
    from shardfit.spec.models import load_model_spec
    from shardfit.spec.plan import is_deepspeed_kind, plan_from_dict

    strategy = {"kind": kind}
    if is_deepspeed_kind(kind):
        strategy.update(reduce_bucket_size=5_000_000, allgather_bucket_size=5_000_000, prefetch_bucket_size=500_000)
    return plan_from_dict({"model": args.model, "strategy": strategy,
                           "training": {"micro_batch": args.micro_batch, "seq_len": args.seq, "precision": "fp32"},
                           "schedule": {"steps": args.steps, "warmup_steps": 2, "log_every": 10**6, "seed": 5}},
                          resolve_model=load_model_spec)


def ours(plan, ctx):
    from shardfit.train.loop import RunOptions, train

    with tempfile.TemporaryDirectory() as out:
        records = train(plan, out, RunOptions(progress=False, quiet=True), ctx=ctx)
    return statistics.median(r["step_time"] for r in records[WARMUP:])


def _batches(plan, ctx):
    from shardfit.data import DistributedBatches, collate, load_data

    _, data = load_data(None, None, plan.training.seq_len, 10**9)
    sampler = DistributedBatches([len(e) for e in data.train], plan.training.micro_batch, ctx.rank, ctx.world_size,
                                 plan.schedule.seed)
    return lambda: collate([data.train[i] for i in sampler.next()], data.pad_id)


def raw_fsdp2(plan, ctx):
    import torch
    from torch.distributed.fsdp import fully_shard

    from shardfit.modeling import block_classes, build_model

    model = build_model(plan.model, "cpu", "fp32", seed=plan.schedule.seed).to(ctx.device)
    blocks = tuple(block_classes(model))
    for block in [m for m in model.modules() if isinstance(m, blocks)]:
        fully_shard(block)
    fully_shard(model, reshard_after_forward=False)
    optimizer = torch.optim.AdamW(model.parameters(), lr=plan.schedule.lr, foreach=False)
    next_batch = _batches(plan, ctx)
    times = []
    for _ in range(plan.schedule.steps):
        start = time.perf_counter()
        batch = {k: v.to(ctx.device) for k, v in next_batch().items()}
        model(**batch).loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, foreach=False)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if ctx.device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times[WARMUP:])


def raw_deepspeed(plan, ctx):
    import deepspeed
    import torch

    from shardfit.engines.deepspeed import ds_config
    from shardfit.modeling import build_model

    deepspeed.init_distributed(dist_backend=ctx.backend)
    model = build_model(plan.model, "cpu", "fp32", seed=plan.schedule.seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=plan.schedule.lr, foreach=False)
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer,
                                      config=ds_config(plan, ctx.world_size, ctx.device.type == "cuda"))
    next_batch = _batches(plan, ctx)
    times = []
    for _ in range(plan.schedule.steps):
        start = time.perf_counter()
        batch = {k: v.to(engine.device) for k, v in next_batch().items()}
        loss = engine(**batch).loss
        engine.backward(loss)
        engine.step()
        if ctx.device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times[WARMUP:])


def main() -> int:
    args = parse()
    if "LOCAL_RANK" not in os.environ:
        from shardfit.runtime_env import launch_env
        env = launch_env()
        command = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={args.nproc}", "--standalone",
                   __file__, *sys.argv[1:]]
        return subprocess.call(command, env=env)

    import torch
    import torch.distributed as dist

    from shardfit.engines.base import init_distributed

    ctx = init_distributed()
    pairs = {"fsdp2": raw_fsdp2, "zero3": raw_deepspeed}
    rows = []
    for kind in args.engines.split(","):
        plan = plan_for(args, kind)
        ours_times, raw_times = [], []
        for _ in range(3):  # alternate: A B A B A B
            ours_times.append(ours(plan, ctx))
            raw_times.append(pairs[kind](plan, ctx))
        rows.append((kind, min(ours_times), min(raw_times)))
    if ctx.rank == 0:
        device = torch.cuda.get_device_name() if ctx.device.type == "cuda" else f"CPU ({os.cpu_count()} cores)"
        print(f"# train overhead: {args.model}, {ctx.world_size} ranks on {device}, micro_batch {args.micro_batch}, "
              f"seq {args.seq}, {args.steps} steps (median after {WARMUP}), torch {torch.__version__}, "
              f"{time.strftime('%Y-%m-%d')}")
        print(f"{'engine':8s} {'shardfit ms':>12s} {'raw loop ms':>12s} {'ratio':>7s}")
        for kind, mine, raw in rows:
            print(f"{kind:8s} {mine * 1e3:12.2f} {raw * 1e3:12.2f} {mine / raw:7.3f}")
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
