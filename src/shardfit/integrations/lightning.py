"""`ShardfitCallback` for Lightning: the Trainer callback's twin, one line.

    from shardfit.integrations.lightning import ShardfitCallback
    trainer = L.Trainer(..., callbacks=[ShardfitCallback()])

The Plan comes from the Lightning Trainer itself: its strategy (DDP, FSDP, DeepSpeed,
ModelParallel = FSDP2), precision, accumulate_grad_batches, world size and nodes, the optimizer
configure_optimizers returned, the model's config, and the first batch's shape (micro-batch,
sequence). Fixes are said as Lightning Trainer / DataLoader arguments. Report:
`default_root_dir`/shardfit-memory.json. SHARDFIT_PROFILE=0 or enabled=False: nothing installed.
"""
from __future__ import annotations

import lightning.pytorch as pl

from shardfit.integrations.model_spec import spec_of_model
from shardfit.integrations.session import MemorySession
from shardfit.spec.plan import Cluster, Plan, Strategy, Training, validate_plan

_PRECISION = {"32-true": "fp32", "32": "fp32", "bf16-mixed": "bf16", "bf16-true": "bf16-pure", "16-mixed": "fp16",
              "16": "fp16"}
_FSDP1_SHARDING = {"FULL_SHARD": "full_shard", "SHARD_GRAD_OP": "shard_grad_op", "HYBRID_SHARD": "hybrid_shard",
                   "NO_SHARD": "no_shard", "_HYBRID_SHARD_ZERO2": "hybrid_shard"}
_OPTIMIZERS = {"adamw": "adamw", "adam": "adamw", "sgd": "sgd", "adafactor": "adafactor", "lion": "lion",
               "adamw8bit": "adamw8bit", "deepspeedcpuadam": "adamw", "fusedadam": "adamw"}


def _hf_model(pl_module):
    """The model inside a LightningModule whose forward the tracker watches: the first submodule
    with a Hugging Face config, else the LightningModule itself."""
    for module in pl_module.modules():
        config = getattr(module, "config", None)
        if module is not pl_module and hasattr(config, "to_dict") and getattr(config, "model_type", None):
            return module
    return pl_module


def lightning_strategy(trainer) -> tuple[Strategy, list[str]]:
    """The shardfit Strategy of a Lightning Trainer's strategy object."""
    from lightning.pytorch import strategies as ls

    s, notes = trainer.strategy, []
    if isinstance(s, ls.DeepSpeedStrategy):
        zero = (s.config or {}).get("zero_optimization", {})
        stage = int(zero.get("stage", 2))
        off_opt = (zero.get("offload_optimizer") or {}).get("device")
        off_par = (zero.get("offload_param") or {}).get("device") if stage == 3 else None
        off_opt = off_opt if off_opt in ("cpu", "nvme") else None
        off_par = off_par if off_par in ("cpu", "nvme") else None
        if stage == 0:
            return Strategy(kind="ddp"), notes
        return Strategy(kind=f"zero{stage}", offload_optimizer=off_opt or ("cpu" if off_par else None),
                        offload_params=off_par), notes
    if isinstance(s, ls.FSDPStrategy):
        name = getattr(s.sharding_strategy, "name", str(s.sharding_strategy)).upper()
        offload = bool(getattr(s.cpu_offload, "offload_params", False))
        return Strategy(kind="fsdp", sharding=_FSDP1_SHARDING.get(name, "full_shard"),
                        offload_params="cpu" if offload else None), notes
    if isinstance(s, ls.ModelParallelStrategy):
        notes.append("ModelParallelStrategy sized as FSDP2 (fully_shard per block, no tensor parallelism)")
        return Strategy(kind="fsdp2"), notes
    if isinstance(s, ls.DDPStrategy):
        return Strategy(kind="ddp"), notes
    return Strategy(kind="single" if trainer.world_size == 1 else "ddp"), notes


def _batch_shape(batch) -> tuple[int, int] | None:
    import torch

    if isinstance(batch, dict):
        batch = batch.get("input_ids", next(iter(batch.values()), None))
    elif isinstance(batch, (list, tuple)) and batch:
        batch = batch[0]
    if isinstance(batch, torch.Tensor) and batch.ndim >= 2:
        return int(batch.shape[0]), int(batch.shape[1])
    return None


