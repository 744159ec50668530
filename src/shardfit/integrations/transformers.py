"""`ShardfitCallback`: shardfit inside a Hugging Face Trainer, one line.

    from shardfit.integrations.transformers import ShardfitCallback
    trainer = Trainer(model=model, args=args, train_dataset=data, callbacks=[ShardfitCallback()])

It measures the first `steps` optimizer steps on every rank by phase and category, sizes the Plan
the Trainer's own setup describes (model config, TrainingArguments with deepspeed / fsdp /
gradient_checkpointing / bf16 / optim / batch / accumulation, world size), prints measured vs
predicted with the headroom on rank 0 and writes OUTPUT_DIR/shardfit-memory.json. An
out-of-memory error on any rank prints the diagnosis and the smallest fix as TrainingArguments
fields, and every rank exits with a non-zero code. SHARDFIT_MEMORY_BUDGET=SIZE rehearses a smaller
device on a CPU; SHARDFIT_PROFILE=0 (or enabled=False) turns it all off.
"""
from __future__ import annotations

import transformers

from shardfit.doctor.setup import Setup, from_hf_args
from shardfit.integrations.model_spec import spec_of_model
from shardfit.integrations.session import MemorySession
from shardfit.integrations.setup_plan import plan_from_setup


def _optimizer_impl(args) -> str:
    optim = str(getattr(args.optim, "value", args.optim)).lower()
    return "fused" if "fused" in optim else "auto"


def trainer_plan(args, model, seq_len: int | None = None, world_size: int | None = None):
    """(Plan, assumed lines) of a Trainer's setup: TrainingArguments read by doctor's reader (the
    same one `plan --from-trainer-args` uses), the model from its config."""

    facts = from_hf_args(args.to_dict())
    known = {k: v for k, v in facts.items() if k in Setup.__dataclass_fields__ and v is not None}
    setup = Setup(**known)
    running = _running_engine()
    notes = []
    if running == "ddp" and setup.engine in ("fsdp", "fsdp2", "deepspeed"):
        # What runs is what is measured: accelerate on a CPU (use_cpu) silently drops FSDP / DeepSpeed.
        notes.append(f"TrainingArguments ask for {setup.engine} but accelerate runs {running}: sized as it runs")
        setup = Setup(**{**known, "engine": "ddp", "zero_stage": None, "offload_params": None,
                         "offload_optimizer": None})
    gpu = None
    import torch

    if torch.cuda.is_available() and torch.cuda.is_initialized():
        gpu = f"custom:{torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory / 2**30:.2f}"
    attention = getattr(getattr(model, "config", None), "_attn_implementation", None)
    result = plan_from_setup(setup, spec_of_model(model), world_size=world_size or args.world_size,
                             gpu=gpu, seq_len=seq_len, attention=attention if attention in ("sdpa", "eager") else None)
    return result.plan, tuple(notes) + result.assumed


def _running_engine() -> str | None:
    """The engine accelerate actually set up for this process (None: no Accelerator yet)."""
    try:
        from accelerate.state import AcceleratorState

        if not AcceleratorState._shared_state:
            return None
        state = AcceleratorState()
        kind = str(getattr(state.distributed_type, "value", state.distributed_type)).upper()
    except Exception:  # noqa: BLE001 - no accelerate state: trust the arguments
        return None
    if kind == "FSDP":
        return "fsdp2" if getattr(state.fsdp_plugin, "fsdp_version", 1) == 2 else "fsdp"
    return {"DEEPSPEED": "deepspeed", "MULTI_CPU": "ddp", "MULTI_GPU": "ddp", "NO": "single"}.get(kind)


class ShardfitCallback(transformers.TrainerCallback):
    """steps: optimizer steps to measure (the tracker is off after them). budget: bytes or a size
    ("7MiB") to rehearse an OOM, default SHARDFIT_MEMORY_BUDGET. enabled: default on unless
    SHARDFIT_PROFILE=0. seq_len: the sequence length to size (default: read from the first batch)."""

    def __init__(self, steps: int = 2, budget=None, enabled: bool | None = None, seq_len: int | None = None):
        self.steps, self.budget, self.enabled_arg, self.seq_len = steps, budget, enabled, seq_len
        self.session: MemorySession | None = None
        self._hook = None
        self._seen_seq: int | None = None
        self._steps_done = 0

    @property
    def result(self) -> dict | None:
        return self.session.result if self.session else None

    def on_train_begin(self, args, state, control, model=None, optimizer=None, **kwargs):
        session = MemorySession(framework="transformers", steps=self.steps, out_dir=args.output_dir,
                                budget_bytes=self.budget, enabled=self.enabled_arg, optimizer_impl=_optimizer_impl(args),
                                printer=(lambda text: print(text, flush=True)) if state.is_world_process_zero else (lambda text: None),
                                plan_fn=lambda: trainer_plan(args, model, self.seq_len or self._seen_seq))
        self.session = session
        if not session.enabled:
            return
        self._hook = model.register_forward_pre_hook(self._read_batch, with_kwargs=True)
        inner = getattr(optimizer, "optimizer", optimizer)  # accelerate's AcceleratedOptimizer wraps the torch one
        session.start(model, inner)

    def _read_batch(self, module, args, kwargs):
        ids = kwargs.get("input_ids", args[0] if args else None)
        if getattr(ids, "ndim", 0) == 2:
            self._seen_seq = int(ids.shape[1])
            self._hook.remove()
            self._hook = None

    def on_step_end(self, args, state, control, **kwargs):
        if self.session is not None:
            self._steps_done += 1  # not state.global_step: a resumed run starts past 0
            self.session.after_step(self._steps_done)

    def on_train_end(self, args, state, control, **kwargs):
        if self.session is not None:
            self.session.stop()
            self.session.close()
        if self._hook is not None:
            self._hook.remove()
            self._hook = None
