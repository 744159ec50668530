"""The backward's live bytes op by op, traced, for the backward-peak split.

Where backward peaks, and how its bytes divide into activations, gradients and temporaries, depends
on the order in which autograd frees saved tensors, recomputes a checkpointed block (stopping early
once the last needed tensor is rebuilt), builds each weight's gradient and drops the gradients of
activations. No instant fixed in advance holds for every block: Qwen3 under full checkpointing
peaks inside the first block's MLP after its first weight gradient; OPT peaks at the very end, where
the embedding's dense gradient sits beside every weight gradient; Bloom inside its gelu backward.

So the reduced-depth copy (estimate/derived.py) runs forward and backward on fake tensors under the
plan's checkpointing, and every storage is filed the way the memory tracker files it on a real rank
(shardfit/measure/tracker.py, categories.py): created in forward and alive when backward starts, or
created while a checkpointed block is recomputed -> activations; a parameter's .grad -> gradients;
a dtype cast of a parameter -> weight copies; everything else -> temporaries. After each backward op
the live bytes are split into (activations, gradients of the part running now, gradients of parts
done, temporaries, weight copies); the instants that peak at some traced shape under some engine's
weighting are fitted exactly in (b, s) like the saved bytes, and the estimator scales them to the
full depth: the blocks the reduced copy lacks are either all still ahead (their activations alive) or
all done (their gradients alive) -- total bytes are linear in where they sit, so one of the two ends
is the largest.

torch is imported inside the functions: importing this module is free.
"""
from __future__ import annotations

import weakref

from shardfit import sac
from shardfit.errors import ShardfitError
from shardfit.estimate.derived import (cached_set, evaluate, grouped_mm_on_fake_tensors, lora_key,
                                       reduced_model, run_trace, solve_exact, traced_run_failed)
from shardfit.estimate.fake_tensors import masks_as_in_eager, materialize, storage_key, torch_linear

SERIES = ("activations", "grads_current", "grads_done", "temporaries", "weight_copies", "grads_pending",
          "grads_hooked")
FORWARD_SERIES = ("activations", "temporaries", "weight_copies")
# Which bytes each kind of engine keeps where the tracker sees them during backward: every gradient
# in .grad (one device, DDP); the current unit's unsharded gradients only (FSDP: the done ones are
# reduce-scattered to shards); only the gradients whose accumulate-grad hook has not finished
# (DeepSpeed copies each into its bucket in that hook).
_WEIGHTINGS = ((1, 1, 1, 1, 1, 0, 0), (1, 1, 0, 1, 1, 0, 0), (1, 0, 0, 1, 1, 0, 0), (1, 0, 0, 1, 1, 1, 0))
_HOOK = "grad_hook"  # the label of the moment a parameter's post-accumulate-grad hook runs
CHECKPOINTING = ("none", "full", "selective")
_NEVER = 1 << 62


def load_backward(spec, regime: str, attention: str, lora, checkpointing: str, beyond_window: bool = False) -> dict:
    """The traced backward instants of a derived spec under one checkpointing mode (none, full or
    selective), from its cache entry; traced (torch) on a miss."""
    key = (f"{regime}|{attention}|{lora_key(lora)}" + ("|beyond-window" if beyond_window else "")
           + f"|backward-{checkpointing}")
    return cached_set(spec, key, lambda cfg, facts: run_trace(cfg, _trace_backward, cfg, facts, regime, attention,
                                                              lora, checkpointing, beyond_window))


class _Lifetimes:
    """Per storage lifetime: [bytes, created, freed, phase, part, is a weight cast]. A storage is freed
    when its Python storage object dies (a weak reference, as the tracker watches real storages)."""

    def __init__(self, skip: set):
        self.skip, self.t = skip, 0
        self.live: dict = {}
        self.done: list = []
        self._refs: dict = {}

    def add(self, tensor, phase: str, part, cast: bool) -> None:
        key = storage_key(tensor)
        if key in self.skip or key in self.live:
            return
        storage = tensor.untyped_storage()
        record = self.live[key] = [storage.nbytes(), self.t, _NEVER, phase, part, cast]
        self._refs[id(record)] = weakref.ref(storage, lambda _ref, key=key: self._free(key))

    def _free(self, key) -> None:
        record = self.live.pop(key, None)
        if record is not None:
            record[2] = self.t
            self._refs.pop(id(record), None)
            self.done.append(record)


