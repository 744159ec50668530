"""`shardfit.profile`: measure a training step by phase and category, in anyone's script.

    with shardfit.profile(model, optimizer) as prof:
        for batch in batches:
            loss = model(batch).loss          # phase "forward" starts at the model's forward
            loss.backward()                   # "backward" when the autograd engine starts
            optimizer.step()                  # "optimizer" at the step (a step pre-hook)
            optimizer.zero_grad()
        with prof.phase("checkpoint"):        # phases can also be set by hand
            save(...)
    print(prof.report().table())

`profile(..., enabled=False)` returns a profiler that installs nothing: tracking off costs nothing.
`profile()` with no model discovers the model at its first top-level forward and the optimizer at
its first step (how `shardfit profile --script` profiles a script it did not write).
"""
from __future__ import annotations

import os
import sys

from shardfit.errors import ShardfitError
from shardfit.estimate.result import PHASES
from shardfit.measure import collective_release
from shardfit.measure.cuda import cuda_stats, dump_snapshot
from shardfit.measure.oom import diagnose, format_diagnosis
from shardfit.measure.report import RankReport
from shardfit.spec.sizes import parse_size


class _PhaseSwitch:
    """Returned by `prof.phase(name)`: the switch already happened; `with` is only for readability."""

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


class NullProfiler:
    """Tracking off: no mode, no hooks, no records."""
    enabled = False
    oom = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def phase(self, name: str):
        return _PhaseSwitch()

    def report(self):
        return None

    def record_oom(self, exc=None):
        return None


_ACTIVE: list = []  # profilers entered and not yet left, innermost last


def active_profiler():
    """The innermost profiler now measuring in this process, or None (how a training loop finds the
    memory budget's accounting without being handed it)."""
    return _ACTIVE[-1] if _ACTIVE else None


