"""Communication accounting: what a training step really sends, and what theory says it should.

Measured at the dispatcher: every torch.distributed collective, whoever calls it (FSDP1/FSDP2 via
`dist.*`, DeepSpeed via `deepspeed.comm`, and DDP's C++ reducer, which calls the ProcessGroup
directly), goes through a `c10d::*` operator. A TorchDispatchMode sees those operators with their
real tensors, so sizes and dtypes are exact and no engine needs patching. It costs a Python call per
operator, so the bench counts one dedicated step and times the others without it.

Sizes follow the ZeRO paper's convention (arXiv 1910.02054, section 7): an all-gather is counted by
its gathered output, a reduce-scatter by its full input, an all-reduce by its buffer; the *volume*
counts an all-reduce twice (= reduce-scatter + all-gather), so DDP, ZeRO-1 and ZeRO-2 move 2P
elements per step and ZeRO-3 moves 3P. Gloo emulates reduce-scatter with an all-reduce internally;
counting at the operator level keeps the kind the engine asked for.
"""
from __future__ import annotations

from collections import defaultdict

KINDS = ("all_gather", "reduce_scatter", "all_reduce", "reduce", "broadcast", "all_to_all",
         "gather", "scatter", "send_recv", "barrier")

# operator name -> (kind, index of the argument whose tensors give the size). Sizes are the full
# (unsharded) buffer: all-gather outputs, reduce-scatter inputs, everything else its tensors.
_C10D = {
    "allreduce_": ("all_reduce", 0),
    "allreduce_coalesced_": ("all_reduce", 0),
    "allgather_": ("all_gather", 0),
    "_allgather_base_": ("all_gather", 0),
    "allgather_coalesced_": ("all_gather", 0),
    "allgather_into_tensor_coalesced_": ("all_gather", 0),
    "reduce_scatter_": ("reduce_scatter", 1),
    "_reduce_scatter_base_": ("reduce_scatter", 1),
    "reduce_scatter_tensor_coalesced_": ("reduce_scatter", 1),
    "reduce_": ("reduce", 0),
    "broadcast_": ("broadcast", 0),
    "alltoall_": ("all_to_all", 1),
    "alltoall_base_": ("all_to_all", 1),
    "gather_": ("gather", 1),
    "scatter_": ("scatter", 0),
    "send": ("send_recv", 0),
    "recv_": ("send_recv", 0),
    "recv_any_source_": ("send_recv", 0),
    "barrier": ("barrier", None),
    "monitored_barrier_": ("barrier", None),
}
# Functional collectives (torch.compile, some FSDP2 paths): outputs are new tensors, so the
# gathered size is the input times the group size.
_FUNCTIONAL = {
    "all_reduce": ("all_reduce", 1), "all_reduce_coalesced": ("all_reduce", 1),
    "all_gather_into_tensor": ("all_gather", "group"), "all_gather_into_tensor_coalesced": ("all_gather", "group"),
    "reduce_scatter_tensor": ("reduce_scatter", 1), "reduce_scatter_tensor_coalesced": ("reduce_scatter", 1),
    "all_to_all_single": ("all_to_all", 1), "broadcast": ("broadcast", 1),
}
# Volume factor: an all-reduce moves its buffer twice (reduce-scatter then all-gather).
VOLUME_FACTOR = {"all_reduce": 2}


def _tensor_bytes(obj) -> int:
    import torch

    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, (list, tuple)):
        return sum(_tensor_bytes(item) for item in obj)
    return 0


def classify(namespace: str, name: str, args: tuple) -> tuple[str, int] | None:
    """(kind, bytes) for a collective operator, None for anything else."""
    if namespace == "c10d" and name in _C10D:
        kind, index = _C10D[name]
        return kind, 0 if index is None else _tensor_bytes(args[index])
    if namespace == "_c10d_functional" and name in _FUNCTIONAL:
        kind, rule = _FUNCTIONAL[name]
        size = _tensor_bytes(args[0])
        if rule == "group":
            size *= int(args[1])
        return kind, size
    return None