def _trace_backward(cfg, facts, regime, attention, lora, checkpointing, beyond_window) -> dict:
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.utils._python_dispatch import TorchDispatchMode

    model, blocks, points, vocab = reduced_model(cfg, facts, regime, attention, lora, beyond_window)
    if checkpointing != "none":
        _checkpoint_blocks(model, checkpointing == "selective")
    state = {"phase": "forward", "part": "pre", "depth": 0, "node": None, "labels": [], "recorder": None,
             "hooked": {}, "hook_sizes": {}}

    def grad_hook(param):
        # NOTE: where DeepSpeed's hook runs (register_post_accumulate_grad_hook): the gradient is in
        # .grad, the node that made it has released its inputs. A moment of its own, no op.
        recorder = state["recorder"]
        if recorder is None or state["phase"] != "backward" or param.grad is None:
            return
        recorder.lifetimes.t += 1
        state["labels"].append((state["part"], _HOOK))
        state["hooked"][storage_key(param.grad)] = recorder.lifetimes.t
        state["hook_sizes"].setdefault(str(state["part"]), []).append(int(param.numel()))


    def enter(part):
        def hook(_grad):
            state["part"] = part
        return hook

    def block_output(_module, _args, output, index):
        tensor = output[0] if isinstance(output, (tuple, list)) else output
        if state["phase"] != "forward":
            return
        state["part"] = "post"
        if isinstance(tensor, torch.Tensor) and tensor.requires_grad:
            tensor.register_hook(enter(index))  # its gradient is ready: that block's backward starts

    def embedding_output(_module, _args, output):
        if state["phase"] == "forward" and output.requires_grad:
            output.register_hook(enter("pre"))

    def pre_forward(_module, _args):
        # NOTE: as the tracker: a module's forward inside backward is a recompute, which lasts until
        # its forwards return (or raise: an early stop) or the autograd engine moves to another node.
        if state["phase"] == "backward":
            if state["depth"] == 0:
                state["node"] = torch._C._current_autograd_node()
            state["depth"] += 1

    def post_forward(_module, _args, _output):
        if state["phase"] == "backward":
            state["depth"] = max(0, state["depth"] - 1)

    def block_start(_module, args, kwargs, index):
        if state["phase"] != "forward":
            return
        state["part"] = index
        # The first block's backward ends when its input's gradient is ready: what runs between the
        # embedding and the first block (OPT's input projection and positions, Bloom's embedding norm)
        # is the embedding's part, not the block's.
        hidden = next((t for t in (kwargs.get("hidden_states"), *args)
                       if isinstance(t, torch.Tensor) and t.requires_grad), None)
        if index == 0 and hidden is not None:
            hidden.register_hook(enter("pre"))

    for index, block in enumerate(blocks):
        block.register_forward_pre_hook(lambda m, a, k, i=index: block_start(m, a, k, i), with_kwargs=True)
        block.register_forward_hook(lambda m, a, o, i=index: block_output(m, a, o, i))
    model.get_input_embeddings().register_forward_hook(embedding_output)
    for module in model.modules():
        module.register_forward_pre_hook(pre_forward)
        module.register_forward_hook(post_forward, always_call=True)  # as the tracker: an early stop ends it

    class Recorder(TorchDispatchMode):
        def __init__(self, lifetimes, params):
            super().__init__()
            self.lifetimes, self.params = lifetimes, params

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            lifetimes = self.lifetimes
            lifetimes.t += 1
            phase = state["phase"]
            if phase == "backward":
                if state["depth"] and torch._C._current_autograd_node() is state["node"]:
                    phase = "recompute"
                else:
                    state["depth"] = 0
            state["labels"].append((state["part"], str(func)))
            cast = func is torch.ops.aten._to_copy.default and bool(args) and storage_key(args[0]) in self.params
            for tensor in (out if isinstance(out, (tuple, list)) else (out,)):
                if isinstance(tensor, torch.Tensor):
                    lifetimes.add(tensor, phase, state["part"], cast)
            return out

    autocast = regime == "autocast"
    series: dict = {}
    forward: dict = {}
    block_grads: dict = {}
    hook_sizes = None
    with FakeTensorMode(allow_non_fake_inputs=True):
        materialize(model)
        params = {storage_key(t) for t in (*model.parameters(), *model.buffers())}
        for param in model.parameters():  # the materialized ones
            if param.requires_grad:
                param.register_post_accumulate_grad_hook(grad_hook)
        for b, s in points:
            for param in model.parameters():
                param.grad = None
            recorder = Recorder(_Lifetimes(params), params)
            state.update(phase="forward", part="pre", depth=0, node=None, labels=[], recorder=recorder, hooked={},
                         hook_sizes={})
            amp = torch.autocast("cpu", dtype=torch.bfloat16) if autocast else torch.autocast("cpu", enabled=False)
            try:
                with masks_as_in_eager(), torch_linear(), grouped_mm_on_fake_tensors(), recorder:
                    with amp:
                        ids = torch.randint(0, vocab, (b, s))
                        loss = model(input_ids=ids, labels=ids).loss
                    start = recorder.lifetimes.t
                    state.update(phase="backward", part="post")
                    loss.backward()
                    del loss
            except (RuntimeError, NotImplementedError) as exc:
                raise traced_run_failed(cfg, exc) from None
            grads = {storage_key(p.grad) for p in model.parameters() if p.grad is not None}
            lifetimes = recorder.lifetimes
            hooked = {key: t for key, t in state["hooked"].items() if key in grads}
            series[(b, s)], block_grads[(b, s)] = _instants(lifetimes, start, state["labels"], grads, hooked)
            forward[(b, s)] = _forward_instants(lifetimes, start, state["labels"])
            hook_sizes = state["hook_sizes"] if hook_sizes is None else hook_sizes  # the same at every shape
    fit_points = points[:-1]
    return {"instants": _fit(series, points, facts["kinds"], _WEIGHTINGS, SERIES, part_ends=True),
            "forward_instants": _fit(forward, points, facts["kinds"], ((1, 1, 1),), FORWARD_SERIES),
            # Gradient bytes each part makes (the same at every shape): blocks, head ("post"), embedding ("pre").
            "block_grads": [float(block_grads[fit_points[0]].get(i, 0)) for i in range(len(facts["kinds"]))],
            "head_grads": float(block_grads[fit_points[0]].get("post", 0)),
            "embedding_grads": float(block_grads[fit_points[0]].get("pre", 0)),
            # Elements each gradient hook receives, in backward order, per part ("post", a block's index, "pre").
            "hook_sizes": hook_sizes,
            "reduced_kinds": list(facts["kinds"])}


