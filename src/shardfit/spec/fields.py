"""Plan sections from plain data (YAML/JSON): unknown keys and wrong scalar types are one-line errors,
lists become tuples so Plans stay hashable."""
from __future__ import annotations

import dataclasses
import math
from dataclasses import fields

from shardfit.errors import ShardfitError


def build_section(cls, data, where: str):
    if data is None:
        return cls()
    if isinstance(data, cls):
        return data
    if not isinstance(data, dict):
        raise ShardfitError(f"'{where}' must be a mapping, got {type(data).__name__}")
    known = {f.name: f for f in fields(cls)}
    unknown = sorted(set(data) - set(known))
    if unknown:
        raise ShardfitError(f"unknown field '{where}.{unknown[0]}': known fields are {', '.join(known)}")
    values = dict(data)
    for name, value in data.items():
        values[name] = _coerce(known[name], value, f"{where}.{name}")
    return cls(**values)


_NUMBER_TYPES = {"int": int, "float": float}


def _coerce(spec: dataclasses.Field, value, where: str):
    """Check scalar types from the annotation text; lists become tuples so Plans stay hashable."""
    annotation = str(spec.type)
    if value is None:
        if "None" in annotation:
            return None
        raise ShardfitError(f"'{where}' must not be empty")
    if annotation.startswith("tuple"):
        if isinstance(value, str):
            value = [v.strip() for v in value.split(",") if v.strip()]
        if not isinstance(value, (list, tuple)) or not all(isinstance(v, str) for v in value):
            raise ShardfitError(f"'{where}' must be a list of names")
        return tuple(value)
    head = annotation.split("|")[0].strip()
    if head == "bool":
        if not isinstance(value, bool):
            raise ShardfitError(f"'{where}' must be true or false, got {value!r}")
        return value
    if head in _NUMBER_TYPES:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            try:
                value = float(value)
            except (TypeError, ValueError):
                raise ShardfitError(f"'{where}' must be a number, got {value!r}") from None
        if isinstance(value, float) and not math.isfinite(value):
            raise ShardfitError(f"'{where}' must be a finite number, got {value!r}")
        if head == "int":
            if value != int(value):
                raise ShardfitError(f"'{where}' must be a whole number, got {value!r}")
            return int(value)
        return float(value)
    if head == "str":
        if not isinstance(value, (str, int, float)) or isinstance(value, bool):
            raise ShardfitError(f"'{where}' must be text, got {value!r}")
        return str(value)
    return value


def lora_section(current: dict | None, rank: int | None, targets: str | None, base: str | None,
                 base_default: str) -> dict | None:
    """A plan's training.lora mapping with the --lora-r / --lora-targets / --lora-base flags applied
    (train, profile): any flag turns LoRA on; rank 16 and `base_default` when not given; None (or the
    plan's own) when no flag is given."""
    if rank is None and targets is None and base is None:
        return current
    lora = dict(current or {})
    lora.setdefault("rank", 16)
    lora.setdefault("base_dtype", base_default)
    if rank is not None:
        lora["rank"] = rank
    if base is not None:
        lora["base_dtype"] = base.strip().lower()
    if targets is not None:
        lora["target_modules"] = [x.strip() for x in targets.split(",") if x.strip()]
    return lora
