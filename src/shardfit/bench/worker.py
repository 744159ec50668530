"""The bench's torchrun worker.

    torchrun --nproc-per-node 2 -m shardfit.bench.worker --plan P.json --out R.json --ckpt DIR
    torchrun --nproc-per-node 2 -m shardfit.bench.worker --verify JOBS.json
    torchrun --nproc-per-node 2 -m shardfit.bench.worker --jobs JOBS.json --warmup 2 --steps 3

Training (one strategy per job): `warmup + steps` steps; the last warm-up step is
instrumented: memory by phase and category (shardfit.measure) and collectives by kind and phase
(bench.comm); the others are timed without instruments. Then it saves a checkpoint, takes one more
step, and keeps the state at the save and after that step as the reference.
Verification (a FRESH process, never the one that saved): for each job, build the engine from
scratch, load the checkpoint, compare model / optimizer / scheduler / step bit for bit with the
reference, take the same extra step and compare loss and state again.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import traceback
from pathlib import Path

from shardfit import engines
from shardfit.bench.batches import Batches
from shardfit.bench.comm import CommCounter
from shardfit.bench.probe import compare, fingerprint, summarize_memory
from shardfit.data.sampler import Position
from shardfit.measure.api import profile
from shardfit.measure.oom import diagnose, worst_rank_diagnosis
from shardfit.measure.report import gather
from shardfit.runtime_env import leave
from shardfit.spec.gpus import get_gpu
from shardfit.spec.plan import is_deepspeed_kind, plan_from_dict

OOM_EXIT = 3  # the orchestrator reads this exit code as "out of memory" (budget exceeded)


def _args(argv):
    p = argparse.ArgumentParser(prog="shardfit.bench.worker")
    p.add_argument("--plan")
    p.add_argument("--out")
    p.add_argument("--ckpt")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--budget-bytes", type=int, default=0)
    p.add_argument("--verify", metavar="JOBS.json",
                   help='check checkpoints instead of training: a JSON list of {"plan", "ckpt", "out"}')
    p.add_argument("--no-checkpoint", action="store_true", help="skip the checkpoint round trip")
    p.add_argument("--jobs", metavar="JOBS.json",
                   help='train many plans in this one process, no checkpoints: a JSON list of {"plan", "out", '
                        '"budget_bytes"} (a grid of small plans, where process start would dominate)')
    return p.parse_args(argv)


def _load_plan(path: str):
    return plan_from_dict(json.loads(Path(path).read_text()))


def _engine(plan, ctx):
    """The plan's model on shardfit.engines, built on CPU with the plan's seed (same weights
    everywhere)."""
    from shardfit.train.loop import build_model

    return engines.setup(plan, build_model(plan), ctx)


def _step(engine, micro_batches, comm=None):
    """One optimizer step over its micro-batches (gradients synchronised on the last). With a CommCounter, collectives are labelled forward until the autograd
    engine runs, backward from then on, optimizer from the optimizer step (DeepSpeed steps inside
    forward_backward: its engine.step is wrapped for the label)."""
    deepspeed = is_deepspeed_kind(engine.kind)
    if comm is not None:
        comm.phase = "forward"
        comm.follow_backward = True
        if deepspeed:
            ds, original = engine.model, engine.model.step
            previous = ds.__dict__.get("step")  # shardfit.profile may have wrapped it already

            def labelled_step(*args, **kwargs):
                comm.phase, comm.follow_backward = "optimizer", False
                return original(*args, **kwargs)

            ds.step = labelled_step
    try:
        losses = [engine.forward_backward(batch, i == len(micro_batches) - 1) for i, batch in enumerate(micro_batches)]
        loss = sum(losses) / len(losses)
        if comm is not None:
            comm.phase, comm.follow_backward = "optimizer", False
        if not deepspeed:
            engine.step()
    finally:
        if comm is not None and deepspeed:
            if previous is None:
                del ds.step  # back to the class method
            else:
                ds.step = previous
    return loss.detach().float()


class PeakOverBudget(RuntimeError):
    """The measured peak went over --budget-bytes: reported as out of memory. (Not the tracker's
    BudgetExceeded, raised mid-step by an allocation: this one is found after the step, from the
    peaks gathered over the ranks.)"""


def _sync(device):
    if device.type == "cuda":
        import torch

        torch.cuda.synchronize()


def _spread(values: list[float]) -> dict:
    ordered = sorted(values)
    q = statistics.quantiles(ordered, n=4) if len(ordered) >= 2 else [ordered[0]] * 3
    return {"median": statistics.median(ordered), "min": ordered[0], "max": ordered[-1],
            "iqr": q[2] - q[0], "all": values}


def _dir_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def _measured_step(engine, micro_batches, plan, budget: int):
    """The instrumented step: shardfit.profile (bytes by phase x category, gathered over ranks)
    and the CommCounter (collectives by kind and phase), both dispatch modes, both on one step."""
    prof = profile(engine.model, engine.optimizer, plan=plan, budget_bytes=budget or None,
                            explain_oom=False, label=plan.strategy.label)
    import torch

    with CommCounter() as counter:
        try:
            with prof:
                loss = _step(engine, micro_batches, counter)
        except torch.OutOfMemoryError as exc:
            # This rank's diagnosis, as `shardfit profile` gives it (no collective after an OOM):
            # run_strategy keeps the worst rank's of those the failing ranks wrote.

            exc.diagnosis = diagnose(prof.report(), plan)
            raise
    gathered = gather(prof.report(), everywhere=True)
    phases = {p: dict(c) for p, c in gathered.phases.items() if p in ("forward", "backward", "optimizer")}
    return loss, phases, gathered, counter.summary()


def train(args, plan, ctx) -> dict:
    import torch
    import torch.distributed as dist

    device, world = ctx.device, ctx.world_size
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    engine = _engine(plan, ctx)
    batches = Batches(plan, ctx.rank, world)
    total = args.warmup + args.steps
    instrumented = max(0, args.warmup - 1)  # the last warm-up step: step 0 pays lazy initialisation
    losses, times, cpu_times, memory, comm = [], [], [], None, None
    accum = plan.training.grad_accum
    for step in range(total):
        batch = batches.step(step, accum)
        if step == instrumented:
            # --jobs checks the budget after the step, on the gathered peaks: every rank then stops
            # together, and the process can go on to the next job.
            after = getattr(args, "budget_after_step", False)
            loss, phases, gathered, comm = _measured_step(engine, batch, plan, 0 if after else args.budget_bytes)
            memory = summarize_memory(phases)
            memory.update(source="shardfit.measure (worst rank per phase and category)",
                          per_rank_peak_bytes=gathered.peak_by_rank(),
                          host_bytes=max(cats.get("host", 0) for cats in gathered.phases.values()))
            ooms = gathered.ooms
            if after and args.budget_bytes and max(gathered.peak_by_rank()) > args.budget_bytes:
                raise PeakOverBudget(f"over the {args.budget_bytes} B budget: measured peak "
                                     f"{max(gathered.peak_by_rank())} B per rank")
            if ooms:
                error = PeakOverBudget(f"over the {args.budget_bytes} B budget on rank {ooms[0]['rank']} "
                                       f"in {ooms[0].get('phase')}: {ooms[0].get('message', '')}")
                error.diagnosis = worst_rank_diagnosis(gathered.ranks, plan)  # what `shardfit profile` says
                raise error
            losses.append(float(loss))
            continue
        _sync(device)
        start, cpu_start = time.perf_counter(), time.process_time()
        value = float(_step(engine, batch))  # float() waits for the step to finish
        _sync(device)
        if step >= args.warmup:
            times.append(time.perf_counter() - start)
            # CPU seconds of this rank's process (every thread): on a CPU shared with other work, what the
            # step cost, whatever else ran meanwhile; waits for the other rank are not in it.
            cpu_times.append(time.process_time() - cpu_start)
        losses.append(value)
    mean_losses = torch.tensor(losses, dtype=torch.float64, device=device)
    dist.all_reduce(mean_losses)
    mean_losses = (mean_losses / world).tolist()
    comm_by_rank = [None] * world
    dist.all_gather_object(comm_by_rank, comm["bytes"])
    cuda = _cuda_memory(device)

    median = statistics.median(times) if times else None
    tokens = plan.training.micro_batch * plan.training.seq_len * accum * world
    result = {
        "strategy": plan.strategy.label, "status": "ok", "engine": f"shardfit.engines ({engine.kind})",
        "world_size": world, "device": device.type,
        "steps": {"warmup": args.warmup, "measured": args.steps, "instrumented_step": instrumented},
        "step_time_s": _spread(times) if times else None,
        "step_cpu_s": _spread(cpu_times) if cpu_times else None,
        "tokens_per_step": tokens,
        "tokens_per_s": tokens / median if median else None,
        "mfu": _mfu(plan, tokens / median, world) if device.type == "cuda" and median else None,
        "memory": {**memory, "cuda": cuda},
        "comm": {**comm, "per_rank_bytes": comm_by_rank},
        "loss": {"curve": mean_losses, "final": mean_losses[-1], "k": len(mean_losses)},
        "checkpoint": None,
    }
    if not args.no_checkpoint:
        result["checkpoint"] = _save_with_reference(args, plan, ctx, engine, batches, total)
    return result


def _save_with_reference(args, plan, ctx, engine, batches, total: int) -> dict:
    """Save, then keep what the resumed process must reproduce: the state right after the save,
    and the loss and state after one more step."""
    import torch
    import torch.distributed as dist

    from shardfit.train.saver import save_checkpoint

    world = ctx.world_size
    root = Path(args.ckpt)
    start = time.perf_counter()
    per_step = world * plan.training.micro_batch * plan.training.grad_accum
    path = save_checkpoint(engine, root, total, Position(consumed=total * per_step), keep=1)
    save_s = time.perf_counter() - start
    size = _dir_bytes(path) if ctx.is_main else 0
    before = fingerprint(engine)
    next_loss = float(_step(engine, batches.step(total, plan.training.grad_accum)))
    after = fingerprint(engine)
    reference = root / "reference"
    reference.mkdir(parents=True, exist_ok=True)
    torch.save({"before": before, "after": after, "next_loss": next_loss, "step": total, "path": str(path)},
               reference / f"rank{ctx.rank}.pt")
    dist.barrier()
    return {"save_s": save_s, "bytes": size, "step": total, "path": str(path)}


def _cuda_memory(device) -> dict | None:
    if device.type != "cuda":
        return None
    import torch

    return {"max_allocated": torch.cuda.max_memory_allocated(), "max_reserved": torch.cuda.max_memory_reserved(),
            "allocated": torch.cuda.memory_allocated(), "reserved": torch.cuda.memory_reserved()}


def _mfu(plan, tokens_per_s: float, world: int) -> float:
    """Model FLOPs utilisation: 6·N FLOPs per token (forward + backward) over the GPUs' bf16 peak."""
    peak = get_gpu(plan.cluster.gpu).bf16_tflops * 1e12 * world
    return 6 * plan.model.n_params * tokens_per_s / peak


