"""`shardfit train`'s flags as plain values: commands/train.py reads them from argparse, train/launch.py
and train/supervise.py take them from here (no argparse namespace below commands/)."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, kw_only=True)
class TrainFlags:
    plan: str | None = None  # the plan file (None: the quick defaults, or the checkpoint's plan on a resume)
    out: str | None = None
    resume: str | None = None
    model: str | None = None
    strategy: str | None = None
    shard_group_size: int | None = None
    tp: int | None = None  # parallelism.tp: FSDP2 x TP on a 2-D (dp, tp) mesh
    pp: int | None = None  # parallelism.pp: the pipeline engine (engines/pipeline.py)
    pp_schedule: str | None = None  # parallelism.pp_schedule (a V schedule: pp_virtual_stages 2)
    # Plan fields set from the command line (train/launch.py PLAN_FLAGS says where each goes).
    micro_batch: int | None = None
    seq: int | None = None
    grad_accum: int | None = None
    precision: str | None = None
    ac: str | None = None
    steps: int | None = None
    lr: float | None = None
    seed: int | None = None
    log_every: int | None = None
    eval_every: int | None = None
    save_every: int | None = None
    keep: int | None = None
    nan_policy: str | None = None
    save_mode: str | None = None
    on_save_error: str | None = None
    data: str | None = None
    tokenizer: str | None = None
    loss: str | None = None
    optimizer_impl: str | None = None
    lora_r: int | None = None
    lora_targets: str | None = None
    lora_base: str | None = None
    # The launch.
    nproc: int | None = None
    nnodes: int = 1
    node_rank: int = 0
    rdzv_endpoint: str | None = None
    max_restarts: int | None = None
    memory_budget: float | None = None
    collective_timeout: float | None = None
    stop_signals: str | None = None
