"""Sizes as the user writes them: `3MiB`, `2.5 GB`, `5000000`, `24`. The one parser behind every flag
that takes a size (--memory-budget, --gpu custom:N, bucket sizes, shard sizes).

A plain number keeps the meaning its flag always had (`plain`: bytes for a budget, GiB for a GPU,
elements for a bucket). A unit says what it means: B; KB/MB/GB/TB are powers of 1000, KiB/MiB/GiB/TiB
powers of 1024 (case-insensitive). Counts of elements take K/M/G (x1000) instead of byte units.
"""
from __future__ import annotations

import math
import re

from shardfit.errors import ShardfitError

BYTE_UNITS = {"b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
              "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
COUNT_UNITS = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9}
# plain unit name -> the multiplier a bare number gets
PLAIN = {"B": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "GB": 10**9, "elements": 1}

_SIZE = re.compile(r"^\s*([+-]?(?:\d+(?:\.\d*)?|\.\d+)(?:e[+-]?\d+)?)\s*([a-z]*)\s*$", re.IGNORECASE)


def parse_size(text, plain: str = "B", what: str = "size") -> int:
    """Bytes (or elements when plain='elements') that `text` gives; ShardfitError naming `what` and
    the accepted forms otherwise. Never negative; 0 only when written as such."""
    value, unit = _split(text, plain, what)
    if plain == "elements":
        if unit.lower() not in COUNT_UNITS:
            raise ShardfitError(f"{what} '{text}' is a number of elements: give a plain number or K/M/G "
                                "(e.g. 5e8 or 500M), not a byte size")
        scale = COUNT_UNITS[unit.lower()]
    elif unit:
        if unit.lower() not in BYTE_UNITS:
            raise ShardfitError(f"{what} '{text}': unknown unit '{unit}': use B, KB, MB, GB, KiB, MiB or GiB "
                                f"(a plain number is {plain})")
        scale = BYTE_UNITS[unit.lower()]
    else:
        scale = PLAIN[plain]
    result = value * scale
    if not math.isfinite(result) or result > 2**63:
        raise ShardfitError(f"{what} '{text}' is too large")
    return int(round(result))


def parse_gib(text, what: str = "size") -> float:
    """A size in GiB as a float (custom GPUs are named by GiB): '24' -> 24.0, '80GB' -> 74.5."""
    value, unit = _split(text, "GiB", what)
    if not unit:
        return value
    parse_size(text, "GiB", what)  # the unit is checked by the one parser
    return value * BYTE_UNITS[unit.lower()] / 2**30


def _split(text, plain: str, what: str) -> tuple[float, str]:
    if plain not in PLAIN:
        raise ValueError(f"unknown plain unit {plain!r}")
    found = _SIZE.match(str(text))
    if found is None:
        example = "5e8 or 500M" if plain == "elements" else "3MiB, 2.5GB or 5000000"
        raise ShardfitError(f"{what} '{text}' is not a size: give a number with an optional unit, e.g. {example} "
                            f"(a plain number is {plain})")
    value = float(found.group(1))
    if not math.isfinite(value):
        raise ShardfitError(f"{what} '{text}' is too large")
    if value < 0:
        raise ShardfitError(f"{what} must be a positive size, got '{text}'")
    return value, found.group(2)


def size_type(plain: str = "B", what: str = "size"):
    """An argparse `type=`: the flag's value parsed by `parse_size` (a bad value: one line, exit 2)."""
    def convert(text):
        import argparse

        try:
            return parse_size(text, plain, what)
        except ShardfitError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    convert.__name__ = "size"
    return convert


def gib_type(what: str = "size"):
    """An argparse `type=` for flags held in GiB (a plain number is GiB; '512MiB' is 0.5)."""
    def convert(text):
        import argparse

        try:
            return parse_gib(text, what)
        except ShardfitError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    convert.__name__ = "size"
    return convert
