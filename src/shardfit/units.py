"""Byte formatting every stage shares (a leaf module: no shardfit imports), so the analytic stages
need not import measure/ for it."""
from __future__ import annotations

BINARY_UNITS = (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10))


def fmt_bytes(value: float) -> str:
    """`1.50 GiB`, `12.00 MiB`, `512 B`: two decimals in the largest binary unit the value reaches."""
    sign = "-" if value < 0 else ""
    value = abs(value)
    for name, size in BINARY_UNITS:
        if value >= size:
            return f"{sign}{value / size:.2f} {name}"
    return f"{sign}{int(value)} B"
