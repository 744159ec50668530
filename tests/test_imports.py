"""The package's import structure, checked so that a future circle or upward import fails here, by
name, instead of hiding behind a function-local import:

- every module imports (in one fresh interpreter, in order);
- the module-level import graph has no cycle;
- no stage imports a higher one (spec -> estimate -> fit -> emit; spec -> engines -> train -> bench;
  measure beside; integrations/ above them; commands/ and cli.py on top);
- a function-local shardfit import is only there to keep torch (transformers, deepspeed, yaml,
  numpy, matplotlib) out of a module that does not need it at import time;
- the analytic stages import without torch.
"""
from __future__ import annotations

import ast
import subprocess
import sys
from functools import lru_cache
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "src" / "shardfit"
# What a function-local import may be keeping out of its module (import cost, or a GPU/driver probe).
LAZY_FOR = {"torch", "transformers", "deepspeed", "yaml", "numpy", "matplotlib", "safetensors", "accelerate",
            "lightning", "peft", "bitsandbytes"}
# stage -> the stages it may import (besides itself). Root leaf modules count as their own stage.
LEAVES = {"errors", "units", "runtime_env", "checksums", "sac"}
ALLOWED = {
    "errors": set(),
    "units": set(), "runtime_env": set(), "checksums": {"errors"}, "sac": {"errors"},
    "launcher": {"errors", "runtime_env"},
    "data": {"errors"},
    "spec": {"errors", "units"},
    "estimate": {"spec", *LEAVES},
    "fit": {"estimate", "spec", *LEAVES},
    "emit": {"fit", "estimate", "spec", *LEAVES},
    "doctor": {"emit", "fit", "estimate", "spec", *LEAVES},
    "modeling": {"spec", *LEAVES},
    "engines": {"modeling", "spec", "data", *LEAVES},
    "measure": {"engines", "modeling", "fit", "estimate", "spec", "data", "launcher", *LEAVES},
    "train": {"measure", "engines", "modeling", "fit", "estimate", "spec", "data", "launcher", *LEAVES},
    "bench": {"train", "measure", "engines", "modeling", "fit", "estimate", "spec", "data", "launcher", *LEAVES},
    # on top of every stage but the shell: callbacks inside the user's own trainer
    "integrations": {"doctor", "bench", "train", "measure", "engines", "modeling", "emit", "fit", "estimate", "spec",
                     "data", "launcher", *LEAVES},
    "__init__": {"measure"},  # shardfit.profile, lazily
}


def _module_name(path: Path) -> str:
    parts = ("shardfit", *path.relative_to(PACKAGE).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_module_name(path): path for path in sorted(PACKAGE.rglob("*.py"))}


def _stage(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


@lru_cache(maxsize=None)
def _imports(module: str) -> tuple[tuple[str, int, bool], ...]:
    """(imported name, line, at module level) for every import in the module; `from shardfit.x import y`
    counts as an import of shardfit.x.y when that is a module. An import inside a top-level `if` or
    `try` counts as module level."""
    tree = ast.parse(MODULES[module].read_text())
    top = set()
    for node in tree.body:
        top.update(id(n) for n in ast.walk(node) if isinstance(node, (ast.If, ast.Try)) or n is node)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names
                                     if f"{node.module}.{a.name}" in MODULES]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        else:
            continue
        found += [(name, node.lineno, id(node) in top) for name in names]
    return tuple(found)


def _internal_module_level(module: str) -> set[str]:
    """The shardfit modules importing `module` runs: its module-level imports, and the packages above
    each of them (importing shardfit.a.b runs shardfit/a/__init__.py first)."""
    out = set()
    for name, _, at_top in _imports(module):
        if at_top and name in MODULES and name != module:
            parts = name.split(".")
            out.update(".".join(parts[:i]) for i in range(2, len(parts) + 1))
    # The importing module's own packages are initialised before it runs: not an edge.
    own_packages = {".".join(module.split(".")[:i]) for i in range(1, module.count(".") + 2)}
    return (out & set(MODULES)) - own_packages


