"""Third stage: search the plan space for the fastest plan that fits (analytic; no torch).

`from shardfit.fit import FitRequest, fit` (docs/fit.md) as before; the search lives in fit/search.py,
the request in fit/request.py, the step-time model in fit/steptime.py (any layout: fit/parallel_time.py).
"""
from importlib import import_module

# name -> the fit module defining it.
_EXPORTS = {"Candidate": "search", "FitRequest": "request", "FitResult": "search", "Pins": "request",
            "Rejection": "explain", "SearchOptions": "request", "StepTime": "steptime", "fit": "search",
            "step_time": "parallel_time"}
__all__ = sorted(_EXPORTS)


def __getattr__(name):
    # NOTE: resolved on first use (PEP 562), like shardfit.profile: `plan` imports fit/steptime.py for its
    # step-time column, which runs this file; importing the search here would put fit's whole search
    # (search, explain, rungs, suggest, ...) on every `plan`'s import path (benchmarks/bench_plan.py).
    if name in _EXPORTS:
        return getattr(import_module(f"shardfit.fit.{_EXPORTS[name]}"), name)
    raise AttributeError(f"module 'shardfit.fit' has no attribute {name!r}")