def verify(plan, ckpt: str, ctx) -> dict:
    """In a fresh process: load, compare with the state the training job kept, step once more."""
    import torch
    import torch.distributed as dist

    from shardfit.train.checkpoint import load_checkpoint

    root = Path(ckpt)
    ref = torch.load(root / "reference" / f"rank{ctx.rank}.pt", weights_only=False)
    engine = _engine(plan, ctx)
    dist.barrier()
    start = time.perf_counter()
    step, _ = load_checkpoint(engine, Path(ref["path"]))
    load_s = time.perf_counter() - start
    # NOTE: DeepSpeed ZeRO-1/2 cannot read optimizer state between load_checkpoint and the first
    # step (its lazy state desynchronises the collectives); it is compared after the next step.
    read_opt = plan.strategy.kind not in ("zero1", "zero2")
    loaded = fingerprint(engine, read_optimizer=read_opt)
    at_load = {"model": compare(ref["before"], loaded, "model."),
               "optimizer": compare(ref["before"], loaded, "optim.") if read_opt else None,
               "scheduler": compare(ref["before"], loaded, "sched.")}
    next_loss = float(_step(engine, Batches(plan, ctx.rank, ctx.world_size).step(step, plan.training.grad_accum)))
    after = fingerprint(engine)
    after_step = {part: compare(ref["after"], after, f"{part[:5]}.") for part in ("model", "optim", "sched")}
    checks = {"model": at_load["model"]["equal"],
              "optimizer": at_load["optimizer"] is None or at_load["optimizer"]["equal"],
              "scheduler": at_load["scheduler"]["equal"] and after_step["sched"]["equal"],
              "step": step == ref["step"], "next_loss": next_loss == ref["next_loss"],
              "model_after_step": after_step["model"]["equal"],
              "optimizer_after_step": after_step["optim"]["equal"]}
    gathered = [None] * ctx.world_size
    dist.all_gather_object(gathered, (checks, max(v["max_abs_diff"] for v in after_step.values())))
    restored = {key: all(g[0][key] for g in gathered) for key in checks}
    return {"strategy": plan.strategy.label, "load_s": load_s, "restored": restored,
            "exact": all(restored.values()),
            # The loaded state is the saved one bit for bit; the resumed step can still differ when
            # an optimizer is not bit-reproducible across processes (measured: DeepSpeed CPU Adam).
            "exact_at_load": all(restored[k] for k in ("model", "optimizer", "scheduler", "step")),
            "resumed_step_max_abs_diff": max(g[1] for g in gathered),
            "details": {"at_load": at_load, "after_step": after_step, "next_loss": [next_loss, ref["next_loss"]]}}


