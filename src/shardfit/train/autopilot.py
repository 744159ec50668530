"""`shardfit train --autopilot`: an out-of-memory step changes the plan instead of killing the run.

On OOM the rank that ran out releases what it holds, asks the estimator for the next change that
fits, records the decision (OUT/autopilot/decision-N.json, and the new Plan in OUT/plan.yaml), and
leaves with EXIT_RETRY. torchrun (started with restarts by `shardfit train --autopilot`) then stops
every other rank and restarts them all; each applies the recorded decisions to its Plan and resumes
from the newest intact checkpoint (or from step 0), so the failed step is retried with the new plan
and its partial gradients are gone with the processes that held them.

NOTE: why restart the ranks rather than carry on in-process after an all_reduce of an "OOM" flag:
an OOM strikes wherever an allocation fails, usually inside forward/backward, while the other ranks
are already in (or past) the collectives of that step: DDP's bucket all-reduces, FSDP's all-gathers,
DeepSpeed's reduce-scatters. A flag all-reduce from the failed rank then pairs with one of those
(gloo: a size-mismatch error; NCCL: a hang), and the process group is out of step for good. Ending
the processes is the one recovery that works for every engine and every OOM point; torchrun makes
it collective (the agent stops every rank of the group when one fails), and the restart also
re-creates the engine when the strategy changed, which an in-process retry would have to do anyway.

Order of changes (each is tried only if the current plan allows it, and the first one the
estimator says fits is taken; if none fits, the least disruptive is taken and the next OOM moves on):
  1. halve the micro-batch, double accumulation (same global batch, same math)
  2. activation checkpointing on every block
  3. the next sharding level: single -> fsdp2+offload (one GPU), ddp -> fsdp2, fsdp:shard_grad_op -> fsdp:full_shard, zero1 -> zero2 -> zero3
  4. offload the optimizer (DeepSpeed) / parameters, gradients and optimizer (FSDP)
"""
from __future__ import annotations

import json
import os
import sys
import time
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path

from shardfit.errors import ShardfitError
from shardfit.estimate.estimator import estimate
from shardfit.measure.api import profile
from shardfit.spec.plan import validate_plan
from shardfit.spec.planfile import dump_plan
from shardfit.spec.sizes import parse_size

EXIT_RETRY = 75  # EX_TEMPFAIL: "try again"
DEFAULT_RESTARTS = 4
FOLDER = "autopilot"
BUDGET_ENV = "SHARDFIT_MEMORY_BUDGET"


@dataclass(frozen=True)
class Decision:
    change: str
    changes: dict
    reason: str
    peak_before: int | None
    peak_after: int | None
    fits: bool | None

    def to_dict(self) -> dict:
        return dict(self.__dict__)


