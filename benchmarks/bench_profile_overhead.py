"""Step time with `shardfit.profile` tracking over without, in the same run (single process, CPU).

    .venv/bin/python benchmarks/bench_profile_overhead.py [--model tiny-llama] [--seq 256] [--steps 6]

Prints median step times for: no profiler, profile(enabled=False) (tracking off: must be ~1.00x)
and profile() (tracking on), interleaved round by round so machine noise hits all three alike.
"""
from __future__ import annotations

import argparse
import platform
import statistics
import time


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="tiny-llama")
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--steps", type=int, default=4, help="steps per round and mode")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()

    import torch

    import shardfit
    from shardfit.modeling import build_model

    torch.set_num_threads(1)
    model = build_model(args.model, device="cpu", seed=0)
    optimizer = torch.optim.AdamW(model.parameters(), foreach=False)
    vocab = model.config.vocab_size

    def step(i):
        ids = torch.randint(0, vocab, (args.batch, args.seq), generator=torch.Generator().manual_seed(i))
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    def timed(mode):
        times = []
        for i in range(args.steps):
            if mode == "none":
                start = time.perf_counter()
                step(i)
                times.append(time.perf_counter() - start)
            else:
                with shardfit.profile(model, optimizer, enabled=mode == "on"):
                    start = time.perf_counter()
                    step(i)
                    times.append(time.perf_counter() - start)
        return times

    step(0)  # warm-up: optimizer states, allocator, kernels
    samples = {"none": [], "off": [], "on": []}
    for _ in range(args.rounds):
        for mode in samples:
            samples[mode] += timed(mode)
    median = {mode: statistics.median(values) for mode, values in samples.items()}
    n = sum(p.numel() for p in model.parameters())
    print(f"# bench_profile_overhead: {args.model} ({n / 1e6:.2f}M params), batch {args.batch} x seq {args.seq}, "
          f"AdamW, 1 CPU thread; torch {torch.__version__}, {platform.processor() or platform.machine()}, "
          f"{time.strftime('%Y-%m-%d')}")
    print(f"step time, no profiler:        {median['none'] * 1e3:8.1f} ms")
    print(f"step time, tracking off:       {median['off'] * 1e3:8.1f} ms  ({median['off'] / median['none']:.2f}x)")
    print(f"step time, tracking on:        {median['on'] * 1e3:8.1f} ms  ({median['on'] / median['none']:.2f}x)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