class Profiler:
    enabled = True

    def __init__(self, model=None, optimizer=None, *, plan=None, budget_bytes: int | None = None,
                 snapshot_path: str | None = None, explain_oom: bool = True, label: str = ""):
        self.plan = plan
        self.label = label
        self.budget_bytes = budget_bytes
        self.snapshot_path = snapshot_path
        self.explain_oom = explain_oom
        self._models = [model] if model is not None else []
        optimizers = optimizer if isinstance(optimizer, (list, tuple)) else [optimizer]
        self._optimizers = [o for o in optimizers if o is not None]
        self._handles = []
        self._patched = []
        self._accountant = None
        self.load = None
        self.steps: list[dict] = []
        self.checkpoints: list = []
        self.oom: dict | None = None
        self._step = 0
        self._device_type = "cpu"
        self._collective_release = False

    # ---- lifecycle ------------------------------------------------------------------------------
    def __enter__(self):
        from torch.nn.modules.module import register_module_forward_hook, register_module_forward_pre_hook
        from torch.optim.optimizer import register_optimizer_step_pre_hook

        from shardfit.measure.tracker import Accountant, PhaseStats

        self._device_type = _device_type_of(self._models)
        self._accountant = Accountant(self._model_container(), self._optimizers, self.budget_bytes, self._device_type)
        self._accountant.on_backward = lambda: self._switch("backward")
        if self._device_type == "cuda":
            self._cuda_begin()
        self.load = PhaseStats("load", 0)
        self._cuda_stats = self.load
        self._top_depth = 0
        self._accountant.install_resize_hook()
        # gloo's worker thread must not decide when a collective's buffers die (collective_release.py)
        self._collective_release = self._device_type == "cpu" and collective_release.install()
        self._accountant.__enter__()
        self._accountant.begin_phase("load", self.load)
        self._handles.append(register_module_forward_pre_hook(self._global_pre_forward))
        # always_call: a checkpointed block's recompute stops early by raising (non-reentrant
        # checkpointing): the hook still closes the recompute there, not at the next autograd node.
        self._handles.append(register_module_forward_hook(self._global_post_forward, always_call=True))
        self._handles.append(register_optimizer_step_pre_hook(self._optimizer_pre_step))
        for model in self._models:
            self._attach_model(model)
        for optimizer in self._optimizers:
            self._attach_optimizer(optimizer)
        _ACTIVE.append(self)
        return self

    def __exit__(self, exc_type, exc, tb):
        import torch

        if self in _ACTIVE:
            _ACTIVE.remove(self)
        try:
            if exc is not None and isinstance(exc, torch.OutOfMemoryError):
                self.record_oom(exc)
            self._accountant.end_phase()
            self._cuda_end_phase()
        finally:
            # The mode, hooks and patches come off whatever happened above: a profiler left half
            # attached would keep accounting (and slowing) every later step.
            if self._device_type == "cuda":
                torch.cuda.memory._record_memory_history(enabled=None)
            self._accountant.__exit__(None, None, None)
            self._accountant.remove_resize_hook()
            if self._collective_release:
                collective_release.remove()
            for handle in self._handles:
                handle.remove()
            self._handles.clear()
            for obj, name, original in reversed(self._patched):
                if original is None:
                    delattr(obj, name)
                else:
                    setattr(obj, name, original)
            self._patched.clear()
        if self.oom is not None and self.explain_oom:
            print(format_diagnosis(diagnose(self.report(), self.plan)), file=sys.stderr)
        return False

    def attach(self, model=None, optimizer=None):
        """Name the model and optimizer once they exist (the tracker may start before they are built,
        so that loading and wrapping are measured too)."""
        # A ModuleList is several models that each run forward (an interleaved pipeline rank's chunks).
        for part in (list(model) if type(model).__name__ == "ModuleList" else [model]):
            if part is not None and not any(part is m for m in self._models):
                self._models.append(part)
                self._attach_model(part)
        for opt in (optimizer if isinstance(optimizer, (list, tuple)) else [optimizer]):
            if opt is not None and not any(opt is o for o in self._optimizers):
                self._optimizers.append(opt)
                self._attach_optimizer(opt)
        if self._accountant is not None:
            self._accountant.model = self._model_container()
            self._accountant.optimizers = self._optimizers
            self._accountant.scan()

    # ---- phases ---------------------------------------------------------------------------------
    def phase(self, name: str) -> _PhaseSwitch:
        if name not in PHASES:
            raise ShardfitError(f"unknown phase '{name}': use one of {', '.join(PHASES)}")
        self._switch(name)
        return _PhaseSwitch()

    @property
    def tensor_peak_bytes(self) -> int:
        """The highest live tracked tensor bytes so far (what the memory budget is compared with)."""
        return self._accountant.run_peak_bytes if self._accountant else 0

    @property
    def step(self) -> int:
        """Steps begun so far (a step begins at its first forward)."""
        return self._step

    @property
    def current_phase(self) -> str:
        return self._accountant.phase if self._accountant else "load"

    def _switch(self, name: str):
        from shardfit.measure.tracker import PhaseStats

        accountant = self._accountant
        if accountant is None or accountant.phase == name:
            return
        if name == "forward" and accountant.phase != "backward":
            self._step += 1
            self.steps.append({})
        if name == "checkpoint":
            stats = PhaseStats("checkpoint", self._step)
            self.checkpoints.append(stats)
        elif name == "load":
            stats = self.load
        else:
            if not self.steps:
                self._step += 1
                self.steps.append({})
            stats = self.steps[-1].setdefault(name, PhaseStats(name, self._step))
        self._cuda_end_phase()
        accountant.begin_phase(name, stats)
        self._cuda_stats = stats
        if self._device_type == "cuda":
            import torch

            torch.cuda.reset_peak_memory_stats()

    # ---- hooks ----------------------------------------------------------------------------------
    def _in_backward(self) -> bool:
        import torch

        return torch._C._current_graph_task_id() != -1

    def _global_pre_forward(self, module, args):
        if self._in_backward():
            # Activation checkpointing recomputes forward inside backward: those are activations.
            self._accountant.begin_recompute()
            return
        if self._top_depth == 0 and not self._models:
            self._models.append(module)
            self._attach_model(module)
            self._accountant.model = self._model_container()
            self._accountant.scan()
        if self._accountant.phase != "forward" and any(module is m for m in self._models):
            self._switch("forward")
        self._top_depth += 1

    def _global_post_forward(self, module, args, output):
        if self._in_backward():
            self._accountant.end_recompute()
            return
        self._top_depth = max(0, self._top_depth - 1)

    def _optimizer_pre_step(self, optimizer, args, kwargs):
        if not any(optimizer is o for o in self._optimizers) and not self._has_deepspeed_optimizer():
            self._optimizers.append(optimizer)
            self._accountant.optimizers = self._optimizers
        self._switch("optimizer")

    def _has_deepspeed_optimizer(self) -> bool:
        return any(type(o).__module__.startswith("deepspeed") for o in self._optimizers)

    def _attach_model(self, model):
        # DeepSpeed's engine runs backward and step itself: mark the phases at its entry points so
        # its gradient reduction and unscale/clip land in the right phase.
        if type(model).__module__.startswith("deepspeed"):
            self._wrap(model, "backward", "backward")
            # engine.step() runs on every micro-batch; it steps only on the accumulation boundary.
            self._wrap(model, "step", "optimizer", when=getattr(model, "is_gradient_accumulation_boundary", None))
            optimizer = getattr(model, "optimizer", None)
            if optimizer is not None and not any(optimizer is o for o in self._optimizers):
                self._optimizers.append(optimizer)
                self._accountant.optimizers = self._optimizers
            if type(optimizer).__name__ == "DeepSpeedZeroOptimizer":
                self._watch_gradients(model)

        if type(model).__name__ == "DistributedDataParallel":
            # DDP rebuilds its gradient buckets inside _pre_forward (second step): buckets, not activations.
            for method in ("_pre_forward", "_post_forward"):
                self._wrap_engine_work(model, method)

    def _watch_gradients(self, model):
        """ZeRO-1/2 copies each gradient into its bucket inside its post-accumulate-grad hook and drops
        it, so no identity scan finds it in .grad: file the gradient as one as it reaches its parameter
        (a leaf's tensor hook runs just before the accumulation), whatever its moment."""
        accountant = self._accountant

        def mark(grad):
            accountant.track_tensor(grad, "grads", override=True)

        for param in model.parameters():
            if param.requires_grad:
                self._handles.append(param.register_hook(mark))

    def _wrap_engine_work(self, obj, method: str):
        original = obj.__dict__.get(method)
        bound = getattr(obj, method)
        accountant = self._accountant

        def wrapper(*args, **kwargs):
            accountant._engine_depth += 1
            try:
                return bound(*args, **kwargs)
            finally:
                accountant._engine_depth -= 1

        setattr(obj, method, wrapper)
        self._patched.append((obj, method, original))

    def _attach_optimizer(self, optimizer):
        import torch

        if not isinstance(optimizer, torch.optim.Optimizer):
            self._wrap(optimizer, "step", "optimizer")

    def _wrap(self, obj, method: str, phase: str, when=None):
        original = obj.__dict__.get(method)
        bound = getattr(obj, method)

        def wrapper(*args, **kwargs):
            if when is None or when():
                self._switch(phase)
            return bound(*args, **kwargs)

        setattr(obj, method, wrapper)
        self._patched.append((obj, method, original))

    def _model_container(self):
        if not self._models:
            return None
        if len(self._models) == 1:
            return self._models[0]
        import torch

        return torch.nn.ModuleList(self._models)

    # ---- CUDA -----------------------------------------------------------------------------------
    def _cuda_begin(self):
        import torch

        torch.cuda.reset_peak_memory_stats()
        # The allocator history is what an OOM snapshot shows (stack traces of every block).
        torch.cuda.memory._record_memory_history(max_entries=100_000)

    def _cuda_end_phase(self):
        stats = getattr(self, "_cuda_stats", None)
        if self._device_type != "cuda" or stats is None:
            return

        stats.cuda = cuda_stats()

    # ---- results --------------------------------------------------------------------------------
    def record_oom(self, exc=None):
        """Remember where an out-of-memory error struck (call it from your own `except`)."""
        accountant = self._accountant
        info = dict(accountant.last_oom or {}) if accountant else {}
        info.setdefault("phase", self.current_phase)
        info.setdefault("breakdown", accountant.live_breakdown() if accountant else {})
        info["step"] = self._step
        info["message"] = str(exc).splitlines()[0] if exc is not None else ""
        if self._device_type == "cuda":
            info["cuda"] = cuda_stats()
            info["snapshot"] = dump_snapshot(self.snapshot_path or f"shardfit-oom-rank{_rank()}.pickle")
        if accountant is not None:
            accountant.last_oom = None
        self.oom = info
        return info

    def report(self):
        return RankReport.from_profiler(self)


