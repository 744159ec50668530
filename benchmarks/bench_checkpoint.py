"""Checkpoint cost: our crash-safe checkpoints (DCP + RNG + trainer state + an XXH3 manifest,
verified on load) against raw DCP on the same state, the host memory of consolidation, and the
training step time while saving every N steps, blocking and asynchronous (save_mode async), against
not saving at all.

    .venv/bin/python benchmarks/bench_checkpoint.py [--layers 8 --hidden 512 --repeats 3]
                                                    [--steps 24 --save-every 8] [--only-steps]

It starts itself under torchrun (2 ranks, gloo, FSDP2) for save/load, then runs `export`
(consolidation into safetensors) in a fresh process and compares its peak RSS growth with the
largest single tensor plus one output shard. Prints a markdown report (hardware, versions, date).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import platform
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _config(layers: int, hidden: int) -> dict:
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": hidden,
            "intermediate_size": hidden * 11 // 4, "num_attention_heads": hidden // 64, "num_key_value_heads": hidden // 64,
            "num_hidden_layers": layers, "vocab_size": 32000, "max_position_embeddings": 512, "rms_norm_eps": 1e-5,
            "tie_word_embeddings": False, "hidden_act": "silu", "torch_dtype": "float32"}


def worker(args) -> None:
    """Runs on every rank: one training step (so Adam state exists), then timed saves and loads."""
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    from shardfit import engines
    from shardfit.data import Position
    from shardfit.engines.base import init_distributed
    from shardfit.spec.models import load_model_spec
    from shardfit.spec.plan import plan_from_dict
    from shardfit.train import checkpoint as ckpt
    from shardfit.train import manifest as integrity
    from shardfit.train.loop import build_model, settle_garbage_collector

    torch.set_num_threads(1)
    ctx = init_distributed()
    plan = plan_from_dict({"model": str(args.config), "strategy": {"kind": "fsdp2"},
                           "training": {"micro_batch": 1, "seq_len": 32, "precision": "fp32"},
                           "cluster": {"gpus_per_node": ctx.world_size}}, resolve_model=load_model_spec)
    engine = engines.setup(plan, build_model(plan), ctx)
    ids = torch.randint(0, 32000, (1, 32))
    engine.forward_backward({"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids}, True)
    engine.step()
    model, optimizer = engine.model, engine.optimizer
    # As `shardfit train` does after building the engine: otherwise a ~0.2 s full collection lands
    # in whichever timed operation crosses the threshold, and the medians measure the collector.
    settle_garbage_collector()
    root = Path(args.dir)
    results = {key: [] for key in ("ours_save", "raw_save", "ours_load_warm", "raw_load_warm",
                                   "ours_load_cold", "raw_load_cold")}

    def timed(key, fn):
        dist.barrier()
        start = time.perf_counter()
        fn()
        dist.barrier()
        results[key].append(time.perf_counter() - start)

    def raw_save(path):
        msd, osd = get_state_dict(model, optimizer)
        dcp.save({"model": msd, "optim": osd}, checkpoint_id=str(path / "dcp"))

    def raw_load(path):
        msd, osd = get_state_dict(model, optimizer)
        state = {"model": msd, "optim": osd}
        dcp.load(state, checkpoint_id=str(path / "dcp"))
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])

    def ours_load(folder):
        integrity._VERIFIED.clear()  # verify every time, as a fresh process resuming would
        ckpt.load_checkpoint(engine, folder)

    def evict(folder):
        """Drop the files from the page cache (clean pages: DCP fsyncs), as on a node that did not
        write them: a resume after a restart elsewhere, or hours later."""
        if ctx.is_main:
            for file in Path(folder).rglob("*"):
                if file.is_file():
                    fd = os.open(file, os.O_RDONLY)
                    os.fsync(fd)
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                    os.close(fd)
        dist.barrier()

    for repeat in range(args.repeats):
        # Alternate the order so background load and the disk's moods hit both sides alike.
        order = ("ours", "raw") if repeat % 2 == 0 else ("raw", "ours")
        ours_folder = root / "ours" / f"step-{repeat + 1}"
        for kind in order:
            if kind == "ours":
                # A new step each time and no pruning: deleting the last one is not part of a save.
                if ctx.is_main:
                    shutil.rmtree(root / "ours", ignore_errors=True)
                dist.barrier()
                timed("ours_save", lambda: ckpt.save_checkpoint(engine, root / "ours", repeat + 1, Position(), keep=0))
            else:
                if ctx.is_main:
                    shutil.rmtree(root / "raw", ignore_errors=True)
                    (root / "raw").mkdir(parents=True)
                dist.barrier()
                timed("raw_save", lambda: raw_save(root / "raw"))
        # Both loads read the same files (raw DCP reads our checkpoint's dcp/ folder, which is a
        # plain DCP checkpoint): on this VM a file's first read from the virtual disk is ~2x slower
        # than later ones (the host caches it), which would otherwise decide the cold comparison.
        for cache in ("warm", "cold"):
            for kind in order:
                if cache == "cold":
                    evict(ours_folder)
                timed(f"{kind}_load_{cache}", lambda: ours_load(ours_folder) if kind == "ours" else raw_load(ours_folder))
    size = sum(p.stat().st_size for p in (root / "raw" / "dcp").rglob("*") if p.is_file())
    if ctx.is_main:
        Path(args.result).write_text(json.dumps({"times": results, "bytes": size, "world_size": ctx.world_size}))
    dist.barrier()
    dist.destroy_process_group()


def steps_worker(args) -> None:
    """Every rank: the same training steps three times (no saving, a blocking save every N steps, an
    asynchronous one), each save through the Saver the loop uses. Per regime: the wall time of all
    steps including what the saves block, and the loop's per-step all-reduce of the writing flag."""
    import torch
    import torch.distributed as dist

    from shardfit import engines
    from shardfit.data import Position
    from shardfit.engines.base import init_distributed
    from shardfit.engines.dcp_io import close_async_writer
    from shardfit.spec.models import load_model_spec
    from shardfit.spec.plan import plan_from_dict
    from shardfit.train.loop import build_model, settle_garbage_collector
    from shardfit.train.saver import Saver

    torch.set_num_threads(1)
    ctx = init_distributed()
    plan = plan_from_dict({"model": str(args.config), "strategy": {"kind": "fsdp2"},
                           "training": {"micro_batch": 1, "seq_len": 64, "precision": "fp32"},
                           "cluster": {"gpus_per_node": ctx.world_size}}, resolve_model=load_model_spec)
    engine = engines.setup(plan, build_model(plan), ctx)
    ids = torch.randint(0, 32000, (1, 64))
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids}
    settle_garbage_collector()
    root = Path(args.dir)

    def run(mode: str | None, steps: int, label: str) -> float:
        saver = Saver(engine, root / label, keep=1, mode=mode or "sync")
        dist.barrier()
        start = time.perf_counter()
        for step in range(1, steps + 1):
            engine.forward_backward(batch, True)
            flag = torch.tensor([float(saver.writing())], dtype=torch.float64)
            dist.all_reduce(flag)  # the loop's loss all-reduce carries this; here it is on its own
            engine.step()
            if saver.pending is not None and float(flag) == 0:
                saver.finish()
            # Steady state: a save after steps 1, N+1, 2N+1, ... so each of the run's S/N saves has N
            # steps to overlap, as in a long run (saving at N, 2N, ..., S would leave the last write
            # with no step to hide behind, a cost of ending the run rather than of saving every N).
            if mode is not None and (step - 1) % args.save_every == 0:
                saver.save(step, Position())
        saver.close()  # as the loop ends a run: the write in flight published, retention's deletion done
        dist.barrier()
        return time.perf_counter() - start

    run("async", args.save_every, "warm-up")  # starts the writer processes (spawned once per rank)
    run(None, 2, "warm-up-steps")
    times = {"none": [], "sync": [], "async": []}
    for repeat in range(args.repeats):
        order = ("none", "sync", "async") if repeat % 2 == 0 else ("async", "sync", "none")
        for mode in order:
            times[mode].append(run(None if mode == "none" else mode, args.steps, f"{mode}-{repeat}"))
            if ctx.is_main:
                shutil.rmtree(root / f"{mode}-{repeat}", ignore_errors=True)
    close_async_writer()
    if ctx.is_main:
        Path(args.result).write_text(json.dumps({"times": times, "world_size": ctx.world_size}))
    dist.barrier()
    dist.destroy_process_group()


