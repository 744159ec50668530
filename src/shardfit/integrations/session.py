"""What every integration does, whatever calls it (a Trainer callback, a Lightning callback, an
Accelerate loop): measure the first steps on every rank with `shardfit.profile`, gather them on rank
0, compare them with the estimate of the Plan the framework's own setup describes, print that with
the headroom, write the JSON report; and on an out-of-memory error on any rank, print the diagnosis
with the smallest fixes in the framework's own terms and end every rank with a non-zero code.

Off (enabled=False or SHARDFIT_PROFILE=0) a session installs nothing: no tracker, no hook.
"""
from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import shardfit
from shardfit.estimate.estimator import estimate
from shardfit.integrations.fix_terms import format_arguments, in_framework_terms
from shardfit.measure.compare import compare, format_comparison
from shardfit.measure.oom import Diagnosis, candidate_changes, diagnose, format_diagnosis, untracked_oom
from shardfit.measure.report import RankReport, gather
from shardfit.spec.sizes import parse_size
from shardfit.units import fmt_bytes

REPORT_FILE = "shardfit-memory.json"
OOM_FILE = "shardfit-oom.json"
OOM_EXIT_CODE = 3
# Ranks that run out together each write their diagnosis and wait this long for the others' before
# one of them prints the worst (no collective is safe after an OOM: files are the only channel).
_OOM_GRACE_S = 1.0
# How long a rank that does not print waits for the one that does (a diagnosis takes < 1 s).
_OOM_PRINT_WAIT_S = 30.0
# Before any model is built (this module is imported first): what "written by this job" is measured from.
_STARTED = time.time()


def _rank() -> int:
    return int(os.environ.get("RANK", "0"))


def _fresh(path: Path) -> bool:
    """Written by this job: after this process started (a peer's file comes after its OOM, which comes
    after every rank started; an earlier job's file in the same folder is older)."""
    try:
        return path.stat().st_mtime >= _STARTED
    except OSError:
        return False


