"""Text and JSON renderings of a FitResult: the one place `fit` output is formatted."""
from __future__ import annotations

import dataclasses

from shardfit.fit.host import needs_text, over_assumed
from shardfit.fit.layouts import LAYOUT_PREFIX
from shardfit.spec.parallelism import resolve
from shardfit.units import fmt_bytes
from shardfit.spec.kernels import loss_label


def _s(seconds: float) -> str:
    return f"{seconds:.2f} s" if seconds >= 0.1 else f"{seconds * 1000:.2f} ms"


def _step(c, world: int, gpu) -> str:
    t = c.time
    return (f"{_s(t.total_s)}/step (compute {_s(t.compute_s)}, communication {_s(t.exposed_comm_s)} exposed of "
            f"{_s(t.comm_s)}, offload {_s(t.offload_s)}, optimizer {_s(t.optimizer_s)}"
            + (f", engine hooks {_s(t.host_s)}" if t.host_s else "")
            + (f", pipeline bubble {_s(t.bubble_s)}" if t.bubble_s else "") + "); "
            f"{t.tokens_per_s(world):,.0f} tokens/s, MFU {t.mfu(gpu):.0%}")


def format_text(result) -> str:
    r = result.request
    base = r.base
    cluster, lora = base.cluster, base.training.lora
    world = cluster.world_size
    lines = [f"fit {base.model.name} on {cluster.world_size} x {result.gpu.name} ({cluster.nodes} "
             f"node{'s' if cluster.nodes > 1 else ''} x {cluster.gpus_per_node}), seq {base.training.seq_len}"
             + (f", LoRA r={lora.rank} ({lora.base_dtype} base)" if lora else "")]
    lines += [f"  {note}" for note in result.notes]
    lines.append("")
    if result.best is None:
        lines.append("NOTHING FITS")
        lines += [f"  {s}" for s in result.suggestions]
    else:
        b = result.best
        t = b.plan.training
        lines.append(f"best: {b.family}: micro-batch {t.micro_batch} x accumulation {t.grad_accum}, activation "
                     f"checkpointing {t.activation_checkpointing}, {t.precision}, loss {loss_label(t.loss, t.loss_chunks)}, "
                     f"optimizer step {t.optimizer_impl}")
        if not b.plan.parallelism.is_default:
            lines.append(f"  layout {resolve(b.plan).describe()} (world {cluster.world_size})")
        lines.append(f"  memory {fmt_bytes(b.peak_bytes)} per GPU of {fmt_bytes(result.usable_bytes)} usable; "
                     f"{needs_text(b.host_bytes, b.nvme_bytes, r, result.gpu)}")
        if result.largest_term:
            name, size = result.largest_term
            lines.append(f"  largest non-state term: {name} {fmt_bytes(size)}")
        lines.append(f"  time   {_step(b, world, result.gpu)}")
        if result.alternatives:
            lines += ["", "alternatives:"]
            rows = [("plan", "per GPU", "host RAM/node", "step", "vs best")]
            for c in result.alternatives:
                host = fmt_bytes(c.host_bytes) if c.host_bytes else "-"
                host += " (!)" if over_assumed(c.host_bytes, r, result.gpu) else ""
                rows.append((c.label, fmt_bytes(c.peak_bytes), host, _s(c.time.total_s),
                             f"x{c.time.total_s / b.time.total_s:.2f}"))
            widths = [max(len(row[i]) for row in rows) for i in range(5)]
            for row in rows:
                lines.append("  " + "  ".join(cell.ljust(w) if i == 0 else cell.rjust(w)
                                              for i, (cell, w) in enumerate(zip(row, widths))))
            if any(over_assumed(c.host_bytes, r, result.gpu) for c in result.alternatives):
                lines.append("  (!) needs more host RAM than the assumed per node: give --host-memory-gib")
    if result.rejected:
        lines += ["", "why not the others:"]
        lines += _rejection_lines(result.rejected)
    lines.append(f"\n({result.estimates} plans estimated)")
    return "\n".join(lines)


def _rejection_lines(rejected) -> list[str]:
    """One line per family; the tp x pp x cp layouts that do not fit share one line (there can be
    dozens: fit/layouts.py), each with its leanest plan's memory. JSON keeps every reason."""
    lines, lean = [], []
    for x in rejected:
        if x.family.startswith(LAYOUT_PREFIX) and x.reason.startswith("does not fit: "):
            lean.append(f"{x.family[len(LAYOUT_PREFIX):]} ({x.reason.split(' at ')[0][len('does not fit: '):]})")
        else:
            lines.append(f"  {x.family}: {x.reason}")
    if lean:
        lines.append(f"  {LAYOUT_PREFIX}layouts that do not fit at micro-batch 1 with full checkpointing: " + ", ".join(lean))
    return lines


def _candidate(c, world, gpu) -> dict:
    t = c.time
    return {"family": c.family, "strategy": c.plan.strategy.label, "micro_batch": c.plan.training.micro_batch,
            "grad_accum": c.plan.training.grad_accum, "activation_checkpointing": c.plan.training.activation_checkpointing,
            "precision": c.plan.training.precision, "loss": c.plan.training.loss,
            "loss_chunks": c.plan.training.loss_chunks, "optimizer_impl": c.plan.training.optimizer_impl,
            "optimizer": c.plan.training.optimizer, "rung": c.rung or None,
            "peak_bytes": c.peak_bytes,
            "host_bytes_per_node": c.host_bytes, "nvme_bytes_per_node": c.nvme_bytes,
            "step_s": round(t.total_s, 6), "compute_s": round(t.compute_s, 6), "comm_s": round(t.comm_s, 6),
            "exposed_comm_s": round(t.exposed_comm_s, 6), "offload_s": round(t.offload_s, 6),
            "optimizer_s": round(t.optimizer_s, 6), "host_s": round(t.host_s, 6), "bubble_s": round(t.bubble_s, 6),
            "parallelism": dataclasses.asdict(c.plan.parallelism), "tokens_per_s": round(t.tokens_per_s(world), 1),
            "mfu": round(t.mfu(gpu), 4)}


def to_json(result) -> dict:
    world = result.request.base.cluster.world_size
    return {"fits": result.fits, "gpu": result.gpu.name, "usable_bytes": result.usable_bytes,
            "best": _candidate(result.best, world, result.gpu) if result.best else None,
            "plan": result.best.plan.to_dict() if result.best else None,
            "alternatives": [_candidate(c, world, result.gpu) for c in result.alternatives],
            "rejected": [{"family": x.family, "reason": x.reason} for x in result.rejected],
            "largest_term": ({"name": result.largest_term[0], "bytes": result.largest_term[1]}
                             if result.largest_term else None),
            "notes": list(result.notes), "suggestions": list(result.suggestions), "estimates": result.estimates}