def _checkpoint_blocks(model, selective: bool) -> None:
    """Checkpoint every block as the engines do (engines/base.py apply_activation_checkpointing:
    transformers' own non-reentrant checkpointing, SAC's context_fn for selective)."""
    kwargs = {"use_reentrant": False, **({"context_fn": sac.context_fn} if selective else {})}
    inner = getattr(model, "get_base_model", lambda: model)()
    if not getattr(inner, "supports_gradient_checkpointing", False):
        raise ShardfitError(f"{type(inner).__name__} has no gradient checkpointing of its own")
    if hasattr(inner, "activation_checkpointing_enable"):
        inner.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs, every_n_layers=1)
    else:
        inner.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


def _forward_instants(lifetimes: _Lifetimes, start: int, labels: list) -> dict:
    """{label: (activations, temporaries, weight copies)} after each forward op: a forward tensor alive
    when backward starts is an activation from its creation on (the tracker's rule), one freed before
    is a temporary; autocast's weight casts apart."""
    diff = {name: [0] * (start + 2) for name in FORWARD_SERIES}
    for nbytes, created, freed, phase, _, cast in [*lifetimes.done, *lifetimes.live.values()]:
        if created > start:
            continue
        name = "weight_copies" if cast else "activations" if freed > start else "temporaries"
        diff[name][created] += nbytes
        diff[name][min(freed + 1, start + 1)] -= nbytes
    return _labelled(diff, labels[:start], FORWARD_SERIES, lambda totals, i, part: tuple(totals[n] for n in FORWARD_SERIES))


def _labelled(diff: dict, labels: list, names, row) -> dict:
    """{"part|op#occurrence": row(running totals, op index, part)} after each op."""
    out, seen, totals = {}, {}, dict.fromkeys(diff, 0)
    for i, (part, op) in enumerate(labels, start=1):
        for name in diff:
            totals[name] += diff[name][i]
        occurrence = seen[(part, op)] = seen.get((part, op), -1) + 1
        out[f"{part}|{op}#{occurrence}"] = row(totals, i, part)
    return out


