"""`fit --verify`: run the chosen plan for a few real steps on the devices present and correct the
memory prediction from the measurement.

The local run rarely has the plan's world size (2 CPU ranks for an 8-GPU plan), so the plan is
measured at the local size and the estimator predicts that same local plan: their ratio is the
estimator's error on this model and strategy, and the full plan's prediction is scaled by it.
Step time is not corrected: a CPU step says nothing about a GPU's.
"""
from __future__ import annotations

import json
import os
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from shardfit.errors import ShardfitError
from shardfit.measure.oom import Diagnosis, format_diagnosis
from shardfit.measure.report import fmt_bytes

CPU_RANKS = 2
RAM_SHARE = 0.5  # the verification run may use at most half of this machine's RAM


@dataclass(frozen=True, kw_only=True)
class Verification:
    ranks: int
    device: str
    measured_bytes: int
    predicted_bytes: int  # estimator, for the local run
    corrected_bytes: int  # the full plan's prediction scaled by measured / predicted
    usable_bytes: int

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


def verify(result, steps: int = 2, timeout: float = 900) -> Verification:
    from shardfit.commands.profile import _launch
    from shardfit.estimate.estimator import estimate
    from shardfit.spec.planfile import plan_to_data

    if result.best is None:
        raise ShardfitError("--verify needs a plan that fits: nothing fits here")
    plan = result.best.plan
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
    config = {"plan": data, "steps": steps, "checkpoint": False, "budget_bytes": None, "label": local.strategy.label}
    with tempfile.TemporaryDirectory() as tmp:
        configs, out = Path(tmp) / "configs.json", Path(tmp) / "out.jsonl"
        configs.write_text(json.dumps([config]))
        done = _launch(["-m", "shardfit.measure.worker", str(configs), str(out)], ranks, timeout)
        if not out.exists():
            tail = (done.stderr or "").strip().splitlines()[-3:]
            raise ShardfitError("--verify: the run failed before reporting: " + " | ".join(tail))
        measured = json.loads(out.read_text().splitlines()[0])
    if measured.get("error") == "oom" and measured.get("diagnosis"):
        print(format_diagnosis(Diagnosis.from_dict(measured["diagnosis"])), file=sys.stderr)
    if measured.get("error"):
        raise ShardfitError(f"--verify: the run failed: {measured['error']}")
    peak = (measured.get("comparison") or {}).get("peak") or {}
    measured_bytes = int(peak.get("measured") or 0)
    predicted = int(peak.get("predicted") or local_est.peak_bytes)
    if measured_bytes <= 0:
        raise ShardfitError("--verify: the run reported no memory measurement")
    full = estimate(plan, device=result.request.device)
    ratio = measured_bytes / predicted if predicted else 1.0
    overhead = full.overhead_bytes if result.request.device == "cuda" else 0
    corrected = int(full.peak_bytes * ratio) + overhead
    return Verification(ranks=ranks, device=device, measured_bytes=measured_bytes, predicted_bytes=predicted,
                        corrected_bytes=corrected, usable_bytes=result.usable_bytes)
