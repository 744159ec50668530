"""Benchmark: how fast `fit` answers. The issue's bar: llama-3.1-405b on 1024 GPUs in under a second,
with torch never imported. Run: python benchmarks/bench_fit.py"""
from __future__ import annotations

import platform
import statistics
import sys
import time

CASES = [  # (model, gpu, GPUs per node, nodes, seq, global batch)
    ("llama-3.1-405b", "H100-80GB", 8, 128, 8192, 2048),
    ("llama-3.1-405b", "H100-80GB", 8, 1, 8192, 64),
    ("llama-3.1-70b", "A100-80GB", 8, 4, 4096, 512),
    ("llama-3.1-8b", "H100-80GB", 8, 1, 4096, 512),
]


def main() -> int:
    started = time.perf_counter()
    from shardfit.fit import FitRequest, fit
    from shardfit.spec.models import load_model_spec
    imported = time.perf_counter() - started
    print(f"# bench_fit  python {platform.python_version()}  {platform.machine()}  {time.strftime('%Y-%m-%d')}")
    print(f"import shardfit.fit: {imported * 1000:.0f} ms")
    print(f"{'model':16s} {'cluster':>14s} {'seq':>5s} {'best':34s} {'estimates':>9s} {'median ms':>9s} {'max ms':>7s}")
    worst = 0.0
    for model, gpu, gpus, nodes, seq, batch in CASES:
        request = FitRequest.build(model=load_model_spec(model), gpu=gpu, gpus_per_node=gpus, nodes=nodes, seq_len=seq,
                                   global_batch=batch)
        times = []
        for _ in range(5):
            t = time.perf_counter()
            result = fit(request)
            times.append(time.perf_counter() - t)
        best = result.best.label if result.best else "nothing fits"
        print(f"{model:16s} {f'{nodes}x{gpus} {gpu}':>14s} {seq:5d} {best:34s} {result.estimates:9d} "
              f"{statistics.median(times) * 1000:9.1f} {max(times) * 1000:7.1f}")
        worst = max(worst, max(times))
    torch_loaded = "torch" in sys.modules
    print(f"torch imported: {torch_loaded}; slowest fit: {worst * 1000:.1f} ms (bar: 1000 ms)")
    return 0 if worst < 1.0 and not torch_loaded else 1


if __name__ == "__main__":
    raise SystemExit(main())
