"""What `fit` is asked: a base Plan (model, cluster, sequence, LoRA, optimizer, and the schedule / data it
carries into the result) plus the search's knobs: what the user pinned and how wide to search."""
from __future__ import annotations

from dataclasses import dataclass, field, replace

from shardfit.fit.rungs import RUNG_NAMES
from shardfit.spec.gpus import GPU
from shardfit.spec.kernels import DEFAULT_LOSS_CHUNKS
from shardfit.spec.model_spec import ModelSpec
from shardfit.spec.plan import LoRA, Plan

ENGINES = ("single", "ddp", "deepspeed", "fsdp")


@dataclass(frozen=True, kw_only=True)
class Pins:
    """Knobs fixed by the user (fit/pins.py); None: fit chooses."""
    precision: str | None = None  # None = bf16 where supported, else fp16 with loss scaling
    loss: str | None = None  # standard | chunked (--loss); None = fit tries chunked where it makes a plan fit
    optimizer_impl: str | None = None  # auto | foreach | single | fused; None = fit chooses (fit/kernels.py)
    ac: str | None = None  # activation checkpointing: none, selective, full, every-N
    micro_batch: int | None = None
    strategy: str | None = None  # a strategy label, as `plan --strategy` takes it


@dataclass(frozen=True, kw_only=True)
class SearchOptions:
    """How wide the search goes and what it answers to."""
    global_batch: int | None = None  # sequences per optimizer step; None = 4 per GPU
    margin: float = 0.10
    engines: tuple[str, ...] = ENGINES  # single: searched on one GPU only
    device: str = "cuda"  # "cpu": compare tensor bytes only (no CUDA context, NCCL or allocator rounding)
    nvme_path: str | None = None  # the NVMe mount for ZeRO-Infinity plans
    top: int = 3
    device_profile: GPU | None = None  # calibrated rates (--device-profile); memory and plans still name the GPU
    # State rungs (fit/rungs.py) fit may climb before offload; the CLI drops one whose knob is pinned.
    rungs: tuple[str, ...] = RUNG_NAMES
    # tp x pp x cp layouts (fit/layouts.py) beside data parallelism; off for a trainer that runs data
    # parallel only (HF Trainer, DeepSpeed, Lightning, `shardfit train`): --data-parallel-only.
    layouts: bool = True


PIN_FIELDS = tuple(Pins.__dataclass_fields__)
OPTION_FIELDS = tuple(SearchOptions.__dataclass_fields__)
# The base Plan's fields a request names by themselves (the CLI's --seq, --lora-*, --optimizer, --gpu, ...).
TRAINING_FIELDS = ("seq_len", "lora", "optimizer", "loss_chunks")
CLUSTER_FIELDS = ("gpu", "gpus_per_node", "nodes", "host_memory_gib")


@dataclass(frozen=True, kw_only=True)
class FitRequest:
    base: Plan  # model, cluster, seq_len, lora, optimizer, loss_chunks; schedule / data carried into the result
    pins: Pins = field(default_factory=Pins)
    options: SearchOptions = field(default_factory=SearchOptions)

    @classmethod
    def build(cls, model: ModelSpec, *, gpu: str = "H100-80GB", gpus_per_node: int = 8, nodes: int = 1,
              seq_len: int = 2048, lora: LoRA | None = None, optimizer: str = "adamw",
              loss_chunks: int = DEFAULT_LOSS_CHUNKS, host_memory_gib: float | None = None,
              base: Plan | None = None, **knobs) -> FitRequest:
        """A request from flat keywords (the CLI's flags): the Plan's own fields go into `base`
        (default: a default Plan of `model`), the Pins' and SearchOptions' into theirs."""
        return cls(base=base or Plan(model=model)).with_changes(
            model=model, gpu=gpu, gpus_per_node=gpus_per_node, nodes=nodes, seq_len=seq_len, lora=lora,
            optimizer=optimizer, loss_chunks=loss_chunks, host_memory_gib=host_memory_gib, **knobs)

    def with_changes(self, **flat) -> FitRequest:
        """Replace knobs by their flat names (`seq_len`, `precision`, `margin`, ...), wherever they live."""
        groups: dict[str, dict] = {"training": {}, "cluster": {}, "pins": {}, "options": {}}
        sections = {}
        for name, value in flat.items():
            if name == "model":
                sections["model"] = value
            else:
                groups[_group(name)][name] = value
        sections.update((k, groups[k]) for k in ("training", "cluster") if groups[k])
        return replace(self, base=self.base.with_changes(**sections) if sections else self.base,
                       pins=replace(self.pins, **groups["pins"]), options=replace(self.options, **groups["options"]))

    def knob(self, name: str):
        """A knob's value by its flat name."""
        if name == "model":
            return self.base.model
        group = _group(name)
        owner = {"training": self.base.training, "cluster": self.base.cluster}.get(group) or getattr(self, group)
        return getattr(owner, name)


def _group(name: str) -> str:
    for group, names in (("training", TRAINING_FIELDS), ("cluster", CLUSTER_FIELDS), ("pins", PIN_FIELDS),
                         ("options", OPTION_FIELDS)):
        if name in names:
            return group
    raise TypeError(f"FitRequest has no knob '{name}'")
