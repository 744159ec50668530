"""Activation coefficients for any transformers architecture, traced from the model's own code.

A reduced-depth copy of the model (the fewest layers that hold every block kind: spec/derive.py) is
built at its real widths on fake tensors (torch's FakeTensorMode: shapes and dtypes, no data, no
memory) and run forward with labels at six (micro-batch, sequence) points. A saved-tensors hook
records every tensor autograd keeps for backward, attributed to the block that was running (block
hooks) or to the parts before the first block (embedding) and after the last (final norm, head,
loss); casts of parameters (torch.autocast's weight cache) are counted apart. Each part's bytes are
an exact polynomial in b and s — b*s (per token), b*s^2 (materialised attention scores), s and s^2
(position tables, broadcast masks), b and a constant — so six points solve it exactly and a seventh
checks it. The estimator then scales the coefficients to any micro-batch, sequence and depth.

Mixture-of-experts: transformers' default experts kernel (grouped_mm) sorts the b*s*top_k routed rows
by expert and multiplies them in one grouped matmul, so what it saves does not depend on the routing
and traces exactly. A model whose experts loop over the tokens each expert received (data-dependent
shapes) cannot be traced: it gets one error line naming the alternatives. The per-expert imbalance
of the backward working set is not modelled (balanced routing is the stated assumption there).

Coefficients are cached with the spec (spec/spec_cache.py): only the first estimate of a given
(model, precision regime, attention kernel, LoRA) pays for the trace.
"""
from __future__ import annotations

from collections import defaultdict
from contextlib import contextmanager
from functools import lru_cache

from shardfit import sac
from shardfit.errors import ShardfitError
from shardfit.estimate.forward_timeline import Timeline, peak_instants
from shardfit.estimate.fake_tensors import masks_as_in_eager, materialize, storage_key, torch_linear
from shardfit.spec import rank_config, spec_cache
from shardfit.spec.derive import build_hf_model, find_blocks, quiet
from shardfit.spec.tp_modules import between_region_norms, colwise_owners
from shardfit.spec.models import derived_entry, derived_spec, load_hf_config

TERMS = ("per_token", "per_token_s", "per_position", "per_position_s", "per_sample", "const")