def _guarded(run, label: str) -> tuple[dict, int]:
    """(result, exit code): a failure becomes a result; out of memory has its own code."""
    import torch

    try:
        return run(), 0
    except (PeakOverBudget, torch.OutOfMemoryError) as exc:
        diagnosis = getattr(exc, "diagnosis", None)
        return {"strategy": label, "status": "oom", "error": str(exc).splitlines()[0][:500],
                **({"diagnosis": diagnosis.to_dict()} if diagnosis is not None else {})}, OOM_EXIT
    except Exception as exc:  # noqa: BLE001 - one strategy failing must become a reported result
        traceback.print_exc()
        return {"strategy": label, "status": "failed", "error": f"{type(exc).__name__}: {exc}".splitlines()[0][:500]}, 1


def _write(result: dict, out: str, rank: int, failed: bool) -> None:
    """Rank 0 writes OUT; a rank that failed alone writes OUT.rankN so the error is not lost."""
    if rank == 0 or failed:
        target = Path(out) if rank == 0 else Path(out).with_name(f"{Path(out).stem}.rank{rank}{Path(out).suffix}")
        target.write_text(json.dumps(result, indent=1))


def _train_jobs(args, ctx) -> int:
    """Each job trains like a bench row (no checkpoint). The budget is checked after the instrumented
    step on the gathered peaks, so an over-budget job stops every rank at once and the next job
    runs. A failure ends the process: one rank may have stopped mid-step while the other waits in a
    collective, and only torchrun ending the job frees it; the caller relaunches with the jobs left."""
    import copy
    import gc

    import torch.distributed as dist

    for job in json.loads(Path(args.jobs).read_text()):
        plan = _load_plan(job["plan"])
        job_args = copy.copy(args)
        job_args.budget_bytes, job_args.no_checkpoint = int(job.get("budget_bytes") or 0), True
        job_args.budget_after_step = True
        result, code = _guarded(lambda: train(job_args, plan, ctx), plan.strategy.label)
        _write(result, job["out"], ctx.rank, code not in (0, OOM_EXIT))
        gc.collect()
        if code not in (0, OOM_EXIT):
            return code
        dist.barrier()
    return 0


