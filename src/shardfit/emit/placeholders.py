"""Hyperparameters an emitted file carries but nobody chose: said loudly, never passed off as a choice.

The Plan's schedule has defaults (lr 3e-4, 50 steps, 5 warm-up, cosine to 10%) so that `shardfit train`
runs out of the box on a tiny model. Written into a config for a real model they would read as a
recommendation; shardfit does not pick learning rates. A schedule field still at its default is a
placeholder: every text file gets a `TODO(set me)` comment at the top, JSON (which has no comments)
keeps the value, and the command prints the same line as a warning.
"""
from __future__ import annotations

from dataclasses import replace

from shardfit.spec.plan import Plan, Schedule

MARK = "TODO(set me)"
_DEFAULT = Schedule()
_COMMENTED = (".py", ".yaml", ".yml", ".sh", ".sbatch")


def placeholder_fields(plan: Plan) -> list[str]:
    """The schedule's learning-rate and length settings still at shardfit's defaults, in words."""
    s = plan.schedule
    out = []
    if s.lr == _DEFAULT.lr:
        out.append(f"learning rate {s.lr:g}")
    if s.steps == _DEFAULT.steps:
        out.append(f"a {s.steps}-step cosine schedule ({s.warmup_steps} warm-up, down to {s.min_lr_ratio:g} x lr)")
    return out


def placeholder_line(plan: Plan) -> str | None:
    fields = placeholder_fields(plan)
    if not fields:
        return None
    return (f"{MARK}: {' and '.join(fields)} are shardfit's placeholders, not chosen for {plan.model.name}: set "
            "schedule.lr / schedule.steps / schedule.warmup_steps in the plan (or `fit --steps`) and emit again")


def _commented(name: str, text: str, line: str) -> str:
    comment = f"# {line}\n"
    if text.startswith("#!"):
        first, _, rest = text.partition("\n")
        return f"{first}\n{comment}{rest}"
    return comment + text


def mark_placeholders(emitted, plan: Plan):
    """`emitted` with the placeholder line on top of each text file and as a note."""
    line = placeholder_line(plan)
    if line is None:
        return emitted
    files = {name: (_commented(name, text, line) if name.endswith(_COMMENTED) else text)
             for name, text in emitted.files.items()}
    return replace(emitted, files=files, notes=emitted.notes + (line,))
