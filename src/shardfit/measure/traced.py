"""Traced memory of one training step: run the real model's forward, backward and optimizer step on
fake tensors (torch's FakeTensorMode: shapes, dtypes and storages, no data) under MemTracker, which
sorts every live tensor storage into parameters / gradients / activations / temporaries / optimizer
state. Llama-2-7B traces in about a minute in 0.4 GB of real memory; the numbers are tensor bytes
exactly as the real step would allocate them on one rank without sharding (no allocator rounding,
CUDA context or NCCL buffers).

torch and transformers are imported inside the functions: importing this module is free.
"""
from __future__ import annotations

import warnings
from contextlib import nullcontext

from shardfit.errors import ShardfitError
from shardfit.estimate.fake_tensors import masks_as_in_eager, materialize, storage_key
from shardfit.modeling import block_classes, build_model, torch_dtype
from shardfit.spec.model_spec import ModelSpec
from shardfit.spec.models import model_spec_for
from shardfit.spec.plan import parse_activation_checkpointing, Plan

# MemTracker's categories (torch.distributed._tools.mem_tracker._MemRefType values) -> ours.
_CATEGORIES = {"Parameter": "params", "Buffer": "buffers", "Gradient": "grads", "Activation": "activations",
               "Temp": "temporaries", "Optstate": "optimizer", "Other": "other"}
_PRECISIONS = {"fp32": "fp32", "bf16": "bf16", "bf16-pure": "bf16", "fp16": "fp16"}


def _categories(snapshot: dict) -> dict:
    """One device's MemTracker snapshot -> {our category: bytes} plus total."""
    out = {ours: 0 for ours in _CATEGORIES.values()}
    total = 0
    for device_snap in snapshot.values():
        for key, value in device_snap.items():
            if key in _CATEGORIES:
                out[_CATEGORIES[key]] += int(value)
            elif key == "Total":
                total += int(value)
    out["total"] = total
    return out


class _NoHook:
    def remove(self) -> None:
        pass


_NO_HOOK = _NoHook()


def run_tracked_step(model, input_ids, optimizer=None, autocast_dtype=None) -> dict:
    """Forward (with labels = inputs), backward and optimizer step of `model` under MemTracker.
    Works on real tensors and under FakeTensorMode alike; used by trace_step and by the tests as
    the real-tensor reference."""
    import torch
    from torch.distributed._tools.mem_tracker import MemTracker, _ModState

    # parameters and buffers are held anyway: what autograd saves of them is not activation memory
    param_storages = {storage_key(t) for t in (*model.parameters(), *model.buffers())}
    saved: dict = {}
    keep = []  # saved tensors stay referenced until counted: a storage key is never reused meanwhile

    def pack(tensor):
        key = storage_key(tensor)
        if key not in param_storages and key not in saved:
            saved[key] = tensor.untyped_storage().nbytes()
            keep.append(tensor)
        return tensor

    tracker = MemTracker()
    # NOTE: MemTracker hooks every parameter's gradient and fails on frozen ones (LoRA's base);
    # a handle already present makes it skip the parameter, which never gets a gradient anyway.
    for param in model.parameters():
        if not param.requires_grad:
            tracker._param_to_grad_hook_handles[param] = (_NO_HOOK, _NO_HOOK)
    tracker.track_external(model, optimizer)
    autocast = (torch.autocast(device_type=input_ids.device.type, dtype=autocast_dtype)
                if autocast_dtype is not None else nullcontext())
    with warnings.catch_warnings(), tracker:
        # NOTE: ModTracker warns "Module is None" when a module is gone by backward (BERT): it skips
        # that module's own snapshot only; the tensor accounting is unaffected.
        warnings.filterwarnings("ignore", message="Module is None")
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor), autocast:
            loss = model(input_ids=input_ids, labels=input_ids).loss
        after_forward = _categories(tracker.get_tracker_snapshot())
        saved_bytes = sum(saved.values())
        keep.clear()
        forward_peak = _categories(tracker.get_tracker_snapshot("peak"))
        loss.backward()
        del loss
        after_backward = _categories(tracker.get_tracker_snapshot())
        backward_peaks = tracker.memory_tracking[model].snapshots.get(_ModState.PEAK_BW, [])
        backward_peak = _categories(backward_peaks[-1]) if backward_peaks else after_backward
        if optimizer is not None:
            optimizer.step()
        after_step = _categories(tracker.get_tracker_snapshot())
        step_peak = _categories(tracker.get_tracker_snapshot("peak"))
    return {"after_forward": after_forward, "saved_for_backward": saved_bytes, "forward_peak": forward_peak,
            "backward_peak": backward_peak, "after_backward": after_backward, "after_step": after_step,
            "step_peak": step_peak}