def trace_sequence_base(max_position: int) -> int:
    """The shortest traced sequence; the others are 2x and 3x it (a 4th point checks the fit)."""
    if max_position and max_position < 4 * 64:
        return max(8, (max_position // 4) // 8 * 8)
    return 64


def solve_exact(points: dict) -> dict:
    """Exact coefficients of v = A*b*s + B*b*s^2 + C*s + D*s^2 + E*b + F from v at b in (1, 2) and
    three sequence lengths: the b-dependent part from differences, the rest from b = 1."""
    # NOTE: imported here, with the tracer's torch: a cached `plan` never solves, and fractions (with
    # decimal) is a noticeable part of its import time.
    from fractions import Fraction

    lengths = sorted({s for _, s in points})
    per_b = [Fraction(points[(2, s)] - points[(1, s)]) for s in lengths]
    flat = [Fraction(points[(1, s)]) - d for s, d in zip(lengths, per_b)]
    a, b_, e = _quadratic(lengths, per_b)
    c, d, f = _quadratic(lengths, flat)
    return {"per_token": a, "per_token_s": b_, "per_position": c, "per_position_s": d, "per_sample": e, "const": f}


def _quadratic(xs, ys):
    """(linear, quadratic, constant) of the parabola through three points."""
    (x0, x1, x2), (y0, y1, y2) = xs, ys
    q = ((y2 - y0) / (x2 - x0) - (y1 - y0) / (x1 - x0)) / (x2 - x1)
    lin = (y1 - y0) / (x1 - x0) - q * (x0 + x1)
    return lin, q, y0 - lin * x0 - q * x0 * x0


def evaluate(coef: dict, b: int, s: int) -> float:
    return float(coef["per_token"] * b * s + coef["per_token_s"] * b * s * s + coef["per_position"] * s
                 + coef["per_position_s"] * s * s + coef["per_sample"] * b + coef["const"])


def sliding_window(cfg: dict) -> int | None:
    """The sliding window of a config whose layers use one (Mistral: every layer; Gemma-2/3, Qwen3 with
    use_sliding_window: the `sliding_attention` layer types), else None."""
    for part in (cfg, cfg.get("text_config") or {}):
        window = part.get("sliding_window")
        if isinstance(window, int) and window > 0 and part.get("use_sliding_window", True) is not False:
            types = part.get("layer_types")
            if not types or any("sliding" in str(kind) for kind in types):
                return window
    return None


def _window_below(cfg: dict, length: int) -> dict:
    """Overrides that put the sliding window below every traced length. NOTE: a window shorter than
    the sequence is what changes the code path (transformers then builds the sliding mask and SDPA
    gets it instead of is_causal); its exact width only changes which scores are masked."""
    window = max(1, length // 2)
    overrides = {"sliding_window": window} if isinstance(cfg.get("sliding_window"), int) else {}
    text = cfg.get("text_config")
    if isinstance(text, dict) and isinstance(text.get("sliding_window"), int):
        overrides["text_config"] = {**text, "sliding_window": window}
    return overrides


def trace_coefficients(cfg: dict, facts: dict, regime: str, attention: str, lora: tuple | None,
                       beyond_window: bool = False) -> dict:
    """Traced coefficients (floats) of every part: {"kinds": [..per block kind..], "pre", "post",
    "first_extra", "weight_copies": {"kinds": [...], "head": n}, "check_error", "experts"}.
    beyond_window: traced at sequences longer than the sliding window (what a longer run runs)."""
    return run_trace(cfg, _trace, cfg, facts, regime, attention, lora, beyond_window)


def run_trace(cfg, trace, *args):
    """trace(*args), quiet, with a model whose code fake tensors cannot follow as one error line."""
    try:
        with quiet():
            return trace(*args)
    except _DataDependent as exc:
        raise ShardfitError(f"{cfg.get('model_type')}: the forward cannot be traced on fake tensors ({exc}); "
                            f"plan it as a states-only model with --params, or pass a factory 'pkg.module:fn'") from None


class _DataDependent(Exception):
    pass


@contextmanager
def grouped_mm_on_fake_tensors():
    """NOTE: transformers' default experts kernel (grouped_mm: sort the b*s*top_k routed rows by
    expert, one grouped matmul) has static shapes whatever the routing, but torch's meta kernel of
    grouped_mm accepts only bf16; the real CPU kernel takes fp32 as well. transformers' own fallback
    op computes the same product with the same saved tensors and traces in every dtype."""
    try:
        from transformers.integrations import moe
        original = moe._can_use_grouped_mm
    except (ImportError, AttributeError):
        yield False
        return
    moe._can_use_grouped_mm = lambda *args, **kwargs: False
    try:
        yield True
    finally:
        moe._can_use_grouped_mm = original


def reduced_model(cfg, facts, regime, attention, lora, beyond_window=False):
    """The reduced-depth copy on the meta device, in training mode: (model, its blocks, the traced
    points [(b, s)...], vocabulary). The last point checks the fit of the others."""
    import torch

    dtype = torch.bfloat16 if regime == "half" else torch.float32
    base = trace_sequence_base(facts.get("max_position") or 0)
    overrides = dict(facts.get("overrides") or {})
    if beyond_window:
        overrides.update(_window_below({**cfg, **overrides}, base))
    model = build_hf_model(cfg, device="meta", dtype=dtype, attn_implementation=attention, overrides=overrides)
    blocks = find_blocks(model)
    if len(blocks) != len(facts["kinds"]):
        raise ShardfitError(f"{cfg.get('model_type')}: the reduced copy has {len(blocks)} blocks, "
                            f"expected {len(facts['kinds'])}")
    if lora is not None:
        model = _with_lora(model, lora)
    model.train()
    vocab = int(getattr(model.config.get_text_config(), "vocab_size", 0) or 0)
    if not vocab:
        raise ShardfitError(f"{cfg.get('model_type')}: tracing needs a model with a vocabulary (input_ids and labels)")
    points = [(b, s * base) for s in (1, 2, 3) for b in (1, 2)] + [(3, 4 * base)]
    return model, blocks, points, vocab


def traced_run_failed(cfg, exc) -> Exception:
    """The one-line error for a forward or backward that fake tensors cannot run."""
    text = str(exc)
    if "data-dependent" in text.lower() or "DynamicOutputShape" in type(exc).__name__ or "dynamic" in text.lower():
        return _DataDependent(text.splitlines()[0][:160])
    return ShardfitError(f"{cfg.get('model_type')}: tracing the forward failed ({type(exc).__name__}: "
                         f"{text.splitlines()[0][:200]})")


def _trace(cfg, facts, regime, attention, lora, beyond_window=False) -> dict:
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.utils._python_dispatch import TorchDispatchMode

    model, blocks, points, vocab = reduced_model(cfg, facts, regime, attention, lora, beyond_window)
    kinds = facts["kinds"]
    state = {"part": "pre", "norm": False}
    for index, block in enumerate(blocks):
        block.register_forward_pre_hook(lambda _m, _a, i=index: state.__setitem__("part", i))
        block.register_forward_hook(lambda _m, _a, _o: state.__setitem__("part", "post"))
    # What the norms between the TP regions save (sequence parallel runs them on sequence shards).
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    plan = dict(getattr(base, "_tp_plan", None) or {})
    norms = set(between_region_norms(base, plan)) if plan else set()
    owners = set(colwise_owners(base, plan)) if plan else set()
    gathered: dict = defaultdict(list)  # part -> the storage of each colwise owner's input, in order
    for name, module in base.named_modules():
        if name in norms:
            module.register_forward_pre_hook(lambda _m, _a: state.__setitem__("norm", True))
            module.register_forward_hook(lambda _m, _a, _o: state.__setitem__("norm", False))
        if name in owners:
            module.register_forward_pre_hook(lambda _m, args, kwargs: _note_input(gathered, state["part"], args, kwargs),
                                             with_kwargs=True)
    autocast = regime == "autocast"

    class Recorder(TorchDispatchMode):
        """Marks outputs of a dtype cast of a parameter (torch.autocast's cached 16-bit weights), and
        counts per block what per-op selective checkpointing would keep (shardfit/sac.py's policy
        applied to the same ops in the same order)."""

        def __init__(self, params, timeline):
            super().__init__()
            self.params, self.casts, self.timeline = params, set(), timeline
            self.kept: dict = {}  # part -> {(storage key, creating op): bytes}
            self.counts: dict = {}
            # part -> aten ops dispatched. NOTE: fake tensors also dispatch prim.device queries (~130
            # per Llama block) that a real run never does; those are not counted.
            self.ops: dict = defaultdict(int)

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if func is torch.ops.aten._to_copy.default and args and storage_key(args[0]) in self.params:
                self.casts.add(storage_key(out))
            part = state["part"]
            outputs = [t for t in (out if isinstance(out, (tuple, list)) else (out,)) if isinstance(t, torch.Tensor)]
            self.timeline.op(part, outputs, str(func))
            if getattr(func, "namespace", "aten") != "prim":
                self.ops[part] += 1
            if isinstance(part, int) and sac.keeps(func, self.counts.setdefault(part, defaultdict(int))):
                for tensor in outputs:
                    # NOTE: keyed by storage and the op that created it: a freed storage's key is reused.
                    self.kept.setdefault(part, {})[self.timeline.lifetime(tensor)] = tensor.untyped_storage().nbytes()
            return out

    measured: dict = {}
    normed: dict = {}  # (b, s) -> {part: bytes the between-region norms saved}
    kept: dict = {}
    copies: dict = {}
    instants: dict = {}  # (b, s) -> {block index: [(saved, temporaries) per op]}
    ops: dict = {}  # block index -> aten ops its forward dispatches (the same at every shape)
    with FakeTensorMode(allow_non_fake_inputs=True):
        materialize(model)
        params = {storage_key(t) for t in (*model.parameters(), *model.buffers())}
        for b, s in points:
            saved: dict = {}
            keep = []
            in_norms = normed.setdefault((b, s), {})

            def pack(tensor, saved=saved, keep=keep, in_norms=in_norms):
                key = storage_key(tensor)
                if key not in params and key not in saved:
                    saved[key] = (state["part"], tensor.untyped_storage().nbytes())
                    keep.append(tensor)
                    if state["norm"]:
                        in_norms[state["part"]] = in_norms.get(state["part"], 0) + tensor.untyped_storage().nbytes()
                return tensor

            input_ids = torch.randint(0, vocab, (b, s))
            state["part"] = "pre"
            gathered.clear()  # NOTE: one forward's inputs only (a freed storage's key is reused)
            # Only autocast's casts are weight copies: a 16-bit model's own fp32 casts (Gemma's
            # 1 + weight) are ordinary saved tensors.
            timeline = Timeline(storage_key, params)
            recorder = Recorder(params if autocast else set(), timeline)
            amp = torch.autocast("cpu", dtype=torch.bfloat16) if autocast else torch.autocast("cpu", enabled=False)
            try:
                with (masks_as_in_eager(), torch_linear(), grouped_mm_on_fake_tensors(),
                      torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), amp, recorder):
                    model(input_ids=input_ids, labels=input_ids)
            except (RuntimeError, NotImplementedError) as exc:
                raise traced_run_failed(cfg, exc) from None
            parts: dict = {}
            weight: dict = {}
            for key, (part, nbytes) in saved.items():
                target = weight if key in recorder.casts else parts
                target[part] = target.get(part, 0) + nbytes
            measured[(b, s)] = parts
            instants[(b, s)] = {part: timeline.block_instants(part, saved, recorder.casts) for part in timeline.blocks}
            kept[(b, s)] = {part: sum(sizes.values()) for part, sizes in recorder.kept.items()}
            ops = dict(recorder.ops)
            copies = weight
            keep.clear()
    # Under sequence parallel each owner all-gathers its own copy of its input: owners that read the
    # same tensor under TP alone (Cohere's parallel attention and MLP) save one more full copy each.
    extra = {part: len(keys) - len(set(keys)) for part, keys in gathered.items()}
    return _coefficients(measured, kept, copies, kinds, points,
                         getattr(model.config, "_experts_implementation", None) or "", instants, ops, normed, extra)


def _note_input(gathered: dict, part, args, kwargs) -> None:
    """Record the storage of a module's hidden-states input (first positional or `hidden_states=`)."""
    import torch

    hidden = kwargs.get("hidden_states", args[0] if args else None)
    if isinstance(hidden, torch.Tensor):
        gathered[part].append(storage_key(hidden))


def _coefficients(measured: dict, kept: dict, copies: dict, kinds: list, points: list, experts: str,
                  instants: dict, ops: dict, normed: dict, extra_gathers: dict) -> dict:
    fit_points, check = points[:-1], points[-1]

    def solve(part, table=measured):
        return solve_exact({p: table[p].get(part, 0) for p in fit_points})

    n_kinds = max(kinds) + 1
    # The representative block of each kind: its last occurrence in the reduced copy (never block 0
    # when the kind repeats: block 0 also claims the rotary tables every block shares).
    last = {kind: index for index, kind in enumerate(kinds)}
    per_kind = [solve(last[k]) for k in range(n_kinds)]
    pre, post = solve("pre"), solve("post")
    # What blocks other than the representatives save beyond their kind's coefficients (block 0's
    # rotary tables, a frozen first input under LoRA): counted once, with the embedding.
    extra = {t: 0 for t in TERMS}  # becomes a Fraction as the solved terms add up
    for index, kind in enumerate(kinds):
        if index != last[kind]:
            own = solve(index)
            for t in TERMS:
                extra[t] += own[t] - per_kind[kind][t]
    predicted = (sum(evaluate(per_kind[k], *check) for k in kinds) + evaluate(pre, *check)
                 + evaluate(post, *check) + evaluate(extra, *check))
    actual = sum(measured[check].values())
    error = abs(predicted - actual) / max(actual, 1)
    as_float = lambda c: {t: float(v) for t, v in c.items()}  # noqa: E731
    return {"kinds": [as_float(c) for c in per_kind], "pre": as_float(pre), "post": as_float(post),
            "first_extra": as_float(extra), "check_error": error, "experts": experts,
            # What per-op selective checkpointing keeps in each kind's block (beyond its input).
            "selective_kinds": [as_float(solve(last[k], kept)) for k in range(n_kinds)],
            # The aten ops each kind's block dispatches in forward: what per-op selective checkpointing's
            # policy runs for, in forward and again in the recompute (fit/engine_overhead.py).
            "block_ops": [int(ops.get(last[k], 0)) for k in range(n_kinds)],
            # What each kind's norms between the TP regions save, and the final norm's ("post"):
            # sequence parallel runs them on sequence shards (estimate/model_parallel.py).
            "sp_norm_kinds": [as_float(solve(last[k], normed)) for k in range(n_kinds)],
            "sp_norm_post": as_float(solve("post", normed)),
            # Colwise owners per kind's block that read an input another owner read (one more gathered
            # copy each under sequence parallel).
            "sp_extra_gathers": [int(extra_gathers.get(last[k], 0)) for k in range(n_kinds)],
            # The peak instants inside each kind's block, split as the tracker files them.
            "forward_inside": [[{name: as_float(c) for name, c in instant.items()} for instant in
                                peak_instants({p: instants[p][last[k]] for p in points}, fit_points, check,
                                              solve_exact, evaluate)]
                               for k in range(n_kinds)],
            "weight_copies": {"kinds": [float(copies.get(last[k], 0)) for k in range(n_kinds)],
                              "head": float(sum(v for p, v in copies.items() if not isinstance(p, int)))}}


def _with_lora(model, lora: tuple):
    from peft import LoraConfig, get_peft_model

    rank, targets, _base = lora
    config = LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=list(targets) if "all-linear" not in targets
                        else "all-linear",
                        # peft's CAUSAL_LM wrapper needs generate()'s hooks: an encoder (BERT) gets the plain one.
                        task_type="CAUSAL_LM" if hasattr(model, "prepare_inputs_for_generation") else None)
    return get_peft_model(model, config)


def lora_key(lora) -> str:
    return "none" if lora is None else f"r{lora[0]}:{','.join(lora[1])}:{lora[2]}"


def load_coefficients(spec, regime: str, attention: str, lora, beyond_window: bool = False) -> dict:
    """The cached coefficients of a derived spec, tracing (torch) on a miss. beyond_window: the set
    for sequences longer than the model's sliding window (see window_of)."""
    key = f"{regime}|{attention}|{lora_key(lora)}" + ("|beyond-window" if beyond_window else "")
    return cached_set(spec, key, lambda cfg, facts: trace_coefficients(cfg, facts, regime, attention, lora,
                                                                       beyond_window))


def cached_set(spec, key: str, compute) -> dict:
    """One named set of a derived spec's traced terms from its cache entry; compute(config, facts) on a
    miss, then written back (atomically) for the next run."""
    entry = _entry(spec)
    coefficients = entry.setdefault("coefficients", {})
    if key not in coefficients:
        coefficients[key] = compute(entry["config"], entry["facts"])
        spec_cache.write_entry(spec.config_hash, entry)
    return coefficients[key]


@lru_cache(maxsize=256)
def window_of(spec) -> int | None:
    """The sliding window of a derived spec's config (None: no layer slides). A sequence longer than
    it runs other code (the sliding mask materialised, SDPA given it instead of is_causal): the
    estimate then takes the coefficients traced beyond the window."""
    return sliding_window(_entry(spec)["config"])


def _entry(spec) -> dict:
    entry = spec_cache.read_entry(spec.config_hash) if spec.config_hash else None
    return entry if entry is not None else _entry_from_source(spec)


def source_config(spec, why: str) -> dict:
    """The config a spec was derived from, read again from its source (a rank's sliced config: the
    base config with the overrides its source names, spec/rank_config.py)."""
    base, overrides = rank_config.decode_source(spec.source)
    try:
        return rank_config.with_overrides(load_hf_config(base), overrides) if overrides else load_hf_config(base)
    except ShardfitError:
        raise ShardfitError(f"model '{spec.name}': {why}, and its config '{spec.source}' cannot be read: "
                            f"plan it from its config.json") from None


def twin(spec):
    """The derived spec of a hand-written family's config: what the tracer needs for terms the
    hand-written rules do not model (per-op selective checkpointing)."""
    cfg = source_config(spec, "selective checkpointing is traced from the model's config")
    return derived_spec(cfg, spec.name, spec.source)


def _entry_from_source(spec) -> dict:
    """The cache entry was cleared: derive it again from the config the spec came from."""
    cfg = source_config(spec, "its derived coefficients are not cached")
    return derived_entry(cfg, spec.name, spec.source)


__all__ = ["load_coefficients", "trace_coefficients", "evaluate", "window_of", "sliding_window"]