@lru_cache(maxsize=None)
def _loads(module: str, seen: frozenset = frozenset()) -> frozenset:
    """The LAZY_FOR libraries that importing `module` imports."""
    own = {name.split(".")[0] for name, _, at_top in _imports(module) if at_top} & LAZY_FOR
    for dependency in _internal_module_level(module) - seen - {module}:
        own |= _loads(dependency, seen | {module})
    return frozenset(own)


def test_every_module_imports_in_one_interpreter():
    names = sorted(set(MODULES) - {"shardfit.__main__"})  # importing it runs the CLI
    code = "import importlib, sys\nfor name in sys.argv[1:]:\n    importlib.import_module(name)\n"
    done = subprocess.run([sys.executable, "-c", code, *names], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]


def test_module_level_imports_have_no_cycle():
    graph = {module: _internal_module_level(module) for module in MODULES}
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(module: str, path: list[str]) -> list[str] | None:
        state[module] = 1
        for dependency in sorted(graph[module]):
            if state.get(dependency) == 1:
                return path[path.index(dependency):] + [dependency] if dependency in path else [module, dependency]
            if dependency not in state:
                cycle = visit(dependency, path + [dependency])
                if cycle:
                    return cycle
        state[module] = 2
        return None

    for module in sorted(graph):
        if module not in state:
            cycle = visit(module, [module])
            assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_no_stage_imports_a_higher_one():
    upward = []
    for module in MODULES:
        stage = _stage(module)
        if stage in ("commands", "cli", "__main__"):
            continue  # the shell on top may call any stage
        for name, line, _ in _imports(module):
            if not name.startswith("shardfit.") or name not in MODULES:
                continue
            target = _stage(name)
            if target != stage and target not in ALLOWED[stage]:
                upward.append(f"{MODULES[module].relative_to(PACKAGE.parent)}:{line}: {stage} imports {name}")
    assert not upward, "\n".join(upward)


def test_function_local_imports_only_keep_heavy_libraries_out():
    needless = []
    for module in set(MODULES) - {"shardfit"}:  # shardfit.profile: a lazy attribute, so `import shardfit` stays light
        for name, line, at_top in _imports(module):
            if at_top or name not in MODULES:
                continue
            if not (_loads(name) - _loads(module)):
                needless.append(f"{MODULES[module].relative_to(PACKAGE.parent)}:{line}: {name} imports none of "
                                f"{sorted(LAZY_FOR)} that {module} does not already: import it at module level")
    assert not needless, "\n".join(needless)


@pytest.mark.parametrize("modules", [
    "shardfit.fit.search, shardfit.bench.run, shardfit.spec.models",
    "shardfit.estimate.estimator, shardfit.emit, shardfit.doctor.diagnose, shardfit.measure.verify, shardfit.measure.run, "
    "shardfit.launcher, shardfit.commands.plan, shardfit.commands.fit, shardfit.commands.profile",
])
def test_the_analytic_path_imports_without_torch(modules):
    code = f"import sys; import {modules}; assert 'torch' not in sys.modules, 'torch imported'"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]


def test_plan_imports_only_what_a_plan_needs():
    """`shardfit plan` (a preset runs the same code as a cached config) needs the estimator, the
    step-time model and doctor's config readers (--deepspeed ds.json), not fit's search nor doctor's
    rules: every module more is import time on each `plan` (benchmarks/bench_plan.py: a cached plan
    in < 0.2 s). The package __init__ files of fit and doctor import nothing for this reason."""
    unneeded = ("shardfit.fit.search", "shardfit.fit.explain", "shardfit.doctor.rules", "shardfit.doctor.source",
                "shardfit.doctor.diagnose", "torch", "transformers")
    code = ("import sys; from shardfit.cli import main\n"
            "try: main(['plan', 'tiny-llama', '--gpus', '2'])\nexcept SystemExit as e: assert not e.code, e.code\n"
            f"print(sorted(m for m in sys.modules if m in {unneeded!r}))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().splitlines()[-1] == "[]"
