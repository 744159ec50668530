"""Doctor: read existing training configs (and scripts) and list the classic mistakes, with the fix."""
from __future__ import annotations

from dataclasses import dataclass, replace

from shardfit.doctor.rules import RULES, Context, Finding
from shardfit.doctor.setup import Setup, read_setup
from shardfit.doctor.source import scan_source

SEVERITY_ORDER = {"error": 0, "warning": 1, "info": 2}


@dataclass(frozen=True, kw_only=True)
class Report:
    setup: Setup
    files: tuple[tuple[str, str], ...]  # (path, what it was read as)
    findings: tuple[Finding, ...]

    @property
    def errors(self) -> int:
        return sum(f.severity == "error" for f in self.findings)


def _model_from_setup(setup: Setup):
    if setup.model_ref is None:
        return None
    from shardfit.spec.model_spec import ModelSpec
    if isinstance(setup.model_ref, dict):
        return ModelSpec.from_dict(setup.model_ref)
    from shardfit.spec.models import load_model_spec
    return load_model_spec(str(setup.model_ref))


def diagnose(paths, ctx: Context | None = None) -> Report:
    """Run every rule over what the files say; findings sorted by severity, then rule."""
    setup, kinds = read_setup(paths)
    ctx = ctx or Context()
    if ctx.model is None:
        ctx = replace(ctx, model=_model_from_setup(setup))
    if ctx.gpu is None and setup.gpu:
        from shardfit.spec.gpus import get_gpu
        ctx = replace(ctx, gpu=get_gpu(setup.gpu))
    findings: list[Finding] = []
    for rule in RULES:
        findings += rule(setup, ctx)
    for path, text in setup.sources:
        findings += scan_source(text, path)
    unique = {(f.rule, f.where, f.message): f for f in findings}
    ordered = sorted(unique.values(), key=lambda f: (SEVERITY_ORDER[f.severity], f.rule, f.where))
    return Report(setup=setup, files=tuple(kinds), findings=tuple(ordered))


__all__ = ["Context", "Finding", "Report", "diagnose"]
