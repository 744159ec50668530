"""`shardfit plan` under tp / cp / pp: the layout and every pipeline rank's memory by category."""
from __future__ import annotations

from dataclasses import replace

from shardfit.estimate.model_parallel import stage_estimates
from shardfit.estimate.result import CATEGORIES
from shardfit.spec.parallelism import resolve

GIB = 2**30


def stage_rows(plan, estimate_fn, options: dict) -> list[dict]:
    """Per pipeline rank: its layers, the peak phase's categories and the device peak (bytes)."""
    rows = []
    for stage, layers, est in stage_estimates(plan, estimate_fn, **options, explain=False):
        at_peak = est.phases[est.peak_phase]
        rows.append({"stage": stage, "layers": layers, "peak_phase": est.peak_phase,
                     **{c: at_peak[c] for c in CATEGORIES}, "overhead": est.overhead_bytes,
                     "device_peak": est.device_peak_bytes})
    return rows


def layout_document(plan, strategies, estimate_fn, options: dict) -> dict:
    """{strategy label: {"layout", "world", "ranks": [stage rows]}} for the JSON document."""
    return {s.label: {"layout": resolve(replace(plan, strategy=s)).describe(), "world": resolve(plan).world,
                      "ranks": stage_rows(replace(plan, strategy=s), estimate_fn, options)} for s in strategies}


def layout_text(plan, strategies, estimate_fn, options: dict, memory_gib: float) -> str:
    lines = ["\nGiB per rank by pipeline stage, at each stage's peak phase"]
    for strategy in strategies:
        candidate = replace(plan, strategy=strategy)
        rows = stage_rows(candidate, estimate_fn, options)
        layout = resolve(candidate)
        lines.append(f"{strategy.label}: {layout.describe()} (world {layout.world})")
        lines.append("  stage layers  params  grads  optim  activ  temps   ovhd  total  fits  peak phase")
        for row in rows:
            total = row["device_peak"] / GIB
            lines.append(f"  {row['stage']:>5} {row['layers']:>6} " + " ".join(f"{row[c] / GIB:>6.2f}" for c in CATEGORIES)
                         + f" {row['overhead'] / GIB:>6.2f} {total:>6.2f}  {'yes' if total <= memory_gib else 'NO ':>4}"
                         + f"  {row['peak_phase']}")
    return "\n".join(lines)