def export_probe(args) -> None:
    """A fresh process: consolidate, report peak RSS growth (KiB on Linux) over the imports."""
    import safetensors.torch  # noqa: F401 - imports are not consolidation: load them before the baseline
    import torch.distributed.checkpoint  # noqa: F401

    from shardfit.train.export import export_checkpoint

    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    export_checkpoint(Path(args.checkpoint), Path(args.out), max_shard_bytes=args.shard_bytes)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    print(json.dumps({"base_kib": base, "peak_kib": peak}))


def _largest_tensor_bytes(checkpoint: Path) -> int:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    meta = dcp.FileSystemReader(str(checkpoint / "dcp")).read_metadata()
    largest = 0
    for key, item in meta.state_dict_metadata.items():
        if key.startswith("model.") and isinstance(item, TensorStorageMetadata):
            largest = max(largest, math.prod(item.size) * item.properties.dtype.itemsize)
    return largest


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--shard-mb", type=float, default=32.0, help="export shard size (MiB)")
    parser.add_argument("--steps", type=int, default=24, help="training steps per step-time regime")
    parser.add_argument("--save-every", type=int, default=8, dest="save_every")
    parser.add_argument("--only-steps", action="store_true", help="only the step-time comparison")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--steps-worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--export-probe", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--config", help=argparse.SUPPRESS)
    parser.add_argument("--dir", help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    parser.add_argument("--checkpoint", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    parser.add_argument("--shard-bytes", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return 0
    if args.steps_worker:
        steps_worker(args)
        return 0
    if args.export_probe:
        export_probe(args)
        return 0

    import torch

    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    steps = step_times(args, env)
    if args.only_steps:
        print(steps)
        return 0
    with tempfile.TemporaryDirectory(prefix="bench-ckpt-") as tmp:
        tmp = Path(tmp)
        (tmp / "config").mkdir()
        (tmp / "config" / "config.json").write_text(json.dumps(_config(args.layers, args.hidden)))
        started = time.perf_counter()
        subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2", "--standalone", __file__,
                        "--worker", "--config", str(tmp / "config"), "--dir", str(tmp / "ckpt"),
                        "--result", str(tmp / "result.json"), "--repeats", str(args.repeats)],
                       check=True, env=env, cwd=REPO)
        result = json.loads((tmp / "result.json").read_text())
        checkpoint = tmp / "ckpt" / "ours" / f"step-{args.repeats}"
        shard_bytes = int(args.shard_mb * 2**20)
        probe = subprocess.run([sys.executable, __file__, "--export-probe", "--checkpoint", str(checkpoint),
                                "--out", str(tmp / "hf"), "--shard-bytes", str(shard_bytes)],
                               check=True, env=env, cwd=REPO, capture_output=True, text=True)
        memory = json.loads(probe.stdout.strip().splitlines()[-1])
        largest = _largest_tensor_bytes(checkpoint)
        exported = sum(p.stat().st_size for p in (tmp / "hf").glob("*.safetensors"))
        wall = time.perf_counter() - started

    times, size = result["times"], result["bytes"]
    best = {k: min(v) for k, v in times.items()}  # best of N: the least disturbed by other load
    median = {k: statistics.median(v) for k, v in times.items()}  # and the typical run, on a shared machine
    mb = size / 2**20
    growth = (memory["peak_kib"] - memory["base_kib"]) * 1024
    bound = largest + shard_bytes
    print(f"# Checkpoint benchmark\n\n{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; {platform.node()}, "
          f"{os.cpu_count()} CPUs, {platform.python_version()}, torch {torch.__version__}; FSDP2, "
          f"{result['world_size']} ranks (gloo, CPU), llama {args.layers} layers x {args.hidden}, fp32 + AdamW state: "
          f"{mb:.0f} MiB per checkpoint; best of {args.repeats}; wall {wall:.0f} s\n")
    print("| | ours (DCP + XXH3 manifest), best | raw DCP, best | ratio (raw time / ours), best | ratio, medians |")
    print("|---|---|---|---|---|")
    rows = (("save (checksums taken while DCP writes)", "ours_save", "raw_save"),
            ("load, page cache warm (every checksum verified)", "ours_load_warm", "raw_load_warm"),
            ("load, page cache cold (every checksum verified)", "ours_load_cold", "raw_load_cold"))
    for label, ours_key, raw_key in rows:
        ours, raw = best[ours_key], best[raw_key]
        print(f"| {label} | {ours:.2f} s ({mb / ours:.0f} MiB/s) | {raw:.2f} s ({mb / raw:.0f} MiB/s) | {raw / ours:.2f} "
              f"| {median[raw_key] / median[ours_key]:.2f} |")
    print(f"\nConsolidation (`shardfit export`, {exported / 2**20:.0f} MiB of safetensors in {args.shard_mb:g} MiB "
          f"shards): peak RSS growth {growth / 2**20:.0f} MiB; largest tensor {largest / 2**20:.0f} MiB + one shard "
          f"{shard_bytes / 2**20:.0f} MiB = {bound / 2**20:.0f} MiB; ratio {growth / bound:.2f}")
    print("\n" + steps)
    return 0


def step_times(args, env) -> str:
    """The step-time comparison as a markdown table (its own torchrun job)."""
    with tempfile.TemporaryDirectory(prefix="bench-steps-") as tmp:
        tmp = Path(tmp)
        (tmp / "config").mkdir()
        (tmp / "config" / "config.json").write_text(json.dumps(_config(args.layers, args.hidden)))
        subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2", "--standalone", __file__,
                        "--steps-worker", "--config", str(tmp / "config"), "--dir", str(tmp / "ckpt"),
                        "--result", str(tmp / "steps.json"), "--repeats", str(args.repeats), "--steps",
                        str(args.steps), "--save-every", str(args.save_every)], check=True, env=env, cwd=REPO)
        result = json.loads((tmp / "steps.json").read_text())
    times = result["times"]
    best = {k: min(v) / args.steps for k, v in times.items()}
    median = {k: statistics.median(v) / args.steps for k, v in times.items()}
    lines = [f"Step time while saving every {args.save_every} steps ({args.steps} steps per run, FSDP2, "
             f"{result['world_size']} ranks, best and median of {args.repeats}); ratio = step time without saving / "
             "with (1.00: saving costs nothing):\n",
             "| saving | step, best | step, median | ratio, best | ratio, medians |", "|---|---|---|---|---|"]
    for mode, label in (("none", "none"), ("sync", "blocking (save_mode sync)"), ("async", "asynchronous (save_mode async)")):
        lines.append(f"| {label} | {best[mode] * 1e3:.0f} ms | {median[mode] * 1e3:.0f} ms | "
                     f"{best['none'] / best[mode]:.2f} | {median['none'] / median[mode]:.2f} |")
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
