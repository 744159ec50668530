"""shardfit in a custom Accelerate loop, one line after `accelerator.prepare(...)`:

    from shardfit.integrations.accelerate import track
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    track(accelerator, model, optimizer)          # measures the first 2 optimizer steps
    for batch in loader: ...                      # the loop as it was

The Plan is read from the Accelerator's state as the Accelerate config it would have come from
(distributed type, processes, mixed precision, FSDP / DeepSpeed plugin) through doctor's reader;
micro-batch and sequence from the first forward's input_ids; gradient accumulation from the
Accelerator. After `steps` optimizer steps every rank gathers (in the step's post-hook: every
rank steps) and rank 0 prints measured vs predicted; OOM fixes are said as Accelerator / DataLoader
/ `accelerate launch --config_file` changes. Returns the MemorySession (a context manager too).
"""
from __future__ import annotations

from pathlib import Path

from shardfit.doctor.setup import Setup, from_accelerate
from shardfit.integrations.model_spec import spec_of_model
from shardfit.integrations.session import MemorySession
from shardfit.integrations.setup_plan import plan_from_setup


def accelerate_facts(accelerator) -> dict:
    """The Accelerator's state as the Accelerate config YAML doctor's reader reads."""
    state = accelerator.state
    kind = str(getattr(state.distributed_type, "value", state.distributed_type)).upper()
    config: dict = {"distributed_type": {"MULTI_CPU": "MULTI_GPU"}.get(kind, kind),
                    "num_processes": state.num_processes,
                    "num_machines": max(state.num_processes // max(getattr(state, "local_process_count", 0) or
                                                                   state.num_processes, 1), 1),
                    "mixed_precision": str(getattr(state.mixed_precision, "value", state.mixed_precision))}
    fsdp = getattr(state, "fsdp_plugin", None)
    if kind == "FSDP" and fsdp is not None:
        offload = getattr(fsdp.cpu_offload, "offload_params", False) if fsdp.cpu_offload is not None else False
        config["fsdp_config"] = {
            "fsdp_version": fsdp.fsdp_version, "fsdp_auto_wrap_policy": "TRANSFORMER_BASED_WRAP" if fsdp.auto_wrap_policy else "NO_WRAP",
            "fsdp_sharding_strategy": getattr(fsdp.sharding_strategy, "name", "FULL_SHARD"),
            "fsdp_reshard_after_forward": fsdp.reshard_after_forward if fsdp.fsdp_version == 2 else
            getattr(fsdp.sharding_strategy, "name", "FULL_SHARD"),
            "fsdp_offload_params": bool(getattr(offload, "offload_params", offload)),
            "fsdp_activation_checkpointing": bool(fsdp.activation_checkpointing)}
    ds = getattr(state, "deepspeed_plugin", None)
    if kind == "DEEPSPEED" and ds is not None:
        config["deepspeed_config"] = {"zero_stage": ds.zero_stage,
                                      "offload_optimizer_device": ds.offload_optimizer_device or "none",
                                      "offload_param_device": ds.offload_param_device or "none"}
    return config


def accelerate_plan(accelerator, model, batch_shape=None):
    """(Plan, assumed lines) of a prepared Accelerate loop."""

    facts = from_accelerate(accelerate_facts(accelerator), Path("."))
    setup = Setup(**{k: v for k, v in facts.items() if k in Setup.__dataclass_fields__ and v is not None})
    micro, seq = batch_shape or (None, None)
    inner = accelerator.unwrap_model(model)
    attention = getattr(getattr(inner, "config", None), "_attn_implementation", None)
    result = plan_from_setup(setup, spec_of_model(inner), seq_len=seq, micro_batch=micro,
                             attention=attention if attention in ("sdpa", "eager") else None)
    plan = result.plan.with_changes(training={"grad_accum": accelerator.gradient_accumulation_steps,
                                              "activation_checkpointing": "full" if getattr(
                                                  inner, "is_gradient_checkpointing", False) else
                                              result.plan.training.activation_checkpointing})
    return plan, result.assumed


class _Tracked:
    """The hooks `track` installs: the first forward's shape, and the optimizer steps counted."""

    def __init__(self, session, model, optimizer):
        self.session, self.shape, self.done = session, None, 0
        self._hooks = [model.register_forward_pre_hook(self._read_batch, with_kwargs=True),
                       optimizer.register_step_post_hook(self._stepped)]

    def _read_batch(self, module, args, kwargs):
        ids = kwargs.get("input_ids", args[0] if args else None)
        if self.shape is None and getattr(ids, "ndim", 0) == 2:
            self.shape = (int(ids.shape[0]), int(ids.shape[1]))

    def _stepped(self, optimizer, args, kwargs):
        self.done += 1
        self.session.after_step(self.done)
        if self.session.profiler is None:
            self.remove()

    def remove(self):
        for hook in self._hooks:
            hook.remove()
        self._hooks = []


class AccelerateSession(MemorySession):
    """A MemorySession that ends its hooks with it; `with track(...):` stops it at the block's end."""

    tracked: _Tracked | None = None

    def stop(self):
        if self.tracked is not None:
            self.tracked.remove()
        return super().stop()

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        import torch

        if isinstance(exc, torch.OutOfMemoryError):
            return False  # the excepthook explains it and ends the rank
        self.stop()
        self.close()
        return False


def track(accelerator, model, optimizer, steps: int = 2, budget=None, enabled: bool | None = None,
          out_dir: str | None = None) -> AccelerateSession:
    """Measure the first `steps` optimizer steps of a prepared Accelerate loop (see the module doc).
    out_dir: where shardfit-memory.json goes (default: accelerator.project_dir or the working folder)."""
    holder: dict = {}
    inner_optimizer = getattr(optimizer, "optimizer", optimizer)
    session = AccelerateSession(
        framework="accelerate", steps=steps, budget_bytes=budget, enabled=enabled,
        out_dir=out_dir or accelerator.project_dir or ".",
        printer=(lambda text: print(text, flush=True)) if accelerator.is_main_process else (lambda text: None),
        plan_fn=lambda: accelerate_plan(accelerator, model, holder["tracked"].shape if holder else None))
    if not session.enabled:
        return session
    session.start(accelerator.unwrap_model(model), inner_optimizer)
    session.tracked = holder["tracked"] = _Tracked(session, accelerator.unwrap_model(model), inner_optimizer)
    return session