class CommCounter:
    """Counts calls and bytes per collective kind while active (`with CommCounter() as comm:`)."""

    def __init__(self):
        self.calls: dict[str, int] = defaultdict(int)
        self.bytes: dict[str, int] = defaultdict(int)
        # Set by the caller between forward / backward / optimizer: where each collective happened.
        self.phase = "step"
        # While true, the phase turns from "forward" to "backward" at the first operator the autograd
        # engine runs, and stays there (DeepSpeed reduces gradients after autograd returns).
        self.follow_backward = False
        self.phase_bytes: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))
        self._mode = None

    def record(self, kind: str, size: int) -> None:
        self.calls[kind] += 1
        self.bytes[kind] += size
        self.phase_bytes[self.phase][kind] += size

    def __enter__(self) -> "CommCounter":
        from torch.utils._python_dispatch import TorchDispatchMode

        import torch

        counter = self
        graph_task = torch._C._current_graph_task_id

        class _Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                if counter.follow_backward and counter.phase == "forward" and graph_task() != -1:
                    counter.phase = "backward"
                found = classify(func.namespace, func._opname, args)
                if found is not None:
                    counter.record(*found)
                return func(*args, **(kwargs or {}))

        self._mode = _Mode()
        self._mode.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._mode.__exit__(*exc)
        self._mode = None

    def summary(self, steps: int = 1) -> dict:
        """Per step: {kind: {"calls", "bytes"}}, plus total bytes and ZeRO-convention volume."""
        kinds = {kind: {"calls": self.calls[kind] // steps, "bytes": self.bytes[kind] // steps}
                 for kind in KINDS if self.calls.get(kind)}
        total = sum(entry["bytes"] for entry in kinds.values())
        volume = sum(entry["bytes"] * VOLUME_FACTOR.get(kind, 1) for kind, entry in kinds.items())
        by_phase = {phase: {kind: size // steps for kind, size in kinds_.items()}
                    for phase, kinds_ in self.phase_bytes.items()}
        return {"per_kind": kinds, "by_phase": by_phase, "bytes": total, "volume_bytes": volume}


def theoretical_comm(strategy, n_params: int, *, grad_bytes: int, param_bytes: int,
                     root_params: int = 0, persistent_params: int = 0) -> dict:
    """Ideal bytes per step and rank by kind, ZeRO-paper convention (see module docstring).

    grad_bytes / param_bytes: bytes per element of the reduced gradients and gathered parameters.
    root_params: FSDP root-unit parameters (embeddings, final norm, head), which FSDP1 and FSDP2 keep
        gathered between forward and backward (they are needed again at once).
    persistent_params: ZeRO-3 parameters under `param_persistence_threshold`, never partitioned.
    Each entry of `by_kind` is the full buffer size; `volume_bytes` counts an all-reduce twice.
    """
    grads = n_params * grad_bytes
    kind = strategy.kind
    if kind == "single":
        return {"by_kind": {}, "bytes": 0, "volume_bytes": 0, "note": "single: one device, no collectives"}
    if kind == "ddp" or (kind == "fsdp" and strategy.sharding == "no_shard"):
        by_kind = {"all_reduce": grads}
        note = "DDP: one all-reduce of the gradients (2P: reduce-scatter + all-gather)"
    elif kind in ("zero1", "zero2"):
        by_kind = {"reduce_scatter": grads, "all_gather": n_params * param_bytes}
        note = f"{kind}: gradients reduced to their owners (P) + updated parameters all-gathered (P)"
    else:
        sharded = n_params - (persistent_params if kind == "zero3" else 0)
        gathers = sharded  # forward
        # One fact with the step-time model: see Strategy.regathers_in_backward.
        regather = strategy.regathers_in_backward(n_params)
        if regather:
            gathers += sharded - (root_params if kind != "zero3" else 0)
        by_kind = {"all_gather": gathers * param_bytes, "reduce_scatter": sharded * grad_bytes}
        if kind == "zero3" and persistent_params:
            by_kind["all_reduce"] = persistent_params * grad_bytes
        note = (f"{strategy.label}: parameters all-gathered in forward"
                + (" and again in backward" if regather else " only (kept for backward)")
                + " (P each) + gradients reduce-scattered (P)")
    volume = sum(size * VOLUME_FACTOR.get(k, 1) for k, size in by_kind.items())
    return {"by_kind": by_kind, "bytes": sum(by_kind.values()), "volume_bytes": volume, "note": note}