def _claim(path: Path) -> bool:
    """True for exactly one caller per path: the file is created only if absent (O_EXCL); an earlier
    job's is removed first."""
    if path.exists() and not _fresh(path):
        path.unlink(missing_ok=True)
    try:
        os.close(os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        return True
    except FileExistsError:
        return False


def _clear_earlier_oom(folder: Path) -> None:
    """An earlier job's OOM files in this run's folder: this rank's record and any stale marker."""
    (folder / f"rank-{_rank()}.json").unlink(missing_ok=True)
    for marker in (folder / ".printer", folder / ".printed"):
        if marker.exists() and not _fresh(marker):
            marker.unlink(missing_ok=True)


def _read_record(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def tracking_enabled(enabled: bool | None) -> bool:
    if enabled is None:
        return os.environ.get("SHARDFIT_PROFILE", "1").lower() not in ("0", "off", "false")
    return bool(enabled)


def budget_from_env(budget) -> int | None:
    if budget is None and os.environ.get("SHARDFIT_MEMORY_BUDGET"):
        budget = os.environ["SHARDFIT_MEMORY_BUDGET"]
    if budget is None:
        return None
    return parse_size(budget, "B", "memory budget") if isinstance(budget, str) else int(budget)


def _atomic_write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    tmp.write_text(text)
    os.replace(tmp, path)


class MemorySession:
    """One run's measurement. `plan_fn()` returns (Plan, assumed lines) once the setup is known
    (after the first forward: the sequence length is read from the batch)."""

    def __init__(self, *, framework: str, steps: int, out_dir, plan_fn, budget_bytes=None, enabled: bool | None = None,
                 printer=None, optimizer_impl: str = "auto", adjust_prediction=None):
        self.framework = framework
        # adjust_prediction(phases) -> (phases, notes): what the framework's loop adds to the plan's
        # estimate (Lightning keeps the previous step's gradients through the forward).
        self.adjust_prediction = adjust_prediction
        self.optimizer_impl = optimizer_impl
        self.steps = max(int(steps), 1)
        self.out_dir = Path(out_dir)
        self.plan_fn = plan_fn
        self.budget_bytes = budget_from_env(budget_bytes)
        self.enabled = tracking_enabled(enabled)
        self.printer = printer or (lambda text: print(text, flush=True))
        self.profiler = None
        self.result: dict | None = None
        self._previous_hook = None
        self._plan_cache = None

    # ---- lifecycle ------------------------------------------------------------------------------
    def start(self, model, optimizer=None):
        if not self.enabled or self.profiler is not None or self.result is not None:
            return

        self._install_excepthook()
        _clear_earlier_oom(self.out_dir / "shardfit-oom")
        self.profiler = shardfit.profile(model, optimizer, budget_bytes=self.budget_bytes, explain_oom=False,
                                         label=self.framework)
        self.profiler.__enter__()

    def after_step(self, completed_steps: int) -> None:
        """Call after each optimizer step; the session stops measuring after `steps` of them."""
        if self.profiler is not None and completed_steps >= self.steps:
            self.stop()

    def stop(self) -> dict | None:
        """Stop measuring, gather every rank on rank 0 (a collective: call it on every rank), compare
        with the plan, print and write the report."""
        if self.profiler is None:
            return self.result

        profiler, self.profiler = self.profiler, None
        profiler.__exit__(None, None, None)
        gathered = gather(profiler.report())
        if gathered is not None:
            self.result = self._report(gathered)
            self.printer(self._summary(self.result))
            _atomic_write(self.out_dir / REPORT_FILE, json.dumps(self.result, indent=1) + "\n")
        else:
            self.result = {}
        return self.result

    def close(self):
        self._remove_excepthook()

    def plan(self):
        if self._plan_cache is None:
            self._plan_cache = self.plan_fn()
        return self._plan_cache

    # ---- the report -----------------------------------------------------------------------------
    def _device(self) -> str:
        import torch

        return "cuda" if torch.cuda.is_available() and torch.cuda.is_initialized() else "cpu"

    def _limit(self, device: str) -> int | None:
        if self.budget_bytes:
            return self.budget_bytes
        if device == "cuda":
            import torch

            return torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory
        return None

    def _report(self, gathered) -> dict:

        device = self._device()
        plan, assumed = self.plan()
        est = estimate(plan, device=device, optimizer_impl=self.optimizer_impl)
        measured = gathered.phases
        predicted = est.phases
        if self.adjust_prediction is not None:
            predicted, notes = self.adjust_prediction(predicted)
            assumed = list(assumed) + list(notes)
        comparison = compare(measured, predicted)
        limit = self._limit(device)
        peak = comparison.get("peak", {})
        overhead = est.overhead_bytes if device == "cuda" else 0
        predicted_peak = max(sum(predicted[p].values()) for p in predicted) + overhead
        return {"framework": self.framework, "device": device, "world_size": len(gathered.ranks),
                "steps_measured": self.steps, "strategy": plan.strategy.label, "plan": _plan_dict(plan),
                "assumed": list(assumed), "measured": measured, "predicted": predicted,
                "comparison": comparison, "measured_peak_bytes": peak.get("measured", 0),
                "predicted_peak_bytes": predicted_peak, "limit_bytes": limit,
                "headroom_bytes": None if limit is None else limit - peak.get("measured", 0),
                "predicted_headroom_bytes": None if limit is None else limit - predicted_peak,
                "peak_by_rank": gathered.peak_by_rank(), "imbalance": gathered.imbalance_lines(),
                "ranks": [r.to_dict() for r in gathered.ranks]}

    def _summary(self, result: dict) -> str:

        t = result["plan"]["training"]
        lines = [f"shardfit: {result['framework']} run measured for {result['steps_measured']} step(s) on "
                 f"{result['world_size']} rank(s) ({result['device']}): {result['strategy']}, micro-batch "
                 f"{t['micro_batch']} x accumulation {t['grad_accum']}, seq {t['seq_len']}, {t['precision']}, "
                 f"AC {t['activation_checkpointing']}, optimizer {t['optimizer']}",
                 format_comparison(result["comparison"], title="measured (worst rank) vs predicted, per rank:")]
        limit = result["limit_bytes"]
        if limit:
            lines.append(f"headroom: {fmt_bytes(result['headroom_bytes'])} of {fmt_bytes(limit)} measured "
                         f"({result['headroom_bytes'] / limit:.0%}), {fmt_bytes(result['predicted_headroom_bytes'])} "
                         "predicted")
        else:
            lines.append("headroom: no memory limit on a CPU (set SHARDFIT_MEMORY_BUDGET=SIZE to rehearse one)")
        lines += [f"assumed: {line}" for line in result["assumed"]]
        lines += [f"imbalance: {line}" for line in result["imbalance"]]
        lines.append(f"report: {self.out_dir / REPORT_FILE}")
        return "\n".join(lines)

    # ---- out of memory --------------------------------------------------------------------------
    def _install_excepthook(self):
        if self._previous_hook is None:
            self._previous_hook = sys.excepthook
            sys.excepthook = self._excepthook

    def _remove_excepthook(self):
        if self._previous_hook is not None and sys.excepthook == self._excepthook:
            sys.excepthook = self._previous_hook
        self._previous_hook = None

    def _excepthook(self, exc_type, exc, tb):
        import torch

        if isinstance(exc, torch.OutOfMemoryError):
            try:
                self.explain_oom(exc)
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                # No collective is safe after an OOM, and a process group torn down with a peer
                # stuck in one hangs: leave now; the launcher ends the other ranks.
                os._exit(OOM_EXIT_CODE)
        (self._previous_hook or sys.__excepthook__)(exc_type, exc, tb)

    def explain_oom(self, exc) -> dict:
        """This rank's diagnosis with fixes in the framework's terms, written to OUT/shardfit-oom/
        rank-N.json; the first rank to claim the job's printer (after a grace for the others) prints the
        worst rank's, once per job, and the others wait for that before they end."""

        profiler, self.profiler = self.profiler, None
        if profiler is not None:
            profiler.record_oom(exc)
            profiler.__exit__(None, None, None)
            report = profiler.report()
        else:
            report = RankReport(rank=_rank(), world_size=int(os.environ.get("WORLD_SIZE", "1")), device=self._device(),
                                oom=untracked_oom(exc), budget_bytes=self.budget_bytes)
        try:
            plan, assumed = self.plan()
        except Exception as error:  # noqa: BLE001 - an unknown setup still deserves the diagnosis
            plan, assumed = None, [f"no plan: {error}"]
        candidates = oom_candidates(plan) if plan is not None else None
        diagnosis = diagnose(report, plan, candidates)
        if diagnosis is not None and plan is not None and self.adjust_prediction is not None:
            diagnosis = self._adjusted(diagnosis, plan, candidates)
        record = diagnosis.to_dict() if diagnosis else {"rank": _rank()}
        record["fixes_in_terms"] = self._fix_terms(diagnosis, plan, candidates)
        record["framework"], record["assumed"] = self.framework, list(assumed)
        folder = self.out_dir / "shardfit-oom"
        _atomic_write(folder / f"rank-{_rank()}.json", json.dumps(record, indent=1) + "\n")
        time.sleep(_OOM_GRACE_S)
        if _claim(folder / ".printer"):
            records = [r for r in map(_read_record, filter(_fresh, folder.glob("rank-*.json"))) if r]
            worst = max(records, key=lambda r: (sum((r.get("live") or {}).values()), -r["rank"]))
            _atomic_write(self.out_dir / OOM_FILE, json.dumps(worst, indent=1) + "\n")
            print(self._oom_text(worst, len(records)), file=sys.stderr, flush=True)
            _atomic_write(folder / ".printed", "")
        else:
            # Another rank prints: stay until it has, or the launcher, seeing this rank end, stops that one
            # mid-print (a job that ran out and said nothing).
            printed, deadline = folder / ".printed", time.monotonic() + _OOM_PRINT_WAIT_S
            while not _fresh(printed) and time.monotonic() < deadline:
                time.sleep(0.02)
        return record

    def _adjusted(self, diagnosis, plan, candidates):
        """The fixes' peaks with the framework's own terms added (see adjust_prediction)."""
        from dataclasses import replace


        def peak(p):
            phases, _ = self.adjust_prediction(estimate(p, device="cpu").phases)
            return max(sum(row.values()) for row in phases.values())

        base, limit, by_label, fixes = peak(plan), diagnosis.limit_bytes, dict(candidates), []
        for fix in diagnosis.fixes:
            new = peak(plan.with_changes(**by_label[fix.change])) if fix.change in by_label else fix.peak_bytes
            fixes.append(replace(fix, peak_bytes=new, delta_bytes=new - base, fits=limit is None or new <= limit))
        return replace(diagnosis, fixes=tuple(sorted(fixes, key=lambda f: not f.fits)))

    def _fix_terms(self, diagnosis, plan, candidates) -> list[dict]:
        if diagnosis is None or plan is None:
            return []
        by_label = dict(candidates)
        out = []
        for fix in diagnosis.fixes:
            changes = by_label.get(fix.change)
            if changes is None:
                continue
            changed = plan.with_changes(**changes)
            args = in_framework_terms(self.framework, changes, changed, self.out_dir)
            out.append({"change": fix.change, "fits": fix.fits, "peak_bytes": fix.peak_bytes, "arguments": args,
                        "text": format_arguments(self.framework, args)})
        return out

    def _oom_text(self, record: dict, ranks_out: int) -> str:

        fields = {k: v for k, v in record.items() if k in Diagnosis.__dataclass_fields__}
        # shardfit train's flags mean nothing here: the fixes are said in the framework's terms below.
        fields["fixes"] = [dict(f, flags="", fields="") for f in fields.get("fixes", ())]
        text = format_diagnosis(Diagnosis.from_dict(fields)) if "phase" in record else "OUT OF MEMORY (no diagnosis)"
        where = {"transformers": "TrainingArguments", "lightning": "the Lightning Trainer",
                 "accelerate": "your Accelerate loop"}[self.framework]
        fits = [f for f in record["fixes_in_terms"] if f["fits"]]
        if fits:
            text += f"\n  smallest fix in {where}: {fits[0]['text']}"
            text += "".join(f"\n    or: {f['text']}" for f in fits[1:])
        if ranks_out > 1:
            text += f"\n  ({ranks_out} ranks ran out; shown: the one with the most memory live)"
        return text + f"\n  written to {self.out_dir / OOM_FILE}"


def oom_candidates(plan) -> list[tuple[str, dict]]:
    """The estimator's candidate changes plus the 8-bit optimizer, least disruptive first."""

    out = list(candidate_changes(plan))
    if plan.training.optimizer == "adamw":
        out.append(("8-bit AdamW (bitsandbytes)", {"training": {"optimizer": "adamw8bit"}}))
    return out


def _plan_dict(plan) -> dict:
    data = plan.to_dict()
    data["model"] = {"name": plan.model.name, "family": plan.model.family, "n_params": plan.model.n_params}
    return data
