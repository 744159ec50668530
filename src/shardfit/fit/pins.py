"""Pinned knobs: `fit --ac / --micro-batch / --strategy` fix what fit would otherwise search, and fit
searches the rest. A pin that makes nothing fit is one line that names it and what fits without it."""
from __future__ import annotations

from dataclasses import replace

from shardfit.errors import ShardfitError
from shardfit.fit.families import NVME_PLACEHOLDER, Family, engine_of
from shardfit.units import fmt_bytes
from shardfit.spec.plan import is_selective_ac, parse_activation_checkpointing, parse_strategy

PIN_FLAGS = (("ac", "--ac"), ("micro_batch", "--micro-batch"), ("strategy", "--strategy"))


def pinned(request) -> list[str]:
    """The pins a request carries, as flags with their values (`--ac full`)."""
    return [f"{flag} {request.knob(name)}" for name, flag in PIN_FLAGS if request.knob(name) is not None]


def pin_ac(request, ac_options: tuple[str, ...], selective: bool) -> tuple[str, ...]:
    if request.pins.ac is None:
        return ac_options
    parse_activation_checkpointing(request.pins.ac)  # a bad value fails here, in one line
    if is_selective_ac(request.pins.ac) and not selective:
        raise ShardfitError(f"--ac {request.pins.ac}: per-op selective checkpointing needs the model's block shapes, which "
                            f"{request.base.model.name} does not have: use none, full or every-N")
    return (request.pins.ac,)


def pin_micro_batch(request, micro_options: list[int], per_rank: int) -> list[int]:
    if request.pins.micro_batch is None:
        return micro_options
    if request.pins.micro_batch < 1 or per_rank % request.pins.micro_batch:
        fitting = ", ".join(str(d) for d in range(1, per_rank + 1) if per_rank % d == 0)
        raise ShardfitError(f"--micro-batch {request.pins.micro_batch} does not divide the {per_rank} sequences per GPU "
                            f"(global batch over {request.base.cluster.world_size} GPUs): use one of {fitting}, or change "
                            "--global-batch")
    return [request.pins.micro_batch]


def pin_strategy(request, families: list[Family]) -> list[Family]:
    """The one family the pinned strategy is: a family fit knows, or the strategy as given."""
    if request.pins.strategy is None:
        return families
    strategy = parse_strategy(request.pins.strategy)
    if "nvme" in (strategy.offload_params, strategy.offload_optimizer):
        strategy = replace(strategy, nvme_path=request.options.nvme_path or NVME_PLACEHOLDER)
    engine = engine_of(strategy)
    if engine not in request.options.engines:
        raise ShardfitError(f"--strategy {request.pins.strategy} is a {engine} plan but --engine {','.join(request.options.engines)} "
                            f"leaves {engine} out: add it to --engine, or drop one of the two")
    for fam in families:
        if fam.strategy == strategy:
            return [fam]
    if strategy.kind == "single" and request.base.cluster.world_size != 1:
        raise ShardfitError(f"--strategy single runs on one GPU, not {request.base.cluster.world_size}: use --gpus 1, or a "
                            "data-parallel strategy (ddp, fsdp2, zero3, ...)")
    tier = 2 if "nvme" in strategy.label else (1 if "offload" in strategy.label else 0)
    return [Family(strategy.label, strategy, 0, tier)]


def pin_error(request, result, fit) -> ShardfitError | None:
    """When the pins are what makes nothing fit: one line naming the pin and what fits without it (found by
    fitting again with each pin dropped alone, then all). None when nothing fits without the pins either."""
    pins = [(name, flag) for name, flag in PIN_FLAGS if request.knob(name) is not None]
    if not pins:
        return None
    leanest = min((peak for peak, _ in result.smallest.values()), default=None)
    head = (f"nothing fits with {' '.join(pinned(request))} pinned"
            + (f" (the leanest pinned plan needs {fmt_bytes(leanest)} per GPU > {fmt_bytes(result.usable_bytes)} "
               "usable)" if leanest is not None and leanest < 2**61 else ""))
    tries = [[p] for p in pins] + ([pins] if len(pins) > 1 else [])
    for dropped in tries:
        try:
            other = fit(request.with_changes(**{name: None for name, _ in dropped}))
        except ShardfitError:
            continue  # the pins left in still make nothing fit
        if other.best is not None:
            t = other.best.plan.training
            flags = " and ".join(flag for _, flag in dropped)
            it = "it" if len(dropped) == 1 else "them"
            return ShardfitError(f"{head}: drop {flags} -- without {it} {other.best.family} fits with micro-batch "
                                 f"{t.micro_batch}, AC {t.activation_checkpointing} ({fmt_bytes(other.best.peak_bytes)} "
                                 "per GPU)")
    return None
