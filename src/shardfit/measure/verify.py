"""`fit --verify`: run the chosen plan for a few real steps on the devices present and correct the
memory and step-time predictions from the measurement.

The local run rarely has the plan's world size (2 CPU ranks for an 8-GPU plan), so the plan is
measured at the local size and the models predict that same local plan: their ratio is the model's
error on this model and strategy, and the full plan's prediction is scaled by it. Step time is
corrected only when the run's device is the one the step-time model priced (GPUs for GPUs; CPU ranks
with a CPU device profile, `fit --cpu --device-profile`): a CPU step says nothing about a GPU's.
"""
from __future__ import annotations

import os
import sys
from dataclasses import dataclass

from shardfit.errors import ShardfitError
from shardfit.estimate.estimator import estimate
from shardfit.fit.steptime import step_time
from shardfit.measure.oom import Diagnosis, format_diagnosis
from shardfit.measure.run import run_plan_worker
from shardfit.spec.planfile import plan_to_data
from shardfit.units import fmt_bytes
from shardfit.spec.parallelism import resolve

CPU_RANKS = 2
RAM_SHARE = 0.5  # the verification run may use at most half of this machine's RAM
PROFILED_STEPS = 2  # under shardfit.profile, for memory (the first pays lazy initialisation)
TIMED_STEPS = 3  # then outside the profiler, for step time (the median is kept)


@dataclass(frozen=True, kw_only=True)
class Verification:
    ranks: int
    device: str
    measured_bytes: int
    predicted_bytes: int  # estimator, for the local run
    corrected_bytes: int  # the full plan's prediction scaled by measured / predicted
    usable_bytes: int
    measured_step_s: float | None = None  # median of the timed local steps
    predicted_step_s: float | None = None  # the step-time model, for the local run
    time_comparable: bool = False  # the local device is the one the step-time model priced

    @property
    def time_ratio(self) -> float | None:
        if not (self.time_comparable and self.measured_step_s and self.predicted_step_s):
            return None
        return self.measured_step_s / self.predicted_step_s

    def time_lines(self, result) -> list[str]:
        """Measured vs predicted step time, and the ranking with the ratio applied."""
        if self.measured_step_s is None:
            return []
        measured = f"verify: step time measured {self.measured_step_s * 1e3:.1f} ms on {self.ranks} {self.device} rank(s)"
        if self.time_ratio is None:
            return [f"{measured}; not compared: the step-time model priced {result.gpu.name}, not this machine "
                    "(on CPU: `shardfit calibrate`, then fit --cpu --device-profile)"]
        lines = [f"{measured} vs {self.predicted_step_s * 1e3:.1f} ms predicted (x{self.time_ratio:.2f}); corrected ranking:"]
        for tag, cand in [("best", result.best)] + [("alt", c) for c in result.alternatives]:
            lines.append(f"  {tag:<4} {cand.label}: {cand.time.total_s * 1e3:.1f} ms predicted -> "
                         f"{cand.time.total_s * self.time_ratio * 1e3:.1f} ms corrected")
        return lines

    def to_json(self, result) -> dict:
        ratio = self.time_ratio
        return {"ranks": self.ranks, "device": self.device, "measured_bytes": self.measured_bytes,
                "predicted_bytes": self.predicted_bytes, "corrected_bytes": self.corrected_bytes, "fits": self.fits,
                "measured_step_s": self.measured_step_s, "predicted_step_s": self.predicted_step_s,
                "time_ratio": ratio,
                "corrected_step_s": None if ratio is None else {
                    c.label: c.time.total_s * ratio for c in (result.best, *result.alternatives)}}

    @property
    def ratio(self) -> float:
        return self.measured_bytes / self.predicted_bytes if self.predicted_bytes else 1.0

    @property
    def fits(self) -> bool:
        return self.corrected_bytes <= self.usable_bytes

    def line(self) -> str:
        verdict = "still fits" if self.fits else "NO LONGER FITS: take an alternative or lower the micro-batch"
        return (f"verify: {self.ranks} {self.device} rank(s) measured {fmt_bytes(self.measured_bytes)} vs "
                f"{fmt_bytes(self.predicted_bytes)} predicted (x{self.ratio:.2f}); corrected prediction "
                f"{fmt_bytes(self.corrected_bytes)} of {fmt_bytes(self.usable_bytes)} usable: {verdict}")


def _local_devices() -> tuple[str, int]:
    import torch  # only --verify pays for torch

    if torch.cuda.is_available():
        return "cuda", torch.cuda.device_count()
    return "cpu", CPU_RANKS


def verify(result, steps: int = PROFILED_STEPS, timeout: float = 900, timed_steps: int = TIMED_STEPS) -> Verification:
    if result.best is None:
        raise ShardfitError("--verify needs a plan that fits: nothing fits here")
    plan = result.best.plan
    if not plan.parallelism.is_default:
        # The local run shrinks the world to the devices here, which a tp x cp x pp layout cannot follow.
        raise ShardfitError(f"--verify runs data-parallel plans at the local size; the best plan is "
                            f"{resolve(plan).describe()}: verify it on the target GPUs, or fit --engine ddp,deepspeed")
    device, available = _local_devices()
    ranks = max(1, min(plan.cluster.world_size, available))
    local = plan.with_changes(cluster={"nodes": 1, "gpus_per_node": ranks})
    local_est = estimate(local, device=device)
    if device == "cpu":
        ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        if local_est.peak_bytes * ranks > RAM_SHARE * ram:
            raise ShardfitError(f"--verify would need {fmt_bytes(local_est.peak_bytes * ranks)} on {ranks} CPU ranks, "
                                f"more than half of this machine's {fmt_bytes(ram)}: verify on the target GPUs")
    data = plan_to_data(local)
    config = {"plan": data, "steps": steps, "checkpoint": False, "budget_bytes": None, "label": local.strategy.label,
              "timed_steps": timed_steps}
    measured = run_plan_worker(config, ranks, timeout, what="--verify: the run", tail=3)
    if measured.get("error") == "oom" and measured.get("diagnosis"):
        print(format_diagnosis(Diagnosis.from_dict(measured["diagnosis"])), file=sys.stderr)
    if measured.get("error"):
        raise ShardfitError(f"--verify: the run failed: {measured['error']}")
    peak = (measured.get("comparison") or {}).get("peak") or {}
    measured_bytes = int(peak.get("measured") or 0)
    predicted = int(peak.get("predicted") or local_est.peak_bytes)
    if measured_bytes <= 0:
        raise ShardfitError("--verify: the run reported no memory measurement")
    full = estimate(plan, device=result.request.options.device)
    ratio = measured_bytes / predicted if predicted else 1.0
    overhead = full.overhead_bytes if result.request.options.device == "cuda" else 0
    corrected = int(full.peak_bytes * ratio) + overhead
    times = sorted(measured.get("step_times_s") or [])
    gpu = result.gpu
    comparable = (device == "cuda" and result.request.options.device == "cuda" and gpu.measured is None) or (
        gpu.measured is not None and gpu.measured.device == device)
    return Verification(ranks=ranks, device=device, measured_bytes=measured_bytes, predicted_bytes=predicted,
                        corrected_bytes=corrected, usable_bytes=result.usable_bytes,
                        measured_step_s=times[len(times) // 2] if times else None,
                        predicted_step_s=step_time(local, gpu).total_s, time_comparable=comparable)
