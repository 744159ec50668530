"""The torchrun worker of `shardfit calibrate`: every rank measures at once (what a training step
sees: ranks share the cores, the memory bus and the links), rank 0 writes the figures.

    torchrun --nproc-per-node 2 -m shardfit.bench.calibrate_worker OUT.json

Progress lines start with "calibrate:" (the orchestrator echoes them). Every figure is a median of
repeated timings after a warm-up call.
"""
from __future__ import annotations

import json
import os
import statistics
import sys
import time
from pathlib import Path

from shardfit.bench.calibrate_engines import fsdp_units
from shardfit.bench.calibrate_hooks import ddp_hook, deepspeed_hooks, eager_dispatch, sac_dispatch, say
from shardfit.runtime_env import extensions_dir, leave

# Shapes per device: CPU ranks run thin matmuls at a few GFLOP/s; a GPU needs LLM-sized ones.
MATMUL_TOKENS = {"cpu": (64, 256, 1024, 4096), "cuda": (512, 2048, 8192, 16384)}
MATMUL_WIDTHS = {"cpu": (64, 256, 1024), "cuda": (1024, 4096, 8192)}
MAX_MATMUL_FLOPS = {"cpu": 2.2e9, "cuda": 4e12}  # skip shapes slower than ~0.1 s per call here
COPY_BYTES = {"cpu": 64 * 2**20, "cuda": 1 * 2**30}
COLLECTIVE_BYTES = {"cpu": 16 * 2**20, "cuda": 256 * 2**20}
OPTIMIZER_PARAMS = {"cpu": 2_000_000, "cuda": 50_000_000}
TIME_BUDGET_S = 0.12  # per timed figure, after the warm-up call


def timed(fn, sync, budget_s: float = TIME_BUDGET_S, min_reps: int = 3, max_reps: int = 200) -> float:
    """Median seconds of one call. Ranks agree on the repetition count (the slowest rank's budget),
    so collectives inside `fn` stay matched."""
    import torch
    import torch.distributed as dist

    fn()
    sync()
    start = time.perf_counter()
    fn()
    sync()
    first = time.perf_counter() - start
    reps = torch.tensor([max(min_reps, min(max_reps, int(budget_s / max(first, 1e-7))))], dtype=torch.long)
    dist.all_reduce(reps, op=dist.ReduceOp.MIN)
    times = []
    for _ in range(int(reps.item())):
        start = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def matmul_rates(ctx, device: str, sync) -> list[dict]:
    import torch

    out = []
    for dtype_name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        for width in MATMUL_WIDTHS[device]:
            for tokens in MATMUL_TOKENS[device]:
                flops = 2.0 * tokens * width * width
                if flops > MAX_MATMUL_FLOPS[device]:
                    continue
                a = torch.randn(tokens, width, dtype=dtype, device=ctx.device)
                b = torch.randn(width, width, dtype=dtype, device=ctx.device)
                seconds = timed(lambda: a @ b, sync)
                out.append({"dtype": dtype_name, "tokens": tokens, "width": width, "tflops": flops / seconds / 1e12})
        best = max(m["tflops"] for m in out if m["dtype"] == dtype_name)
        say(ctx, f"matmul {dtype_name}: up to {best * 1e3:.1f} GFLOP/s per rank")
    return out


def copy_bandwidth(ctx, device: str, sync) -> float:
    import torch

    count = COPY_BYTES[device] // 4
    src = torch.ones(count, dtype=torch.float32, device=ctx.device)
    dst = torch.empty_like(src)
    seconds = timed(lambda: dst.copy_(src), sync)
    gbs = 2 * count * 4 / seconds / 1e9  # read + write
    say(ctx, f"memory copy: {gbs:.1f} GB/s per rank")
    return gbs


def _all_gather(output, chunk):
    import torch.distributed as dist

    try:
        dist.all_gather_into_tensor(output, chunk)
    except (RuntimeError, NotImplementedError):  # a backend without the flat collective
        dist.all_gather(list(output.chunk(dist.get_world_size())), chunk)