def main(argv=None) -> int:
    args = _args(sys.argv[1:] if argv is None else argv)
    import gc

    import torch
    import torch.distributed as dist

    from shardfit.engines.base import init_distributed

    ctx = init_distributed()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    if args.verify:
        # NOTE: several checkpoints, one process: each is loaded by an engine built from scratch in
        # a process that never saw the training, which is what a resume is; one torchrun job
        # instead of one per strategy saves most of the bench's start-up time.
        code = 0
        for job in json.loads(Path(args.verify).read_text()):
            plan = _load_plan(job["plan"])
            result, code = _guarded(lambda: verify(plan, job["ckpt"], ctx), plan.strategy.label)
            _write(result, job["out"], ctx.rank, code != 0)
            gc.collect()
            if code:
                return code  # a rank may be stuck in a collective: let torchrun end the job
            dist.barrier()
    elif args.jobs:
        code = _train_jobs(args, ctx)
    else:
        plan = _load_plan(args.plan)
        result, code = _guarded(lambda: train(args, plan, ctx), plan.strategy.label)
        _write(result, args.out, ctx.rank, code != 0)
    if code == 0:
        dist.destroy_process_group()
    return code


if __name__ == "__main__":
    status = main()
    # Without the interpreter's teardown: gloo can abort a finished rank there (SIGABRT after its result
    # was written, which bench would report as a failed strategy).
    leave(status)
