"""Reading a calibrated device profile's matmul rates (GPU.measured) at a plan's shape. Analytic; no torch.

calibrate times (tokens x width) @ (width x width) matmuls over a few token counts and widths; a
plan's matmuls are read off that grid at its micro-batch's tokens and its hidden size. The measured
curve already holds the thin-matmul slowdown the datasheet path models with its token ramp.
"""
from __future__ import annotations

import math

from shardfit.spec.gpus import MeasuredRates


def _interpolate(points: list[tuple[float, float]], x: float) -> float:
    """Piecewise-linear in log(x) through measured (x, rate) points, flat beyond the ends."""
    points = sorted(points)
    if x <= points[0][0]:
        return points[0][1]
    for (x0, y0), (x1, y1) in zip(points, points[1:]):
        if x <= x1:
            share = (math.log(x) - math.log(x0)) / (math.log(x1) - math.log(x0)) if x1 > x0 else 1.0
            return y0 + (y1 - y0) * share
    return points[-1][1]


def measured_matmul_flops(rates: MeasuredRates, precision: str, tokens: int, width: int) -> float:
    """FLOP/s calibrate achieved for a (tokens x width) @ (width x width) matmul, interpolated over
    the measured token counts at the nearest measured widths. The measured curve is the ramp:
    no efficiency factor on top."""
    wanted = "fp32" if precision == "fp32" else "bf16"
    dtypes = {d for d, *_ in rates.matmul}
    dtype = wanted if wanted in dtypes else "fp32" if "fp32" in dtypes else sorted(dtypes)[0]
    by_width: dict[int, list[tuple[float, float]]] = {}
    for d, m, w, tflops in rates.matmul:
        if d == dtype:
            by_width.setdefault(w, []).append((m, tflops * 1e12))
    at_width = [(w, _interpolate(points, max(tokens, 1))) for w, points in by_width.items()]
    return _interpolate(at_width, max(width, 1))
