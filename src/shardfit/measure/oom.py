"""Explain an out-of-memory error: where it struck, what dominated, the likely cause, and the
smallest changes that fit according to the estimator (`estimate(plan.with_changes(...))`)."""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

from shardfit.errors import ShardfitError
from shardfit.estimate.estimator import estimate
from shardfit.estimate.result import CATEGORIES
from shardfit.measure.cuda import cuda_stats
from shardfit.spec.gpus import get_gpu
from shardfit.spec.plan import validate_plan
from shardfit.units import fmt_bytes

# reserved ≫ allocated: the allocator holds memory it can't hand out in one piece.
_FRAGMENTATION_SHARE = 0.25


@dataclass(frozen=True, kw_only=True)
class Fix:
    change: str
    peak_bytes: int
    delta_bytes: int
    fits: bool
    flags: str = ""  # the same change as command-line flags of train / profile
    fields: str = ""  # ... and as plan fields

    def line(self) -> str:
        sign = "−" if self.delta_bytes < 0 else "+"
        verdict = "fits" if self.fits else "still too big"
        how = f" [{self.flags} | plan: {self.fields}]" if self.flags else ""
        return (f"{self.change}: {sign}{fmt_bytes(abs(self.delta_bytes))}, {verdict} (peak {fmt_bytes(self.peak_bytes)})"
                + how)


@dataclass(frozen=True, kw_only=True)
class Diagnosis:
    phase: str
    step: int
    rank: int
    dominant: str
    growing: str
    dominant_bytes: int
    live: dict
    limit_bytes: int | None
    cause: str
    fixes: tuple = ()
    notes: tuple = ()
    snapshot: str | None = None

    def to_dict(self) -> dict:
        return {"phase": self.phase, "step": self.step, "rank": self.rank, "dominant": self.dominant, "growing": self.growing,
                "dominant_bytes": self.dominant_bytes, "live": self.live, "limit_bytes": self.limit_bytes,
                "cause": self.cause, "fixes": [f.__dict__ for f in self.fixes], "notes": list(self.notes),
                "snapshot": self.snapshot}

    @classmethod
    def from_dict(cls, data: dict) -> "Diagnosis":
        data = dict(data)
        data["fixes"] = tuple(Fix(**f) for f in data.get("fixes", ()))
        data["notes"] = tuple(data.get("notes", ()))
        return cls(**data)

    @property
    def live_total(self) -> int:
        return sum(self.live.values())


def _cause(phase: str, step: int, live: dict, dominant: str, strategy, cuda: dict) -> str:
    """`dominant` here is what grew most during the phase (or the largest term if unknown)."""
    reserved, allocated = cuda.get("reserved", 0), cuda.get("allocated", 0)
    if reserved and reserved - allocated > _FRAGMENTATION_SHARE * reserved:
        return (f"fragmentation: the allocator reserves {fmt_bytes(reserved)} but only {fmt_bytes(allocated)} is "
                "allocated (reserved ≫ allocated); set PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True")
    states = live.get("params", 0) + live.get("grads", 0) + live.get("optimizer", 0)
    if phase == "load" or (phase == "optimizer" and step <= 1) or (
            dominant in ("params", "optimizer", "grads") and phase != "forward"):
        return (f"parameters + optimizer states{_size(states)} don't fit at {phase}: "
                "shard them (ZeRO / FSDP) or offload the optimizer")
    if phase == "checkpoint":
        return "saving gathers a full copy of the model: save sharded checkpoints (DCP / DeepSpeed) instead"
    shards = strategy is not None and strategy.shards_params
    if dominant == "temporaries" and (shards or phase == "forward"):
        return ("a gathered unit is too large under FSDP/ZeRO-3: wrap smaller units or lower the prefetch / "
                "live-parameter limits" if shards else
                f"temporaries{_size(live['temporaries'])} dominate in {phase}: buckets or the logits/loss")
    if phase == "forward" or dominant == "activations":
        return (f"activations{_size(live.get('activations', 0))} grow with micro-batch × sequence length "
                f"in {phase}: checkpoint activations or shorten the micro-batch")
    return f"{dominant} dominate in {phase}{_size(live.get(dominant, 0))}"