def lightning_plan(trainer, pl_module, batch_shape=None):
    """(Plan, assumed lines) of a running Lightning Trainer."""
    strategy, assumed = lightning_strategy(trainer)
    model = _hf_model(pl_module)
    micro, seq = batch_shape or (1, 2048)
    if batch_shape is None:
        assumed.append("no batch seen yet: micro-batch 1, sequence 2048")
    precision = _PRECISION.get(str(trainer.precision), "fp32")
    if strategy.is_deepspeed and precision == "bf16-pure":
        precision = "bf16"
    optimizers = getattr(trainer, "optimizers", None) or []
    name = type(getattr(optimizers[0], "optimizer", optimizers[0])).__name__.lower() if optimizers else "adamw"
    optimizer = _OPTIMIZERS.get(name, "adamw")
    if name not in _OPTIMIZERS:
        assumed.append(f"optimizer {name} sized as AdamW")
    ac = bool(getattr(model, "is_gradient_checkpointing", False)) or bool(
        getattr(trainer.strategy, "_activation_checkpointing_kwargs", None))
    world, nodes = trainer.world_size, max(trainer.num_nodes, 1)
    import torch

    gpu = "H100-80GB"
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        gpu = f"custom:{torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory / 2**30:.2f}"
    attention = getattr(getattr(model, "config", None), "_attn_implementation", "sdpa")
    plan = Plan(model=spec_of_model(model), strategy=strategy,
                training=Training(micro_batch=micro, seq_len=seq, grad_accum=trainer.accumulate_grad_batches,
                                  precision=precision, optimizer=optimizer,
                                  activation_checkpointing="full" if ac else "none",
                                  attention=attention if attention in ("sdpa", "eager") else "sdpa"),
                cluster=Cluster(nodes=nodes if world % nodes == 0 else 1,
                                gpus_per_node=world // nodes if world % nodes == 0 else world, gpu=gpu))
    validate_plan(plan)
    return plan, assumed


def lightning_loop_terms(phases: dict) -> tuple[dict, list[str]]:
    """Lightning's automatic optimization zeroes gradients inside the closure, after training_step
    and before backward: the previous step's gradients are still live at rest and through the
    forward (measured: +1 gradient copy in forward). The estimate assumes them freed at the step."""
    grads = phases.get("optimizer", {}).get("grads", 0)
    out = {phase: dict(row) for phase, row in phases.items()}
    for phase in ("load", "forward"):
        if phase in out:
            out[phase]["grads"] = max(out[phase].get("grads", 0), grads)
    return out, ["Lightning zeroes gradients after training_step: the last step's gradients stay through "
                 "the forward (added to the prediction)"] if grads else []


class ShardfitCallback(pl.Callback):
    """steps: optimizer steps to measure. budget: bytes or a size to rehearse an OOM (default
    SHARDFIT_MEMORY_BUDGET). enabled: default on unless SHARDFIT_PROFILE=0."""

    def __init__(self, steps: int = 2, budget=None, enabled: bool | None = None):
        self.steps, self.budget, self.enabled_arg = steps, budget, enabled
        self.session: MemorySession | None = None
        self._shape = None
        self._first_step = 0

    @property
    def result(self) -> dict | None:
        return self.session.result if self.session else None

    def on_train_start(self, trainer, pl_module):
        rank0 = trainer.is_global_zero
        self.session = MemorySession(framework="lightning", steps=self.steps, out_dir=trainer.default_root_dir,
                                     budget_bytes=self.budget, enabled=self.enabled_arg,
                                     printer=(lambda text: print(text, flush=True)) if rank0 else (lambda text: None),
                                     plan_fn=lambda: lightning_plan(trainer, pl_module, self._shape),
                                     adjust_prediction=lightning_loop_terms if pl_module.automatic_optimization else None)
        if not self.session.enabled:
            return
        self._first_step = trainer.global_step
        optimizers = [getattr(o, "optimizer", o) for o in trainer.optimizers]
        self.session.start(_hf_model(pl_module), optimizers)
        engine = trainer.strategy.model
        if type(engine).__module__.startswith("deepspeed") and self.session.profiler is not None:
            # DeepSpeed runs backward and the step itself: the profiler marks its entry points.
            self.session.profiler.attach(model=engine)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if self._shape is None:
            self._shape = _batch_shape(batch)

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        # Lightning runs forward and backward inside optimizer.step(closure): the step pre-hook fires
        # before the forward, so the optimizer phase starts here, after the closure, at the update.
        if self.session is not None and self.session.profiler is not None:
            self.session.profiler.phase("optimizer")

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if self.session is not None:
            self.session.after_step(trainer.global_step - self._first_step)

    def on_train_end(self, trainer, pl_module):
        if self.session is not None:
            self.session.stop()
            self.session.close()
