"""All output formatting of `shardfit plan` in one place: the table, the JSON document, --explain.

The JSON schema is versioned (SCHEMA_VERSION) and documented in docs/estimator.md ("JSON schema"); add fields, never
rename or remove them without bumping the version.
"""
from __future__ import annotations

import json

from shardfit.estimate.result import CATEGORIES, OVERHEADS, PHASES

SCHEMA_VERSION = 1
GIB = 1024**3
_SHORT = {"params": "params", "grads": "grads", "optimizer": "optim", "activations": "activ", "temporaries": "temps"}


MIB = 1024**2


def gib(value: float, unit: int = GIB) -> str:
    return f"{value / unit:.2f}"


def fits(estimate, gpu) -> bool:
    return estimate.device_peak_bytes <= gpu.memory_bytes


def header_lines(plan, gpu, accounting: str, device: str, unit_name: str = "GiB") -> list[str]:
    m, t, c = plan.model, plan.training, plan.cluster
    world = c.nodes * c.gpus_per_node
    if m.has_shape:
        work = (f"micro-batch {t.micro_batch} x seq {t.seq_len}, grad-accum {t.grad_accum}, "
                f"AC {t.activation_checkpointing}, attention {t.attention}")
    else:
        work = "model states only (no shapes: activations not counted)"
    lora = ""
    if t.lora is not None:
        lora = f", LoRA r={t.lora.rank} on {','.join(t.lora.target_modules)} (base {t.lora.base_dtype})"
    return [f"{m.name}: {m.n_params / 1e9:.3g}B params; {world} x {gpu.name} ({gpu.memory_gib:g} GiB) on "
            f"{c.nodes} node(s); {t.precision}, {t.optimizer}{lora}",
            f"{work}; accounting {accounting}, device {device}",
            f"{unit_name} per rank at the peak phase; ovhd = CUDA context + NCCL + allocator margin"]


def table(plan, gpu, rows, accounting: str = "real", device: str = "cuda", skipped=()) -> str:
    """rows: list of (label, Estimate)."""
    heads = ["strategy", *(_SHORT[c] for c in CATEGORIES), "peak", "ovhd", "total", "host", "fits", "peak set by (phase / largest category)"]
    # Tiny models read better in MiB; everything else in GiB.
    unit, unit_name = (MIB, "MiB") if max(est.peak_bytes for _, est in rows) < GIB else (GIB, "GiB")
    body = []
    for label, est in rows:
        at_peak = est.phases[est.peak_phase]
        host = sum(est.host.values())
        body.append([label, *(gib(at_peak[c], unit) for c in CATEGORIES), gib(est.peak_bytes, unit),
                     gib(est.overhead_bytes, unit), gib(est.device_peak_bytes, unit), gib(host, unit) if host else "-",
                     "yes" if fits(est, gpu) else "NO", f"{est.peak_phase} / {est.peak_category}"])
    widths = [max(len(str(r[i])) for r in [heads, *body]) for i in range(len(heads))]
    lines = header_lines(plan, gpu, accounting, device, unit_name)
    lines.append("")
    for i, r in enumerate([heads, *body]):
        cells = [str(r[0]).ljust(widths[0])] + [str(v).rjust(widths[j + 1]) for j, v in enumerate(r[1:-1])]
        lines.append("  ".join(cells + [str(r[-1])]).rstrip())
        if i == 0:
            lines.append("-" * (sum(widths) + 2 * (len(widths) - 1)))
    for label, reason in skipped:
        lines.append(f"{label}: skipped ({reason})")
    warnings = sorted({w for _, est in rows for w in est.warnings})
    lines.extend(f"warning: {w}" for w in warnings)
    return "\n".join(lines)


def _format_inputs(inputs: dict) -> str:
    parts = []
    for key, value in inputs.items():
        if isinstance(value, dict):
            continue
        parts.append(f"{key}={value:g}" if isinstance(value, float) else f"{key}={value}")
    return ", ".join(parts)


def explain(rows) -> str:
    lines = []
    for label, est in rows:
        lines.append("")
        lines.append(f"== {label}: peak {gib(est.peak_bytes)} GiB in {est.peak_phase} "
                     f"(+{gib(est.overhead_bytes)} GiB overhead)")
        for phase in PHASES:
            cats = est.phases[phase]
            lines.append(f"  {phase:<10} " + "  ".join(f"{_SHORT[c]} {gib(cats[c])}" for c in CATEGORIES)
                         + f"  = {gib(est.phase_total(phase))}")
        for term in est.terms:
            lines.append(f"  {term.name} = {gib(term.bytes)} GiB  [{term.formula}]")
            detail = _format_inputs(term.inputs)
            if detail:
                lines.append(f"      inputs: {detail}")
            tensors = term.inputs.get("tensors") if isinstance(term.inputs, dict) else None
            if tensors:
                shown = ", ".join(f"{k} {v[0] if isinstance(v, list) else v:g}"
                                  + (f"+{v[1]:g}*s" if isinstance(v, list) and v[1] else "")
                                  for k, v in tensors.items())
                lines.append(f"      bytes/token: {shown}")
            if term.source:
                lines.append(f"      source: {term.source}")
        for note in est.assumptions:
            lines.append(f"  assumes: {note}")
        if est.host:
            lines.append("  host RAM per rank: " + ", ".join(f"{k} {gib(v)} GiB" for k, v in est.host.items()))
        if est.nvme_bytes:
            lines.append(f"  NVMe per rank: {gib(est.nvme_bytes)} GiB")
    return "\n".join(lines)


def estimate_dict(est, gpu, with_terms: bool = False) -> dict:
    out = {
        "strategy": est.strategy,
        "phases": {p: {c: int(est.phases[p][c]) for c in CATEGORIES} for p in PHASES},
        "category_peak": {c: int(est.category_peak(c)) for c in CATEGORIES},
        "overhead": {k: int(est.overhead.get(k, 0)) for k in OVERHEADS},
        "peak_bytes": int(est.peak_bytes),
        "device_peak_bytes": int(est.device_peak_bytes),
        "peak_phase": est.peak_phase,
        "peak_category": est.peak_category,
        "host": {k: int(v) for k, v in est.host.items()},
        "host_bytes": int(sum(est.host.values())),
        "nvme_bytes": int(est.nvme_bytes),
        "fits": fits(est, gpu),
        "headroom_bytes": int(gpu.memory_bytes - est.device_peak_bytes),
        "assumptions": list(est.assumptions),
        "warnings": list(est.warnings),
    }
    if with_terms:
        out["terms"] = [{"name": t.name, "bytes": int(t.bytes), "formula": t.formula,
                         "inputs": _jsonable(t.inputs), "source": t.source} for t in est.terms]
    return out


def _jsonable(value):
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, (int, float, str, bool)) or value is None:
        return value
    return str(value)


def document(plan, gpu, rows, accounting: str, device: str, checkpoint: str, skipped=(),
             with_terms: bool = False) -> dict:
    return {
        "schema_version": SCHEMA_VERSION,
        "units": "bytes per rank",
        "plan": _jsonable(plan.to_dict()),
        "gpu": {"name": gpu.name, "memory_bytes": int(gpu.memory_bytes)},
        "world_size": plan.cluster.nodes * plan.cluster.gpus_per_node,
        "accounting": accounting,
        "device": device,
        "checkpoint": checkpoint,
        "strategies": [estimate_dict(est, gpu, with_terms) for _, est in rows],
        "skipped": [{"strategy": label, "reason": reason} for label, reason in skipped],
    }


def to_json(doc: dict) -> str:
    return json.dumps(doc, indent=2, sort_keys=False)
