"""Tensor accounting: every storage created while the tracker is active is recorded with its size,
so live bytes by category are known at every moment on any device, the CPU included.

How a peak gets its categories: each storage record carries a category (set at creation from the
phase, then corrected by identity scans, see categories.py). A scan is cheap but not free, so it
runs at phase boundaries and whenever a phase's peak grew by more than 5% (_RESCAN_GROWTH) since the last scan; at
the end of a phase the records alive at the peak's moment are summed by category.

Private torch APIs relied on (pinned by tests/measure/test_torch_private_api.py):
`torch.utils._python_dispatch.TorchDispatchMode`, `torch._C._current_graph_task_id`,
`torch.distributed._tools.common_utils.get_untyped_storages`, `torch.utils.weak.WeakIdKeyDictionary`.
"""
from __future__ import annotations

import os
import sys
import traceback
import weakref
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_map_only
from torch.utils.weak import WeakIdKeyDictionary

from shardfit.measure import collective_release
from shardfit.measure.categories import (ALL_CATEGORIES, CATEGORIES, HOST, engine_rules, fsdp_units, parameter_rules,
                                         storages_of)

# Ops whose outputs are communication buffers, whatever the phase (c10d collectives, FSDP2 copy-in/out).
_COMM_NAMESPACES = ("c10d", "_c10d_functional", "fsdp", "c10d_functional")
# Mid-phase scans (backward and after) when the phase peak grew by this factor since the last one.
_RESCAN_GROWTH = 1.05
_TO_COPY = torch.ops.aten._to_copy.default


def _zero():
    return dict.fromkeys(ALL_CATEGORIES, 0)


# SHARDFIT_PROFILE_DEBUG=BYTES: remember where each storage of at least BYTES was allocated, and
# print the storages live at each phase's peak (what the calibration notes were written from).
# SHARDFIT_PROFILE_DEBUG_FRAMES=N: N frames per site, torch's own included (which engine call allocated).
_DEBUG_BYTES = int(float(os.environ.get("SHARDFIT_PROFILE_DEBUG", "0") or 0))
_DEBUG_FRAMES = int(os.environ.get("SHARDFIT_PROFILE_DEBUG_FRAMES", "0") or 0)


class _Record:
    __slots__ = ("nbytes", "category", "t_alloc", "t_free", "alive", "where", "__weakref__")

    def __init__(self, nbytes: int, category: str, t_alloc: int):
        self.nbytes = nbytes
        self.category = category
        self.t_alloc = t_alloc
        self.t_free: int | None = None
        self.alive = True
        self.where = _allocation_site() if _DEBUG_BYTES and nbytes >= _DEBUG_BYTES else None


def _allocation_site() -> str:
    frames = [f for f in traceback.extract_stack(limit=60)[:-3] if "shardfit/measure" not in f.filename
              and (_DEBUG_FRAMES or "site-packages/torch/" not in f.filename)]
    return " <- ".join(f"{Path(f.filename).name}:{f.lineno} {f.name}" for f in reversed(frames[-(_DEBUG_FRAMES or 4):]))


@dataclass
class PhaseStats:
    """One phase of one step: the breakdown at its peak and at its end (bytes per category)."""
    name: str
    step: int
    peak: dict = field(default_factory=_zero)
    end: dict = field(default_factory=_zero)
    peak_total: int = 0
    entries: int = 0
    cuda: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        return {"name": self.name, "step": self.step, "peak": dict(self.peak), "end": dict(self.end),
                "peak_total": self.peak_total, "entries": self.entries, "cuda": dict(self.cuda)}


def device_total(breakdown: dict) -> int:
    return sum(breakdown[c] for c in CATEGORIES)


class BudgetExceeded(torch.OutOfMemoryError):
    """The tracker's byte budget was exceeded: the same type torch raises on a CUDA OOM."""