def _instants(lifetimes: _Lifetimes, start: int, labels: list, grads: set, hooked: dict) -> tuple[dict, dict]:
    """({label: (activations, grads of the running part, grads of parts done, temporaries, weight
    copies, grads whose hook has not finished, grads hooked)} after each backward op or hook, {part:
    the gradient bytes made in it}). hooked: a gradient's storage -> the moment its hook ran."""
    end = lifetimes.t
    size = end - start
    labels = labels[start:]
    parts = [part for part, _ in labels]
    diff = {name: [0] * (size + 2) for name in ("activations", "grads", "temporaries", "weight_copies",
                                                "grads_pending", "grads_hooked")}
    grad_by_part: dict = {}  # part -> [(created offset, bytes)]
    # A gradient is alive at the end: a freed storage's key may since belong to one.
    grad_records = {id(r): hooked.get(key) for key, r in lifetimes.live.items() if key in grads}
    for record in [*lifetimes.done, *lifetimes.live.values()]:
        nbytes, created, freed, phase, _, cast = record
        if created <= start and freed <= start:
            continue  # a forward temporary: gone before backward
        if cast:
            name = "weight_copies"
        elif id(record) in grad_records:
            name = "grads"
            grad_by_part.setdefault(parts[max(created - start, 1) - 1], []).append((created - start, nbytes))
            hook = grad_records[id(record)]
            hook = end + 1 if hook is None else hook  # never hooked: pending to the end
            # Pending from its creation through its hook's moment (the copy into a bucket ends it).
            diff["grads_pending"][max(created - start, 1)] += nbytes
            diff["grads_pending"][min(hook + 1, end + 1) - start] -= nbytes
            diff["grads_hooked"][min(hook, end + 1) - start] += nbytes
        elif phase in ("forward", "recompute"):
            name = "activations"
        else:
            name = "temporaries"
        # A storage freed after op t still lived while t made its outputs: alive through t.
        lo, hi = max(created - start, 1), min(freed + 1, end + 1) - start
        diff[name][lo] += nbytes
        diff[name][hi] -= nbytes
    def row(totals, i, part):
        current = sum(n for t, n in grad_by_part.get(part, ()) if t <= i)
        return (totals["activations"], current, totals["grads"] - current, totals["temporaries"],
                totals["weight_copies"], totals["grads_pending"], totals["grads_hooked"])

    out = _labelled(diff, labels, SERIES, row)
    return out, {part: sum(n for _, n in made) for part, made in grad_by_part.items()}


def _fit(series: dict, points: list, kinds: list, weightings, names, part_ends: bool = False) -> list:
    """The instants that peak at some traced shape under some engine's weighting, fitted exactly.
    part_ends (backward): also each part's last op (where FSDP reduce-scatters the part's gradients),
    and the largest instant from the first gradient hook on, its gradients in .grad counted only until
    their hook ran (DeepSpeed allocates its buckets in the first hook: a smaller instant after it can
    be the peak)."""
    fit_points, check = points[:-1], points[-1]
    common = set.intersection(*(set(by_label) for by_label in series.values()))
    chosen, ends = set(), set()
    for by_label in series.values():
        by_part: dict = {}
        for label in by_label:  # in op order
            if label in common:
                by_part.setdefault(label.split("|", 1)[0], []).append(label)
        for labels in by_part.values():
            for weights in weightings:
                chosen.add(max(labels, key=lambda label: sum(w * v for w, v in zip(weights, by_label[label]))))
            if part_ends:
                ops = [label for label in labels if f"|{_HOOK}#" not in label]
                ends.add((ops or labels)[-1])
                # and every hook moment (DeepSpeed reduces a full bucket there)
                chosen.update(label for label in labels if f"|{_HOOK}#" in label)
                hooked = [label for label in labels if by_label[label][6] > 0]
                if hooked:
                    chosen.add(max(hooked, key=lambda label: sum(w * v for w, v in zip(_WEIGHTINGS[-1],
                                                                                        by_label[label]))))
    instants = []
    for label in sorted(chosen | ends):
        fitted = {name: solve_exact({p: series[p][label][i] for p in fit_points}) for i, name in enumerate(names)}
        actual = sum(series[check][label])
        error = abs(sum(evaluate(c, *check) for c in fitted.values()) - actual) / max(actual, 1)
        if error > 0.01:
            continue  # an instant whose op sequence moves with the shape: not fitted
        part = label.split("|", 1)[0]
        block = int(part) if part.lstrip("-").isdigit() else -1
        instants.append({"part": "block" if block >= 0 else part, "block": block, "end": label in ends,
                         "hook": int(label.rsplit("#", 1)[1]) if f"|{_HOOK}#" in label else -1,
                         "kind": kinds[block] if 0 <= block < len(kinds) else -1,
                         **{name: {t: float(v) for t, v in c.items()} for name, c in fitted.items()}})
    return instants