def _resolve(model_or_plan, micro_batch, seq_len, activation_checkpointing, precision, attention):
    """A Plan supplies the model and any training knob not given explicitly."""
    if isinstance(model_or_plan, Plan):
        t = model_or_plan.training
        spec = model_or_plan.model
        micro_batch = t.micro_batch if micro_batch is None else micro_batch
        seq_len = t.seq_len if seq_len is None else seq_len
        activation_checkpointing = t.activation_checkpointing if activation_checkpointing is None else activation_checkpointing
        precision = t.precision if precision is None else precision
        attention = t.attention if attention is None else attention
    elif isinstance(model_or_plan, ModelSpec):
        spec = model_or_plan
    else:
        spec = model_spec_for(str(model_or_plan))
    return (spec, micro_batch or 1, seq_len or 2048, activation_checkpointing or "none",
            precision or "bf16", attention or "sdpa")


def trace_step(model_or_plan, micro_batch: int | None = None, seq_len: int | None = None,
               activation_checkpointing: str | None = None, precision: str | None = None,
               attention: str | None = None, optimizer: bool = True, autocast: bool = False) -> dict:
    """Tensor bytes of one training step on one unsharded rank, by category and phase.

    model_or_plan: a Plan (its model and training knobs; explicit arguments override them), a
    ModelSpec, or a model reference (preset, config path, factory). precision fp32 traces an fp32
    model; bf16/bf16-pure/fp16 trace the model held in that 16-bit dtype (DeepSpeed, FSDP mixed
    precision); autocast=True instead keeps fp32 parameters under torch.autocast (DDP's way, which
    also saves a 16-bit copy of each weight for backward). The optimizer is AdamW (foreach=False)
    over the trained parameters: a Plan with LoRA gets the engines' own adapters (apply_lora).

    Returns {"bytes": {params, buffers, grads, activations, temporaries, optimizer}, ...} where
    activations are the forward's tensors still alive when backward starts (saved for backward plus
    the logits and loss), temporaries the backward peak's temporaries (activation gradients), and
    forward_peak / backward_peak / step_peak the largest totals of each phase.
    """
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode

    spec, micro_batch, seq_len, ac, precision, attention = _resolve(
        model_or_plan, micro_batch, seq_len, activation_checkpointing, precision, attention)
    if precision not in _PRECISIONS:
        raise ShardfitError(f"precision '{precision}' is not supported: use one of {', '.join(_PRECISIONS)}")
    if spec.num_experts:
        raise ShardfitError(f"{spec.name}: a mixture-of-experts step routes tokens data-dependently and cannot be traced "
                            f"on fake tensors: use the analytic estimate (shardfit plan)")
    if micro_batch < 1 or seq_len < 1:
        raise ShardfitError(f"micro_batch and seq_len must be positive, got {micro_batch} and {seq_len}")
    if spec.max_position and seq_len > spec.max_position:
        raise ShardfitError(f"seq_len {seq_len} exceeds {spec.name}'s max_position {spec.max_position}: shorten it")
    every = parse_activation_checkpointing(ac)
    dtype = torch.float32 if autocast else torch_dtype(_PRECISIONS[precision])
    model = build_model(spec, device="meta", dtype=dtype, attn_implementation=attention)
    blocks = tuple(block_classes(model, spec)) if every else ()
    lora = getattr(getattr(model_or_plan, "training", None), "lora", None)
    if lora is not None:
        from shardfit.engines.base import apply_lora

        model = apply_lora(model_or_plan, model)
    if every:
        from shardfit.engines.base import apply_activation_checkpointing

        apply_activation_checkpointing(model, blocks, every)
    vocab = spec.vocab_size or getattr(getattr(model, "config", None), "vocab_size", 0)
    if not vocab:
        raise ShardfitError(f"{spec.name}: tracing needs a model that takes input_ids and labels (a vocabulary)")
    with FakeTensorMode(allow_non_fake_inputs=True):
        materialize(model)
        input_ids = torch.randint(0, vocab, (micro_batch, seq_len))
        trained = [p for p in model.parameters() if p.requires_grad]
        opt = torch.optim.AdamW(trained, foreach=False) if optimizer else None
        with masks_as_in_eager():
            phases = run_tracked_step(model, input_ids, opt,
                                      autocast_dtype=torch_dtype(_PRECISIONS[precision]) if autocast and precision != "fp32" else None)
    return summarize(phases, spec.name, micro_batch, seq_len, ac, precision, autocast)


def summarize(phases: dict, name: str, micro_batch: int, seq_len: int, ac: str, precision: str, autocast: bool) -> dict:
    after_forward, backward_peak, after_step = phases["after_forward"], phases["backward_peak"], phases["after_step"]
    return {
        "model": name, "micro_batch": micro_batch, "seq_len": seq_len, "activation_checkpointing": ac,
        "precision": precision, "autocast": autocast,
        "bytes": {
            "params": after_forward["params"], "buffers": after_forward["buffers"],
            "grads": phases["after_backward"]["grads"], "activations": after_forward["activations"],
            "temporaries": backward_peak["temporaries"], "optimizer": after_step["optimizer"],
        },
        "saved_for_backward": phases["saved_for_backward"],
        "forward_peak": phases["forward_peak"]["total"], "backward_peak": backward_peak["total"],
        "step_peak": phases["step_peak"]["total"],
        "phases": phases,
    }
