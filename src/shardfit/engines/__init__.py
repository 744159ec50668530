"""Five engines, one interface: `setup(plan, model, ctx) -> Engine` (see base.Engine)."""
from __future__ import annotations

import importlib

from shardfit.errors import ShardfitError

MODULES = {"single": "single", "ddp": "ddp", "fsdp": "fsdp", "fsdp2": "fsdp2", "zero1": "deepspeed", "zero2": "deepspeed",
           "zero3": "deepspeed"}


def engine_module(kind: str):
    if kind not in MODULES:
        raise ShardfitError(f"no engine for strategy '{kind}': use one of {', '.join(MODULES)}")
    return importlib.import_module(f"shardfit.engines.{MODULES[kind]}")


def setup(plan, model, ctx):
    """Wrap `model` (built on CPU with the plan's seed, so every engine starts from the same weights)."""
    if plan.parallelism.pp > 1:  # a pipeline stage per rank (engines/pipeline.py), whatever the strategy
        return importlib.import_module("shardfit.engines.pipeline").setup(plan, model, ctx)
    return engine_module(plan.strategy.kind).setup(plan, model, ctx)
