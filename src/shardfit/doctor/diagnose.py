"""Doctor: read the configs (doctor/setup.py), run every rule (doctor/rules.py, doctor/source.py), list the
findings by severity."""
from __future__ import annotations

from dataclasses import dataclass, replace

from shardfit.doctor.rules import RULES, Context, Finding
from shardfit.doctor.setup import Setup, read_setup
from shardfit.doctor.source import scan_source
from shardfit.spec.gpus import get_gpu
from shardfit.spec.model_spec import ModelSpec
from shardfit.spec.models import load_model_spec

SEVERITY_ORDER = {"error": 0, "warning": 1, "info": 2}


@dataclass(frozen=True, kw_only=True)
class Report:
    setup: Setup
    files: tuple[tuple[str, str], ...]  # (path, what it was read as)
    findings: tuple[Finding, ...]
    assumed: tuple[str, ...] = ()  # facts the configs leave open or "auto", and what the rules took

    @property
    def errors(self) -> int:
        return sum(f.severity == "error" for f in self.findings)


def _model_from_setup(setup: Setup):
    if setup.model_ref is None:
        return None
    if isinstance(setup.model_ref, dict):
        return ModelSpec.from_dict(setup.model_ref)
    return load_model_spec(str(setup.model_ref))


# What plan_of takes for a fact the configs leave open (rules.plan_of), and the flag that sets it.
_DEFAULTS = {"precision": ("bf16", "--precision"), "micro_batch": (1, "--micro-batch"),
             "grad_accum": (1, "--grad-accum"), "global_batch": (None, "--global-batch"),
             "activation_checkpointing": (None, "--ac")}


def resolve_flags(setup: Setup, flags: dict) -> tuple[Setup, list[str]]:
    """Apply doctor's --precision / --micro-batch / --grad-accum / --ac over what the configs say (a flag
    wins), and list every fact taken from a flag or left "auto" and assumed."""
    changes, assumed = {}, []
    for fact, value in flags.items():
        if value is None:
            continue
        current, flag = getattr(setup, fact), _DEFAULTS[fact][1]
        if current == value:
            continue
        said = ('"auto" in the configs' if fact in setup.auto else "not in the configs" if current is None
                else f"the configs say {current}")
        changes[fact] = value
        shown = ("on" if value else "off") if isinstance(value, bool) else value
        assumed.append(f"{fact.replace('_', ' ')} {shown} from {flag} ({said})")
    for fact in setup.auto:
        if fact in changes:
            continue
        default, flag = _DEFAULTS[fact]
        taken = f"assumed {default}" if default is not None else "left unchecked"
        where = setup.origin(fact) or "a config"
        assumed.append(f'{fact.replace("_", " ")} is "auto" ({where}: the HF Trainer fills it in): {taken}; '
                       f"give {flag}")
    if changes:
        setup = replace(setup, **changes, auto=tuple(a for a in setup.auto if a not in changes))
    return setup, assumed


def diagnose(paths, ctx: Context | None = None, flags: dict | None = None) -> Report:
    """Run every rule over what the files say; findings sorted by severity, then rule. `flags`: fact ->
    value from doctor's --precision / --micro-batch / --grad-accum / --ac (None = not given)."""
    setup, kinds = read_setup(paths)
    setup, assumed = resolve_flags(setup, flags or {})
    ctx = ctx or Context()
    if ctx.model is None:
        ctx = replace(ctx, model=_model_from_setup(setup))
    if ctx.gpu is None and setup.gpu:
        ctx = replace(ctx, gpu=get_gpu(setup.gpu))
    findings: list[Finding] = []
    for rule in RULES:
        findings += rule(setup, ctx)
    for path, text in setup.sources:
        findings += scan_source(text, path)
    unique = {(f.rule, f.where, f.message): f for f in findings}
    ordered = sorted(unique.values(), key=lambda f: (SEVERITY_ORDER[f.severity], f.rule, f.where))
    return Report(setup=setup, files=tuple(kinds), findings=tuple(ordered), assumed=tuple(assumed))


__all__ = ["Context", "Finding", "Report", "diagnose"]
