"""An existing setup -> a Plan: what `plan --from-...`, `fit --from-...` and the trainer callbacks size.

The files are read by doctor's reader (`shardfit.doctor.setup`: DeepSpeed JSON, Accelerate YAML,
TrainingArguments JSON), the strategy is doctor's mapping (`doctor.setup.setup_strategy`), so plan, fit,
doctor and the callbacks all see a configuration the same way. What the files leave open or "auto"
is taken from the arguments, else assumed, and every assumption is listed.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from shardfit.doctor.setup import Setup, read_file, read_setup, setup_strategy
from shardfit.errors import ShardfitError
from shardfit.spec.plan import Cluster, Plan, Strategy, Training, validate_plan

DEFAULT_SEQ = 2048


@dataclass(frozen=True, kw_only=True)
class SetupPlan:
    plan: Plan
    assumed: tuple[str, ...] = ()  # facts not in the setup, and what was taken for them
    files: tuple[tuple[str, str], ...] = ()  # (path, kind) read


def _strategy_of(setup: Setup, world: int) -> Strategy:
    strategy = setup_strategy(setup) if setup.engine is not None else None
    if strategy is None:
        return Strategy(kind="ddp" if world > 1 else "single")
    if strategy.kind == "single" and world > 1:
        return Strategy(kind="ddp")
    return strategy


def plan_from_setup(setup: Setup, model, *, base: Plan | None = None, world_size: int | None = None,
                    nodes: int | None = None, gpu: str | None = None, seq_len: int | None = None,
                    micro_batch: int | None = None, attention: str | None = None) -> SetupPlan:
    """The Plan a setup describes. Keyword arguments are facts known from elsewhere (the running
    job, command-line flags): they win over the files. `base` supplies everything else (a plan
    file's schedule, data, cluster GPU)."""
    assumed: list[str] = []
    base = base or Plan(model=model)
    world = world_size or setup.world_size
    if not world:
        world = base.cluster.world_size if base is not None else 1
        assumed.append(f"world size not in the setup: {world} (give --gpus)")
    nodes = nodes or setup.nodes or 1
    if world % nodes:
        nodes = 1
    seq = seq_len or setup.seq_len
    if not seq:
        seq = base.training.seq_len or DEFAULT_SEQ
        assumed.append(f"sequence length not in the setup: {seq} tokens (give --seq)")
    micro = micro_batch or setup.micro_batch
    if not micro:
        micro = base.training.micro_batch
        said = '"auto"' if "micro_batch" in setup.auto else "not given"
        assumed.append(f"micro-batch {said}: {micro} (give --micro-batch / per_device_train_batch_size)")
    accum = setup.grad_accum
    if not accum:
        accum = base.training.grad_accum
        if "grad_accum" in setup.auto:
            assumed.append(f'gradient accumulation "auto": {accum} (give --grad-accum)')
    precision = setup.precision if setup.precision in ("bf16", "fp16", "fp32") else None
    if precision is None:
        precision = base.training.precision
        said = '"auto"' if "precision" in setup.auto else "not given"
        assumed.append(f"precision {said}: {precision} (give --precision)")
    ac = setup.activation_checkpointing
    training = replace(base.training, micro_batch=micro, grad_accum=accum, seq_len=seq, precision=precision,
                       loss_scaling=setup.loss_scaling if precision == "fp16" else None,
                       optimizer=setup.optimizer or base.training.optimizer,
                       activation_checkpointing="full" if ac else ("none" if ac is False else
                                                                   base.training.activation_checkpointing),
                       attention=attention or base.training.attention)
    cluster = replace(base.cluster, nodes=nodes, gpus_per_node=world // nodes, gpu=gpu or setup.gpu or base.cluster.gpu)
    plan = replace(base, model=model, strategy=_strategy_of(setup, world), training=training, cluster=cluster)
    validate_plan(plan)
    return SetupPlan(plan=plan, assumed=tuple(assumed))


def plan_from_files(paths, model, **known) -> SetupPlan:
    """Read TrainingArguments JSON / Accelerate YAML / DeepSpeed JSON files (one run, merged) into a Plan."""
    paths = [p for p in paths if p]
    if not paths:
        raise ShardfitError("no setup file given: pass --from-trainer-args, --from-accelerate-config or --deepspeed")
    setup, kinds = read_setup(paths)
    result = plan_from_setup(setup, model, **known)
    return replace(result, files=tuple(kinds), assumed=tuple(_auto_notes(setup)) + result.assumed)


def _auto_notes(setup: Setup) -> list[str]:
    return [f'{fact.replace("_", " ")} is "auto" in {setup.origin(fact) or "a config"} (the Trainer fills it in)'
            for fact in setup.auto if fact not in ("micro_batch", "grad_accum", "precision")]


def check_kind(path: str, expected: tuple[str, ...], flag: str) -> None:
    """A file given to --from-trainer-args must be read as TrainingArguments, and so on: one line otherwise."""

    kind, _ = read_file(path)
    if kind not in expected:
        raise ShardfitError(f"{flag} {path}: this file reads as {kind}, not {' or '.join(expected)}: "
                            "pass it to the matching flag (--from-trainer-args, --from-accelerate-config, --deepspeed)")
