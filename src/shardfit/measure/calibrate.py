"""Where the estimator and the measurement disagree, as a markdown table for the estimator's owners.

    python -m shardfit.measure.calibrate RESULTS.jsonl [...]   # files written by shardfit.measure.worker

A term is off when |predicted − measured| exceeds 5% of measured, or, for a term under 1% of its
phase's total, 1% of that total (the same rule as tests/measure/test_engine_matrix.py).
"""
from __future__ import annotations

import json
import sys
from collections import defaultdict

from shardfit.estimate.result import CATEGORIES
from shardfit.units import fmt_bytes

TERM_TOLERANCE, SMALL_TERM, PEAK_TOLERANCE = 0.05, 0.01, 0.10


def off_terms(comparison: dict) -> list[tuple[str, str, int, int]]:
    """(phase, category, measured, predicted) for every term out of tolerance, plus ("peak", "*", ...)."""
    out = []
    for phase, rows in comparison.items():
        if phase == "peak":
            continue
        phase_total = max(rows["total"]["measured"], 1)
        for category in CATEGORIES:
            m, p = rows[category]["measured"], rows[category]["predicted"]
            limit = SMALL_TERM * phase_total if m < SMALL_TERM * phase_total else TERM_TOLERANCE * m
            if abs(p - m) > limit:
                out.append((phase, category, m, p))
    peak = comparison.get("peak")
    if peak and peak["error"] is not None and abs(peak["error"]) > PEAK_TOLERANCE:
        out.append(("peak", "*", peak["measured"], peak["predicted"]))
    return out


def markdown(results: list[dict]) -> str:
    groups = defaultdict(list)
    for result in results:
        if not result.get("comparison") or result.get("error"):
            continue  # an OOM'd step is not a whole step
        for phase, category, m, p in off_terms(result["comparison"]):
            strategy = result["label"].split("/")[1] if "/" in result["label"] else result["label"]
            groups[(strategy, phase, category)].append((result["label"], m, p))
    lines = ["| strategy | phase | category | configurations off | measured → predicted (first) |",
             "|---|---|---|---|---|"]
    for (strategy, phase, category), rows in sorted(groups.items()):
        label, m, p = rows[0]
        lines.append(f"| {strategy} | {phase} | {category} | {len(rows)} | {fmt_bytes(m)} → {fmt_bytes(p)} "
                     f"({label}) |")
    return "\n".join(lines)


def main(argv=None) -> int:
    paths = sys.argv[1:] if argv is None else argv
    results = [json.loads(line) for path in paths for line in open(path) if line.strip()]
    print(markdown(results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