def _rank() -> int:
    return int(os.environ.get("RANK", "0"))


def _device_type_of(models) -> str:
    for model in models:
        for param in model.parameters():
            return param.device.type
    return "cpu"


def profile(model=None, optimizer=None, *, plan=None, budget_bytes: int | None = None, enabled: bool | None = None,
            snapshot_path: str | None = None, explain_oom: bool = True, label: str = ""):
    """A context manager measuring live tensor bytes by phase and category on this rank.

    budget_bytes (or SHARDFIT_MEMORY_BUDGET): raise torch.OutOfMemoryError when live tracked device
    bytes would exceed it, so an OOM can be rehearsed on a CPU. enabled=False (or SHARDFIT_PROFILE=0)
    returns a no-op profiler. plan: a shardfit Plan, used to compute the fixes of an OOM."""
    if enabled is None:
        enabled = os.environ.get("SHARDFIT_PROFILE", "1") not in ("0", "off", "false")
    if not enabled:
        return NullProfiler()
    if budget_bytes is None and os.environ.get("SHARDFIT_MEMORY_BUDGET"):
        budget_bytes = parse_size(os.environ["SHARDFIT_MEMORY_BUDGET"], "B", "SHARDFIT_MEMORY_BUDGET")
    if budget_bytes is not None and budget_bytes <= 0:
        raise ShardfitError(f"memory budget must be a positive number of bytes, got {budget_bytes}")
    return Profiler(model, optimizer, plan=plan, budget_bytes=budget_bytes, snapshot_path=snapshot_path,
                    explain_oom=explain_oom, label=label)