def collectives(ctx, device: str, sync) -> dict:
    """Latency (a 2-element all-reduce) and bus bandwidth per rank of all-reduce and all-gather:
    ring bytes each rank sends, (N-1)/N of the buffer for all-gather and twice that for all-reduce,
    over the time beyond the latency: the same bytes the step-time model counts."""
    import torch
    import torch.distributed as dist

    n = ctx.world_size
    ring = (n - 1) / n
    tiny = torch.ones(2, device=ctx.device)
    latency = timed(lambda: dist.all_reduce(tiny), sync, min_reps=10)
    count = COLLECTIVE_BYTES[device] // 4
    big = torch.ones(count, device=ctx.device)
    reduce_s = timed(lambda: dist.all_reduce(big), sync)
    chunk = torch.ones(count // n, device=ctx.device)
    gathered = torch.empty(count // n * n, device=ctx.device)
    gather_s = timed(lambda: _all_gather(gathered, chunk), sync)
    reduce_gbs = 2 * ring * count * 4 / max(reduce_s - latency, 1e-9) / 1e9
    gather_gbs = ring * count // n * n * 4 / max(gather_s - latency, 1e-9) / 1e9
    link = {"backend": ctx.backend, "latency_s": latency, "all_reduce_gbs": reduce_gbs, "all_gather_gbs": gather_gbs,
            "bandwidth_gbs": (reduce_gbs + gather_gbs) / 2, "bytes": count * 4}
    say(ctx, f"{ctx.backend} collectives: latency {latency * 1e6:.0f} us, all-reduce {reduce_gbs:.2f} GB/s, "
             f"all-gather {gather_gbs:.2f} GB/s per rank")
    return link


def overlap(ctx, device: str, sync) -> float:
    """How much of a collective hides behind compute when both run at once: (compute + comm - both) /
    the shorter of the two. On CPU the collective's thread and the matmuls share the same cores."""
    import torch
    import torch.distributed as dist

    width = 256 if device == "cpu" else 4096
    a = torch.randn(1024 if device == "cpu" else 8192, width, device=ctx.device)
    b = torch.randn(width, width, device=ctx.device)
    buffer = torch.ones(COLLECTIVE_BYTES[device] // 16, device=ctx.device)
    comm_s = timed(lambda: dist.all_reduce(buffer), sync)
    one = timed(lambda: a @ b, sync)
    reps = max(1, int(comm_s / max(one, 1e-9)))

    def compute():
        for _ in range(reps):
            a @ b

    compute_s = timed(compute, sync)

    def both():
        handle = dist.all_reduce(buffer, async_op=True)
        compute()
        handle.wait()

    both_s = timed(both, sync)
    hidden = (compute_s + comm_s - both_s) / max(min(compute_s, comm_s), 1e-9)
    value = min(1.0, max(0.0, hidden))
    say(ctx, f"overlap: compute {compute_s * 1e3:.1f} ms + all-reduce {comm_s * 1e3:.1f} ms -> both {both_s * 1e3:.1f} ms: "
             f"{value:.0%} of the collective hidden")
    return value


def host_copy(ctx, device: str, sync) -> float | None:
    import torch

    if device != "cuda":
        say(ctx, "host<->device copy: skipped (the device is the host: offload copies stay in RAM)")
        return None
    host = torch.ones(COPY_BYTES[device] // 4 // 4, dtype=torch.float32).pin_memory()
    dev = torch.empty_like(host, device=ctx.device)
    up = timed(lambda: dev.copy_(host, non_blocking=True), sync)
    down = timed(lambda: host.copy_(dev, non_blocking=True), sync)
    gbs = host.numel() * 4 / ((up + down) / 2) / 1e9
    say(ctx, f"host<->device copy: {gbs:.1f} GB/s per rank (pinned)")
    return gbs


def _params(count: int, device):
    import torch

    pieces = 16  # a model's worth of tensors, not one flat buffer
    return [torch.nn.Parameter(torch.randn(count // pieces, device=device)) for _ in range(pieces)]


def _cpu_adam_built() -> bool:
    """Whether DeepSpeed's CPU Adam op is compiled in this environment's op cache (runtime_env), so
    loading it takes a second, not a build of minutes."""
    return any(Path(extensions_dir()).glob("cpu_adam*/cpu_adam*.so"))


def optimizers(ctx, device: str, sync) -> tuple[dict, dict]:
    """The engines' AdamW on the device (foreach on CUDA, single-tensor on CPU, as engines.base builds
    it), and the offload path's CPU Adam: DeepSpeed's compiled op if it loads, else torch's AdamW."""
    import torch

    count = OPTIMIZER_PARAMS[device]

    def rate(optimizer, params) -> float:
        for p in params:
            p.grad = torch.randn_like(p)
        return count / timed(optimizer.step, sync, budget_s=0.3)

    params = _params(count, ctx.device)
    engine_opt = torch.optim.AdamW(params, lr=1e-3, foreach=device == "cuda")
    engine = {"impl": f"torch.optim.AdamW (foreach={device == 'cuda'})", "params_per_s": rate(engine_opt, params)}
    cpu_params = _params(count, "cpu")
    cpu_opt, impl = None, "torch.optim.AdamW (DeepSpeed CPU Adam is not built yet: its first use compiles it for "\
                          "minutes; rerun calibrate after a zero*+offload run)"
    if _cpu_adam_built():
        try:
            from deepspeed.ops.adam import DeepSpeedCPUAdam

            cpu_opt, impl = DeepSpeedCPUAdam(cpu_params, lr=1e-3), "deepspeed.ops.adam.DeepSpeedCPUAdam"
        except Exception as exc:  # noqa: BLE001 - any failure to load the op falls back, and says so
            impl = f"torch.optim.AdamW (DeepSpeed CPU Adam did not load: {type(exc).__name__})"
    if cpu_opt is None:
        cpu_opt = torch.optim.AdamW(cpu_params, lr=1e-3, foreach=False)
    cpu = {"impl": impl, "params_per_s": rate(cpu_opt, cpu_params)}
    say(ctx, f"optimizer: {engine['impl']} {engine['params_per_s'] / 1e6:.0f} M params/s; "
             f"CPU Adam: {cpu['impl']} {cpu['params_per_s'] / 1e6:.0f} M params/s per rank")
    return engine, cpu


def _device_name(device: str) -> str:
    if device == "cuda":
        import torch

        return torch.cuda.get_device_name()
    import platform

    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _device_memory_gib(device: str) -> float:
    if device == "cuda":
        import torch

        return torch.cuda.get_device_properties(0).total_memory / 2**30
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    import torch
    import torch.distributed as dist

    from shardfit.engines.base import init_distributed

    ctx = init_distributed()
    threads = int(os.environ.get("OMP_NUM_THREADS", "1"))
    torch.set_num_threads(threads)
    device = ctx.device.type
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    say(ctx, f"{ctx.world_size} {device} ranks ({ctx.backend}), {threads} thread(s) each")
    figures = {"device": device, "name": _device_name(device), "torch": torch.__version__, "ranks": ctx.world_size,
               "threads_per_rank": threads, "memory_gib": _device_memory_gib(device)}
    figures["matmul"] = matmul_rates(ctx, device, sync)
    figures["memory_bandwidth_gbs"] = copy_bandwidth(ctx, device, sync)
    figures["links"] = {"intra": collectives(ctx, device, sync)}
    figures["comm_overlap"] = overlap(ctx, device, sync)
    figures["host_link_gbs"] = host_copy(ctx, device, sync)
    figures["optimizer"], figures["cpu_adam"] = optimizers(ctx, device, sync)
    figures["engine_hooks"] = {"sac_dispatch_per_op": sac_dispatch(ctx, device, sync)}
    figures["engine_hooks"].update(eager_dispatch(ctx, device, sync))
    latency = figures["links"]["intra"]["latency_s"]
    figures["engine_hooks"].update(ddp_hook(ctx, device, sync, latency))
    figures["engine_hooks"].update(fsdp_units(ctx, device, sync, latency, figures["engine_hooks"]["ddp_grad_hook"]))
    figures["engine_hooks"].update(deepspeed_hooks(ctx, device, sync, figures["links"]["intra"]["latency_s"]) or {})
    if device != "cuda":
        figures["notes"] = ["host<->device copy not measured: on CPU the device is the host (offload copies are "
                            "RAM copies, charged at the memory copy rate)"]
    if ctx.rank == 0:
        Path(argv[0]).write_text(json.dumps(figures, indent=1))
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    leave(main())  # without the interpreter's teardown, where gloo can abort a finished rank