class Accountant(TorchDispatchMode):
    """The dispatch mode that sees every op's outputs. Phase changes come from the Profiler."""

    def __init__(self, model=None, optimizers=(), budget_bytes: int | None = None, device_type: str = "cpu"):
        super().__init__()
        self.model = model
        self.optimizers = list(optimizers)
        self.budget_bytes = budget_bytes
        self.device_type = device_type
        self._records = WeakIdKeyDictionary()
        self._refs: dict[int, weakref.ref] = {}
        self._units, self._units_of = None, None
        self._live_by_cat = _zero()
        self._t = 0
        self._phase = "load"
        self._phase_default = "temporaries"
        self._dead: list[_Record] = []
        self._peak_t = 0
        self._peak_total = 0  # this phase's
        self.run_peak_bytes = 0  # the highest live tracked bytes since the tracker started
        self._scanned_peak = 0
        self._scan_pending = False
        self._current: PhaseStats | None = None
        self._phase_start = _zero()
        self._recompute_depth = 0
        self._recompute_node = None
        self._engine_depth = 0  # inside an engine's own pre/post-forward work: not activations
        self._orig_resize = None
        self.on_backward = None  # set by the Profiler: called when the autograd engine starts
        self.last_oom: dict | None = None

    # ---- records -------------------------------------------------------------------------------
    def _device_live(self) -> int:
        return sum(self._live_by_cat[c] for c in CATEGORIES)

    def _add(self, storage, category: str) -> _Record:
        nbytes = storage.nbytes()
        self._t += 1
        record = _Record(nbytes, category, self._t)
        self._records[storage] = record
        self._watch(storage, record)
        self._live_by_cat[category] += nbytes
        return record

    def _watch(self, storage, record):
        # A weakref callback on the storage object: fires when its last Python/C++ owner lets go.
        self._refs[id(record)] = weakref.ref(storage, lambda _ref, rec=record: self._free(rec))

    def _free(self, record: _Record):
        if not record.alive:
            return
        record.alive = False
        self._t += 1
        record.t_free = self._t
        self._live_by_cat[record.category] -= record.nbytes
        self._refs.pop(id(record), None)
        if record.t_alloc <= self._peak_t:
            self._dead.append(record)

    def _resize(self, record: _Record, new_bytes: int):
        # A resize is a free of the old size and an allocation of the new one, so the peak
        # reconstruction sees the gathered size while it was live.
        old = _Record(record.nbytes, record.category, record.t_alloc)
        self._t += 1
        old.alive, old.t_free = False, self._t
        if old.t_alloc <= self._peak_t:
            self._dead.append(old)
        self._live_by_cat[record.category] += new_bytes - record.nbytes
        record.nbytes = new_bytes
        record.t_alloc = self._t
        if new_bytes > old.nbytes:
            self._after_growth(new_bytes - old.nbytes)

    def _set_category(self, record: _Record, category: str):
        if record.category != category and record.alive:
            self._live_by_cat[record.category] -= record.nbytes
            self._live_by_cat[category] += record.nbytes
            record.category = category

    def track_tensor(self, tensor, category: str | None = None, override: bool = False):
        """Record new storages (as `category`, default: the phase's); with override, also move
        existing storages that only had a default category (a bucket reused by a collective)."""
        if tensor.device.type == "meta":
            return  # shapes only, no memory (DeepSpeed keeps meta copies of every parameter)
        for storage in storages_of(tensor):
            record = self._records.get(storage)
            if record is None:
                record = self._add(storage, category or self._phase_default)
                self._after_growth(record.nbytes)
            elif override and category is not None and record.category in ("activations", "temporaries"):
                self._set_category(record, category)

    def begin_recompute(self):
        """Activation checkpointing re-runs a block's forward inside backward. It ends when those
        forwards return or raise (non-reentrant checkpointing stops early by raising; the Profiler's
        post-forward hook is always called), and at the latest when the autograd engine moves on to
        another node: the node's own gradient, computed after the recompute, is not an activation."""
        if self._recompute_depth == 0:
            self._recompute_node = torch._C._current_autograd_node()
        self._recompute_depth += 1

    def end_recompute(self):
        self._recompute_depth = max(0, self._recompute_depth - 1)

    def _in_recompute(self) -> bool:
        if self._recompute_depth == 0:
            return False
        if torch._C._current_autograd_node() is not self._recompute_node:
            self._recompute_depth = 0
            return False
        return True

    # ---- budget and peaks ----------------------------------------------------------------------
    def _after_growth(self, grown: int):
        live = self._device_live()
        if self.budget_bytes is not None and live > self.budget_bytes and grown > 0:
            start = self._phase_start
            self.last_oom = {"phase": self._phase, "requested": grown, "live": live, "budget": self.budget_bytes,
                             "breakdown": dict(self._live_by_cat),
                             "grown": {c: self._live_by_cat[c] - start.get(c, 0) for c in CATEGORIES}}
            raise BudgetExceeded(
                f"shardfit memory budget exceeded in {self._phase}: tried to allocate {grown} bytes with "
                f"{live - grown} live of a {self.budget_bytes}-byte budget")
        self.run_peak_bytes = max(self.run_peak_bytes, live)
        if live > self._peak_total:
            self._peak_total = live
            self._peak_t = self._t
            # In forward nothing changes owner (parameters and states are scanned at its start),
            # so only later phases rescan mid-way: grads appear, partitions get assigned.
            if self._phase != "forward" and live > self._scanned_peak * _RESCAN_GROWTH:
                self._scan_pending = True

    # ---- identity scans ------------------------------------------------------------------------
    def scan(self):
        """Give every storage we can name its category (parameters, grads, states, engine buffers)."""
        self._scan_pending = False
        self._scanned_peak = max(self._peak_total, 1)
        if self.model is not None and self._units_of is not self.model:
            self._units, self._units_of = fsdp_units(self.model), self.model
        rules = list(parameter_rules(self.model, self.optimizers))
        rules += list(engine_rules(self.model, self.optimizers, self._units))  # engine rules win: applied last
        for tensor, category in rules:
            if tensor.device.type == "meta":
                continue
            for storage in storages_of(tensor):
                record = self._records.get(storage)
                if record is None:
                    # Existed before tracking started (or never passed through an op): count it now.
                    if storage.nbytes() == 0 and category != "params":
                        continue
                    record = self._add(storage, category)
                else:
                    self._set_category(record, category)
        if self.device_type != "cpu":
            # On an accelerator, whatever lives on the CPU is host memory by definition.
            for storage, record in list(self._records.items()):
                if storage.device.type == "cpu" and record.alive:
                    self._set_category(record, HOST)

    def breakdown_at(self, t: int) -> dict:
        """Bytes by category of the records alive at time t (t <= now)."""
        out = _zero()
        for record in self._records.values():
            if record.alive and record.t_alloc <= t:
                out[record.category] += record.nbytes
        for record in self._dead:
            if record.t_alloc <= t and record.t_free is not None and record.t_free > t:
                out[record.category] += record.nbytes
        return out

    def _debug_peak(self, name: str):
        t = self._peak_t
        rows = [r for r in list(self._records.values()) + self._dead
                if r.nbytes >= _DEBUG_BYTES and r.t_alloc <= t and (r.alive or (r.t_free or 0) > t)]
        print(f"[shardfit debug] rank {os.environ.get('RANK', '0')} {name} peak {self._peak_total} B:", file=sys.stderr)
        for r in sorted(rows, key=lambda r: -r.nbytes):
            print(f"  {r.nbytes:>10} {r.category:<12} {r.where or '(before tracking or resized)'}", file=sys.stderr)

    def live_breakdown(self) -> dict:
        return dict(self._live_by_cat)

    # ---- phases ----------------------------------------------------------------------------------
    @property
    def phase(self) -> str:
        return self._phase

    def begin_phase(self, name: str, stats: PhaseStats):
        self.end_phase(next_phase=name)
        self.scan()
        self._phase = name
        self._phase_default = "activations" if name == "forward" else "temporaries"
        self._current = stats
        stats.entries += 1
        self._dead = []
        self._phase_start = self.live_breakdown()
        self._peak_total = self._device_live()
        self._peak_t = self._t
        self._scanned_peak = self._peak_total

    def end_phase(self, next_phase: str | None = None):
        stats = self._current
        if stats is None:
            return
        self.scan()
        if self._phase == "forward" and next_phase == "backward":
            # Activations are what forward leaves for backward. A forward tensor already freed when
            # forward ends (the loss's fp32 upcast, a norm's intermediate) was a temporary.
            for record in self._dead:
                if record.category == "activations":
                    record.category = "temporaries"
        if _DEBUG_BYTES:
            self._debug_peak(stats.name)
        if self._peak_total >= stats.peak_total:
            stats.peak = self.breakdown_at(self._peak_t)
            stats.peak_total = device_total(stats.peak)
        stats.end = self.live_breakdown()
        self._current = None
        self._dead = []

    # ---- dispatch ----------------------------------------------------------------------------------
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if any(t is DTensor for t in types):
            return NotImplemented  # let DTensor run its local ops, which come back here
        if self._scan_pending:
            self.scan()
        if self._phase == "forward" and torch._C._current_graph_task_id() != -1 and self.on_backward:
            self.on_backward()
        out = func(*args, **(kwargs or {}))
        namespace = getattr(func, "namespace", "")
        if func is _TO_COPY and self._is_param(args[0] if args else None):
            # A dtype copy of a parameter (autocast's weight cache, a mixed-precision cast) is a
            # low-precision parameter copy: temporaries, like a gathered unit, not an activation.
            tree_map_only(torch.Tensor, lambda t: self.track_tensor(t, "temporaries"), out)
        elif namespace in _COMM_NAMESPACES:
            tree_map_only(torch.Tensor, lambda t: self.track_tensor(t, "temporaries", override=True), (out, args))
            if self.device_type == "cpu" and func._schema.name == "_c10d_functional::wait_tensor":
                collective_release.after_wait_tensor()
        elif self._engine_depth > 0:
            tree_map_only(torch.Tensor, lambda t: self.track_tensor(t, "temporaries"), out)
        elif self._phase == "backward" and self._in_recompute():
            tree_map_only(torch.Tensor, lambda t: self.track_tensor(t, "activations"), out)
        else:
            tree_map_only(torch.Tensor, self.track_tensor, out)
        return out

    def _is_param(self, tensor) -> bool:
        if not isinstance(tensor, torch.Tensor) or tensor.device.type == "meta":
            return False
        try:
            record = self._records.get(tensor.untyped_storage())
        except (RuntimeError, NotImplementedError):  # wrapper subclasses without one storage
            return False
        return record is not None and record.category == "params"

    # ---- storage resize (FSDP gathers into resized storages; not seen by dispatch) ---------------
    def install_resize_hook(self):
        original = torch.UntypedStorage.resize_
        accountant = self

        def resize_(storage, size):
            result = original(storage, size)
            record = accountant._records.get(storage)
            if record is not None and record.alive and record.nbytes != storage.nbytes():
                accountant._resize(record, storage.nbytes())
            elif record is None and accountant._orig_resize is not None and storage.nbytes() > 0:
                accountant._add(storage, accountant._phase_default)
                accountant._after_growth(storage.nbytes())
            return result

        self._orig_resize = original
        torch.UntypedStorage.resize_ = resize_

    def remove_resize_hook(self):
        if self._orig_resize is not None:
            torch.UntypedStorage.resize_ = self._orig_resize
            self._orig_resize = None