def candidates(plan) -> list[tuple[str, dict]]:
    """The changes autopilot may make to `plan`, in the order it prefers them."""
    t, s = plan.training, plan.strategy
    out = []
    if t.micro_batch > 1:
        out.append((f"micro-batch {t.micro_batch} -> {t.micro_batch // 2}, accumulation {t.grad_accum} -> {t.grad_accum * 2}",
                    {"training": {"micro_batch": t.micro_batch // 2, "grad_accum": t.grad_accum * 2}}))
    if str(t.activation_checkpointing).strip().lower() not in ("full", "on", "true", "all", "1", "every-1"):
        out.append(("activation checkpointing on every block", {"training": {"activation_checkpointing": "full"}}))
    # NOTE: the ladder stays within a checkpoint format (DCP for ddp/fsdp/fsdp2, DeepSpeed for zero*):
    # the restart resumes from the last checkpoint, which the next engine must be able to read.
    nxt = {"ddp": {"kind": "fsdp2"}, "zero1": {"kind": "zero2"}, "zero2": {"kind": "zero3"}}.get(s.kind)
    if s.kind == "fsdp" and s.sharding != "full_shard":
        nxt = {"sharding": "full_shard"}
    if s.kind == "fsdp2" and not s.reshard_after_forward:
        nxt = {"reshard_after_forward": True}
    if s.kind == "single":
        # One GPU has nothing to shard; fsdp2+offload moves every state to the host and reads DCP too.
        out.append(("offload parameters, gradients and optimizer to CPU (single -> fsdp2+offload)",
                    {"strategy": {"kind": "fsdp2", "offload_params": "cpu"}}))
    elif nxt is not None:
        out.append((f"sharding {s.label} -> {_label(plan, nxt)}", {"strategy": nxt}))
    elif s.is_deepspeed and not s.offload_optimizer:
        out.append(("offload the optimizer to CPU", {"strategy": {"offload_optimizer": "cpu"}}))
    elif s.kind in ("fsdp", "fsdp2") and not s.offload_params:
        out.append(("offload parameters, gradients and optimizer to CPU", {"strategy": {"offload_params": "cpu"}}))
    return out


def _label(plan, changes: dict) -> str:
    return plan.with_changes(strategy=changes).strategy.label


def _peak(plan, device: str) -> int:
    # device="cpu" estimates no CUDA context or NCCL, so the device peak is then the tensor peak.
    return int(estimate(plan, device=device).device_peak_bytes)


def choose(plan, budget_bytes: int | None, device: str = "cpu", reasons: str = "") -> tuple[Decision, object]:
    """The next change and the plan it gives. Raises ShardfitError when nothing is left to try."""
    try:
        before = _peak(plan, device)
    except ShardfitError:
        before = None
    tried = []
    for label, changes in candidates(plan):
        try:
            changed = plan.with_changes(**changes)
            validate_plan(changed)
            peak = _peak(changed, device)
        except ShardfitError as exc:
            tried.append((label, changes, None, f"not possible: {exc}"))
            continue
        fits = budget_bytes is None or peak <= budget_bytes
        tried.append((label, changes, peak, "fits" if fits else "still too big"))
        if fits:
            break
    usable = [t for t in tried if t[2] is not None]
    if not usable:
        raise ShardfitError("out of memory and autopilot has nothing left to change "
                            f"(strategy {plan.strategy.label}, micro-batch {plan.training.micro_batch}, "
                            f"activation checkpointing {plan.training.activation_checkpointing}): "
                            "use more GPUs or a bigger GPU (`shardfit fit` finds one)")
    chosen = next((t for t in usable if t[3] == "fits"), usable[0])
    label, changes, peak, verdict = chosen
    est = (f"estimated peak {before / 2**20:.1f} -> {peak / 2**20:.1f} MiB" if before is not None
           else f"estimated peak {peak / 2**20:.1f} MiB")
    limit = (f"for a budget of {budget_bytes / 2**20:.1f} MiB ({verdict})" if budget_bytes
             else "(no memory limit known here: the first change is taken)")
    reason = f"{reasons}{est} {limit}"
    if verdict != "fits":
        reason += "; no single change fits, taking the least disruptive one first"
    fits = verdict == "fits" if budget_bytes is not None else None
    return Decision(label, changes, reason, before, peak, fits), plan.with_changes(**changes)


# ---- recording and replaying decisions -------------------------------------------------------------
def decision_files(out_dir) -> list[Path]:
    folder = Path(out_dir) / FOLDER
    found = [p for p in folder.glob("decision-*.json") if p.stem[9:].isdigit()] if folder.is_dir() else []
    return sorted(found, key=lambda p: int(p.stem[9:]))


def forget(out_dir) -> None:
    """A fresh run (no resume) in an old folder: earlier decisions don't apply to it."""
    import shutil

    shutil.rmtree(Path(out_dir) / FOLDER, ignore_errors=True)


def apply_recorded(plan, out_dir) -> tuple[object, list[dict]]:
    """The plan with every recorded decision applied, in order (what a restart or resume trains)."""
    records = []
    for path in decision_files(out_dir):
        record = json.loads(path.read_text())
        plan = plan.with_changes(**record["changes"])
        records.append(record)
    return plan, records


def record(out_dir, index: int, decision: Decision, plan, step: int | None, rank: int, error: str) -> bool:
    """Write decision `index` unless another rank already did (the first writer wins); True if written."""
    folder = Path(out_dir) / FOLDER
    folder.mkdir(parents=True, exist_ok=True)
    data = {"index": index, "step": step, "rank": rank, "error": error[:300], "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            **decision.to_dict()}
    path = folder / f"decision-{index}.json"
    try:
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
    except FileExistsError:
        return False
    with os.fdopen(fd, "w") as handle:
        handle.write(json.dumps(data, indent=2) + "\n")
    dump_plan(plan, Path(out_dir) / "plan.yaml")
    return True


# ---- the memory budget (a CPU rehearsal of a GPU's limit) ------------------------------------------
def budget_bytes() -> int | None:
    text = os.environ.get(BUDGET_ENV)
    if not text:
        return None
    value = parse_size(text, "B", BUDGET_ENV)
    if value <= 0:
        raise ShardfitError(f"{BUDGET_ENV} must be a positive number of bytes, got {text}")
    return value


def memory_budget(plan):
    """Measure live tensor bytes against the budget (SHARDFIT_MEMORY_BUDGET): above it, torch's own
    OutOfMemoryError is raised, as a GPU would. Without a budget: nothing installed."""
    budget = budget_bytes()
    if budget is None:
        return nullcontext()
    return profile(plan=plan, budget_bytes=budget, explain_oom=False, label="autopilot")


def device_budget(ctx_device) -> tuple[int | None, str]:
    """(bytes, estimator device) the estimator's peak is compared with."""
    budget = budget_bytes()
    if budget is not None:
        return budget, "cpu"
    if getattr(ctx_device, "type", "cpu") == "cuda":
        import torch

        return int(torch.cuda.get_device_properties(ctx_device).total_memory), "cuda"
    return None, "cpu"


def release_memory(engine=None) -> None:
    """Drop what the failed step held: partial gradients, cached blocks."""
    import gc

    import torch

    if engine is not None:
        try:
            engine.zero_grad()
        except Exception:  # noqa: BLE001 - a half-finished step may leave the engine inconsistent
            pass
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def handle_oom(plan, out_dir, exc, rank: int, index: int, device=None, step: int | None = None) -> int:
    """Decide, record, log; returns the exit code the worker should leave with. `index` is the number
    of decisions this attempt started with: ranks that run out together write the same decision once."""
    release_memory(getattr(exc, "engine", None))
    budget, est_device = device_budget(device)
    first = str(exc).strip().strip("'\"").splitlines()[0] if str(exc).strip() else type(exc).__name__
    where = f" at step {step}" if step else ""
    try:
        decision, new_plan = choose(plan, budget, est_device, reasons=f"rank {rank} ran out of memory{where}: ")
    except ShardfitError as error:
        print(f"shardfit: error: {error}", file=sys.stderr, flush=True)
        return 2
    written = record(out_dir, index, decision, new_plan, step, rank, first)
    if written:
        print(f"autopilot: out of memory on rank {rank}{where} ({first}); change {index + 1}: {decision.change}. "
              f"Why: {decision.reason}. Restarting every rank from the last checkpoint; the new plan is "
              f"{Path(out_dir) / 'plan.yaml'}", file=sys.stderr, flush=True)
    return EXIT_RETRY