def _size(value: int) -> str:
    return f" ({fmt_bytes(value)})" if value else ""  # 0: not tracked (an OOM outside the tracker)


def candidate_changes(plan) -> list[tuple[str, dict]]:
    """Changes from least to most disruptive; each is a `plan.with_changes` argument."""
    t, s = plan.training, plan.strategy
    out = []
    if str(t.activation_checkpointing).lower() in ("none", "off", "false", "0"):
        out.append(("activation checkpointing", {"training": {"activation_checkpointing": "full"}}))
    if t.micro_batch > 1:
        out.append((f"micro-batch {t.micro_batch} → {t.micro_batch // 2} with accumulation ×2",
                    {"training": {"micro_batch": t.micro_batch // 2, "grad_accum": t.grad_accum * 2}}))
    if t.precision == "fp32":
        out.append(("bf16 mixed precision", {"training": {"precision": "bf16"}}))
    if s.kind == "single":
        # One GPU has nothing to shard: what is left is moving states to the host.
        out.append(("offload parameters, gradients and optimizer to CPU (fsdp2+offload)",
                    {"strategy": {"kind": "fsdp2", "offload_params": "cpu"}}))
    ladder = ["ddp", "zero1", "zero2", "zero3"]
    if s.kind in ladder[:-1]:
        for kind in ladder[ladder.index(s.kind) + 1:]:
            out.append((f"strategy {kind}", {"strategy": {"kind": kind}}))
    if s.kind == "fsdp" and s.sharding != "full_shard":
        out.append(("fsdp full_shard", {"strategy": {"sharding": "full_shard"}}))
    if s.kind == "zero3" and not s.offload_optimizer:
        out.append(("offload the optimizer to CPU", {"strategy": {"offload_optimizer": "cpu"}}))
    if s.kind in ("zero1", "zero2") and not s.offload_optimizer:
        out.append(("offload the optimizer to CPU", {"strategy": {"offload_optimizer": "cpu"}}))
    if s.kind in ("fsdp", "fsdp2") and not s.offload_params:
        out.append(("offload parameters, gradients and optimizer to CPU", {"strategy": {"offload_params": "cpu"}}))
    return out


# plan field -> the flag `shardfit train` / `shardfit profile` takes for it
_FLAGS = {"micro_batch": "--micro-batch", "grad_accum": "--grad-accum", "precision": "--precision",
          "activation_checkpointing": "--ac", "seq_len": "--seq"}


def how_to_apply(changes: dict, changed_plan) -> tuple[str, str]:
    """(flags, plan fields) of one change: `--ac full`, `training.activation_checkpointing: full`."""
    flags, fields = [], []
    for section, values in changes.items():
        for key, value in values.items():
            fields.append(f"{section}.{key}: {value}")
            if section == "training" and key in _FLAGS:
                flags.append(f"{_FLAGS[key]} {value}")
    if "strategy" in changes:
        flags.append(f"--strategy {changed_plan.strategy.label}")
    return " ".join(flags), ", ".join(fields)


def suggest_fixes(plan, limit_bytes: int, on_device: bool, max_fixes: int = 4,
                  candidates=None) -> tuple[list[Fix], list[str]]:
    """candidates: (label, changes) pairs to size instead of candidate_changes(plan)."""
    def peak(p):
        # On a CPU (a rehearsal under a budget) only tensor bytes exist: device="cpu" estimates no
        # CUDA context or NCCL, so its device peak is the tensor peak.
        return estimate(p, device="cuda" if on_device else "cpu").device_peak_bytes

    base = peak(plan)
    fixes, notes = [], []
    for label, changes in candidate_changes(plan) if candidates is None else candidates:
        try:
            changed = plan.with_changes(**changes)
            validate_plan(changed)
            new = peak(changed)
        except ShardfitError as exc:
            notes.append(f"{label}: not possible ({exc})")
            continue
        flags, fields = how_to_apply(changes, changed)
        fixes.append(Fix(change=label, peak_bytes=new, delta_bytes=new - base, fits=new <= limit_bytes, flags=flags,
                         fields=fields))
    fitting = [f for f in fixes if f.fits]
    shown = fitting[:max_fixes] if fitting else sorted(fixes, key=lambda f: f.peak_bytes)[:2]
    if not fitting:
        notes.append("no single change fits: combine them (`shardfit fit` searches combinations)")
    return shown, notes


def diagnose(report, plan=None, candidates=None) -> Diagnosis | None:
    """report: a RankReport whose `oom` is set (or None -> None). candidates: see suggest_fixes."""
    oom = getattr(report, "oom", None)
    if not oom:
        return None
    live = {c: int(oom.get("breakdown", {}).get(c, 0)) for c in CATEGORIES}
    dominant = max(CATEGORIES, key=lambda c: live[c])
    grown = oom.get("grown") or {}
    growing = max(CATEGORIES, key=lambda c: grown.get(c, 0)) if any(v > 0 for v in grown.values()) else dominant
    if oom.get("untracked"):  # no categories: what usually grows in that phase
        growing = {"load": "params", "optimizer": "optimizer", "checkpoint": "temporaries"}.get(oom["phase"], "activations")
    limit = oom.get("budget")
    cuda = oom.get("cuda") or {}
    on_device = bool(cuda)
    if limit is None and cuda:
        limit = cuda.get("device_total")
    if limit is None and plan is not None:
        gpu = get_gpu(plan.cluster.gpu)
        limit = int(getattr(gpu, "memory_bytes", 0) or getattr(gpu, "memory_gib", 0) * 2**30) or None
        on_device = True
    strategy = plan.strategy if plan is not None else None
    cause = _cause(oom["phase"], oom.get("step", 0), live, growing, strategy, cuda)
    fixes, notes = ([], ["no plan given: pass plan= to profile() for sized fixes"])
    if plan is not None and limit:
        fixes, notes = suggest_fixes(plan, limit, on_device, candidates=candidates)
    return Diagnosis(phase=oom["phase"], step=oom.get("step", 0), rank=report.rank, dominant=dominant, growing=growing,
                     dominant_bytes=live[dominant], live=live, limit_bytes=limit, cause=cause, fixes=tuple(fixes),
                     notes=tuple(notes), snapshot=oom.get("snapshot"))


def format_diagnosis(diagnosis: Diagnosis | None) -> str:
    if diagnosis is None:
        return "no out-of-memory error was recorded"
    d = diagnosis
    live_total = sum(d.live.values())
    if live_total:
        lines = [f"OUT OF MEMORY on rank {d.rank} in {d.phase} (step {d.step}): {fmt_bytes(live_total)} live"
                 + (f" of {fmt_bytes(d.limit_bytes)}" if d.limit_bytes else ""),
                 f"  largest: {d.dominant} {fmt_bytes(d.dominant_bytes)}; grew most in {d.phase}: {d.growing} ("
                 + ", ".join(f"{c} {fmt_bytes(v)}" for c, v in d.live.items() if v) + ")"]
    else:
        lines = [f"OUT OF MEMORY on rank {d.rank} in {d.phase} (step {d.step})"
                 + (f" of {fmt_bytes(d.limit_bytes)}" if d.limit_bytes else ""),
                 "  by category: not tracked in this run (rehearse it with --memory-budget SIZE to see what grew)"]
    lines.append(f"  likely cause: {d.cause}")
    if d.fixes:
        lines.append("  smallest changes (estimator):")
        lines += [f"    - {fix.line()}" for fix in d.fixes]
    lines += [f"  note: {note}" for note in d.notes]
    if d.snapshot:
        lines.append(f"  memory snapshot: {d.snapshot} (open at https://pytorch.org/memory_viz)")
    return "\n".join(lines)


def worst_rank_diagnosis(reports, plan=None) -> Diagnosis | None:
    """The diagnosis of the rank that ran out with the most bytes live (what must shrink to fit);
    None when no rank ran out. `reports`: RankReports (a GatheredReport's ranks)."""
    struck = [r for r in reports if getattr(r, "oom", None)]
    if not struck:
        return None
    worst = max(struck, key=lambda r: (sum(int(v) for v in (r.oom.get("breakdown") or {}).values()), -r.rank))
    return diagnose(worst, plan)


OOM_FOLDER = "oom"
DIAGNOSIS_FILE = "oom-diagnosis.txt"


def write_rank_diagnosis(diagnosis: Diagnosis, run_dir) -> Path:
    """RUN/oom/rank-N.json: each rank that ran out writes its own (no collective is safe after an OOM);
    `collect_run_diagnosis` picks the worst once the job has ended."""
    folder = Path(run_dir) / OOM_FOLDER
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"rank-{diagnosis.rank}.json"
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    tmp.write_text(json.dumps(diagnosis.to_dict(), indent=1) + "\n")
    os.replace(tmp, path)
    return path


def collect_run_diagnosis(run_dir, since: float = 0.0) -> tuple[Diagnosis, Path] | None:
    """The worst rank's diagnosis among those written at or after `since` (this job, not an older
    one in the same folder), also written as RUN/oom-diagnosis.txt; None if no rank wrote one."""
    folder = Path(run_dir) / OOM_FOLDER
    found = []
    for path in sorted(folder.glob("rank-*.json")) if folder.is_dir() else ():
        try:
            if path.stat().st_mtime >= since:
                found.append(Diagnosis.from_dict(json.loads(path.read_text())))
        except (OSError, ValueError, TypeError):
            continue  # a rank killed while writing: the others still tell
    if not found:
        return None
    worst = max(found, key=lambda d: (d.live_total, -d.rank))
    text = format_diagnosis(worst)
    if len(found) > 1:
        text += f"\n  ({len(found)} ranks ran out; shown: the one with the most memory live, rank {worst.rank})"
    target = Path(run_dir) / DIAGNOSIS_FILE
    target.write_text(text + "\n")
    return worst, text, target


# function name in a traceback -> the phase it runs (an OOM outside the tracker: a real GPU without
# --memory-budget, where tracking every op would cost too much to leave on)
_PHASE_FRAMES = (("save_checkpoint", "checkpoint"), ("_engine_run_backward", "backward"), ("run_backward", "backward"),
                 ("backward", "backward"), ("step", "optimizer"), ("forward_backward", "forward"),
                 ("setup", "load"), ("build_model", "load"))


def phase_from_traceback(exc) -> str:
    """The phase an exception struck in, read from the innermost frame whose function names one."""
    names = []
    tb = getattr(exc, "__traceback__", None)
    while tb is not None:
        names.append(tb.tb_frame.f_code.co_name)
        tb = tb.tb_next
    for name in reversed(names):
        for frame, phase in _PHASE_FRAMES:
            if name == frame:
                return phase
    return "forward"


def untracked_oom(exc, step: int = 0) -> dict:
    """A RankReport-style `oom` record for an OOM the tracker did not see: the phase from the
    traceback, the CUDA allocator's figures, no category breakdown."""
    info = {"phase": phase_from_traceback(exc), "step": step, "breakdown": {}, "untracked": True,
            "message": str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__}
    try:
        import torch

        if torch.cuda.is_available() and torch.cuda.is_initialized():
            info["cuda"] = cuda_stats()
    except Exception:  # noqa: BLE001 - a broken CUDA context still deserves the rest of the diagnosis
        pass
    return info
