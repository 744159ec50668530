"""Measured next to predicted: per phase and category, with the relative error of each term."""
from __future__ import annotations

from shardfit.estimate.result import CATEGORIES, PHASES
from shardfit.units import fmt_bytes


def rel_error(measured: int, predicted: int) -> float | None:
    """(predicted − measured) / measured; None when nothing was measured (then compare bytes)."""
    if measured == 0:
        return 0.0 if predicted == 0 else None
    return (predicted - measured) / measured


def compare(measured: dict, predicted: dict) -> dict:
    """measured / predicted: phase -> category -> bytes. Returns phase -> category -> row, plus
    "peak": {measured, predicted, error, measured_phase, predicted_phase}."""
    out = {}
    for phase in PHASES:
        if phase not in measured or phase not in predicted:
            continue
        out[phase] = {}
        for cat in CATEGORIES:
            m, p = int(measured[phase].get(cat, 0)), int(predicted[phase].get(cat, 0))
            out[phase][cat] = {"measured": m, "predicted": p, "error": rel_error(m, p)}
        m_total = sum(measured[phase].get(c, 0) for c in CATEGORIES)
        p_total = sum(predicted[phase].get(c, 0) for c in CATEGORIES)
        out[phase]["total"] = {"measured": m_total, "predicted": p_total, "error": rel_error(m_total, p_total)}
    phases = [p for p in out]
    if phases:
        m_phase = max(phases, key=lambda p: out[p]["total"]["measured"])
        p_phase = max(phases, key=lambda p: out[p]["total"]["predicted"])
        m_peak, p_peak = out[m_phase]["total"]["measured"], out[p_phase]["total"]["predicted"]
        out["peak"] = {"measured": m_peak, "predicted": p_peak, "error": rel_error(m_peak, p_peak),
                       "measured_phase": m_phase, "predicted_phase": p_phase}
    return out


def _err(row) -> str:
    if row["error"] is None:
        return f"{'+' if row['predicted'] >= row['measured'] else ''}{fmt_bytes(row['predicted'] - row['measured'])}"
    return f"{row['error']:+.1%}"


def format_comparison(comparison: dict, title: str = "") -> str:
    """One line per phase and category: measured | predicted | error."""
    lines = [title] if title else []
    lines.append(f"{'phase':<11}{'category':<13}{'measured':>12}{'predicted':>12}{'error':>9}")
    for phase in PHASES:
        if phase not in comparison:
            continue
        for cat in CATEGORIES + ("total",):
            row = comparison[phase][cat]
            if cat != "total" and row["measured"] == 0 and row["predicted"] == 0:
                continue
            lines.append(f"{phase:<11}{cat:<13}{fmt_bytes(row['measured']):>12}"
                         f"{fmt_bytes(row['predicted']):>12}{_err(row):>9}")
    if "peak" in comparison:
        peak = comparison["peak"]
        lines.append(f"peak: measured {fmt_bytes(peak['measured'])} in {peak['measured_phase']}, predicted "
                     f"{fmt_bytes(peak['predicted'])} in {peak['predicted_phase']} ({_err(peak)})")
    return "\n".join(lines)


def off_terms(comparison: dict, term_tolerance: float = 0.05, small_term: float = 0.01,
              peak_tolerance: float = 0.05) -> dict[str, str]:
    """"phase/category" -> "measured M predicted P" for every term out of tolerance ("peak/*" for the
    peak). A term under `small_term` of its phase's measured total is compared in bytes against that
    fraction of the total instead of relative to itself."""
    off = {}
    for phase, rows in comparison.items():
        if phase == "peak":
            continue
        phase_total = max(rows["total"]["measured"], 1)
        for category in CATEGORIES:
            row = rows[category]
            miss = abs(row["predicted"] - row["measured"])
            small = row["measured"] < small_term * phase_total
            if miss > (small_term * phase_total if small else term_tolerance * row["measured"]):
                off[f"{phase}/{category}"] = f"measured {row['measured']} predicted {row['predicted']}"
    peak = comparison.get("peak")
    if peak and abs(peak["error"] or 0) > peak_tolerance:
        off["peak/*"] = f"measured {peak['measured']} ({peak['measured_phase']}) predicted {peak['predicted']}"
    return off
