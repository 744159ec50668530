"""`fit`: search the plan space, keep what the estimator says fits with margin, rank by step time.

Inside each strategy family the micro-batch is found by bisection over the divisors of the
per-rank batch (memory grows with micro-batch, so the largest that fits is found in log₂ steps),
for each activation-checkpointing setting and DeepSpeed buffer variant. Accumulation makes up the
rest of the global batch. Every plan returned was checked by the estimator itself.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace

from shardfit.errors import ShardfitError
from shardfit.estimate.estimator import estimate
from shardfit.estimate.selective import selective_available
from shardfit.fit.explain import Rejection, explain_rejections
from shardfit.fit.families import AC_OPTIONS, BUCKET_VARIANTS, TIE, Family, bucket_changes, engine_of, families
from shardfit.fit.host import assumption_note, needs_text, over_assumed
from shardfit.fit.kernels import chunked_rung, kernel_notes, loss_options, optimizer_impl_for, with_loss
from shardfit.fit.layouts import layout_notes, micro_options_for, parallel_families
from shardfit.fit.parallel_time import step_time
from shardfit.fit.steptime import EFFICIENCY_FULL_TOKENS, StepTime
from shardfit.fit.suggest import suggest
from shardfit.fit.pins import pin_ac, pin_error, pin_micro_batch, pin_strategy, pinned
from shardfit.fit.request import FitRequest
from shardfit.fit.rungs import rung_note, rungs_for
from shardfit.spec.fsdp_units import separate_embedding_units
from shardfit.spec.gpus import GPU, get_gpu
from shardfit.spec.plan import Plan, validate_plan
from shardfit.units import fmt_bytes

GIB = 1024**3
MAX_MICRO_BATCH = 64


@dataclass(frozen=True, kw_only=True)
class Candidate:
    family: str
    plan: Plan
    peak_bytes: int  # what is compared with the budget (device peak, or tensor peak on CPU)
    time: StepTime
    order: int
    host_bytes: int = 0  # host RAM per node (offloaded states, pinned buffers)
    nvme_bytes: int = 0  # NVMe per node (ZeRO-Infinity)
    rung: str = ""  # the state rung (fit/rungs.py) this plan needed, "" for full-precision states

    @property
    def label(self) -> str:
        t = self.plan.training
        loss = f" loss=chunked:{t.loss_chunks}" if t.loss == "chunked" else ""
        text = f"{self.family} mb={t.micro_batch} accum={t.grad_accum} ac={t.activation_checkpointing}{loss}"
        return text + (f" ({self.rung})" if self.rung else "")


@dataclass(frozen=True, kw_only=True)
class FitResult:
    request: FitRequest
    gpu: GPU
    usable_bytes: int
    best: Candidate | None
    alternatives: tuple[Candidate, ...]
    rejected: tuple[Rejection, ...]
    notes: tuple[str, ...]
    suggestions: tuple[str, ...] = ()
    estimates: int = 0  # estimator calls made
    smallest: dict = field(default_factory=dict)  # family -> (peak bytes, plan) of its leanest plan that doesn't fit
    largest_term: tuple[str, int] | None = None  # the best plan's largest term beyond the model states

    @property
    def fits(self) -> bool:
        return self.best is not None


def _estimate_fn(estimate_fn, device: str):
    if estimate_fn is not None:
        return estimate_fn
    return lambda plan: estimate(plan, device=device)


# Terms that together are the loss's buffers (head output, logits and their fp32 upcast, the loss's
# saved inputs and its b*s*V gradients): reported as one, the way the field names them.
LOSS_TERMS = ("activations.head", "temporaries.logits_and_upcast", "temporaries.loss_inputs", "temporaries.loss_backward")
TERM_NAMES = {"activations.blocks": "activations saved by the blocks", "loss": "loss buffers (logits, fp32 upcast, gradients)"}


def largest_term(est) -> tuple[str, int] | None:
    """The largest quantity beyond parameters, gradients and optimizer states (and runtime overhead),
    with the loss's buffers summed as one."""
    sizes: dict[str, int] = {}
    for term in est.terms:
        if term.name.startswith(("states.", "overhead.")) or term.name == "activations.block":
            continue
        key = "loss" if term.name in LOSS_TERMS else term.name
        sizes[key] = sizes.get(key, 0) + term.bytes
    if not sizes:
        return None
    key = max(sizes, key=sizes.get)
    return TERM_NAMES.get(key, key.split(".", 1)[-1].replace("_", " ")), sizes[key]


def divisors(n: int, cap: int = MAX_MICRO_BATCH) -> list[int]:
    return [d for d in range(1, min(n, cap) + 1) if n % d == 0]


def _precision(request: FitRequest, gpu: GPU) -> tuple[str, bool | None, str]:
    if request.pins.precision:
        return request.pins.precision, (True if request.pins.precision == "fp16" else None), f"precision {request.pins.precision} (as asked)"
    if gpu.supports_bf16:
        return "bf16", None, f"bf16: {gpu.name} supports it (no loss scaling needed)"
    return "fp16", True, f"fp16 with dynamic loss scaling: {gpu.name} has no bf16"


class _Search:
    def __init__(self, request: FitRequest, estimate_fn):
        self.request = request
        self.estimate = _estimate_fn(estimate_fn, request.options.device)
        self.gpu = request.options.device_profile or get_gpu(request.base.cluster.gpu)
        self.usable = int(self.gpu.memory_bytes * (1.0 - request.options.margin))
        self.calls = 0
        self._cache: dict = {}

    def run(self, plan: Plan):
        """The estimator's answer for `plan`, memoised (Plans are frozen and hashable)."""
        if plan not in self._cache:
            self.calls += 1
            self._cache[plan] = self.estimate(plan)
        return self._cache[plan]

    def peak(self, plan: Plan) -> int:
        est = self.run(plan)
        return est.device_peak_bytes if self.request.options.device == "cuda" else est.peak_bytes

    def host_bytes(self, plan: Plan) -> int:
        """Host RAM per node (offloaded states, pinned buffers)."""
        return sum(self.run(plan).host.values()) * plan.cluster.gpus_per_node

    def nvme_bytes(self, plan: Plan) -> int:
        return self.run(plan).nvme_bytes * plan.cluster.gpus_per_node

    def host_ok(self, plan: Plan) -> bool:
        limit = self.request.base.cluster.host_memory_gib
        return limit is None or self.host_bytes(plan) <= limit * GIB

    def fits(self, plan: Plan, limit: int | None = None) -> bool:
        return self.peak(plan) <= (self.usable if limit is None else limit) and self.host_ok(plan)


def _make_plan(base: Plan, family: Family, ac: str, buckets: str, micro: int, per_rank: int,
               seq: int, precision: str, loss_scaling, request: FitRequest, rung_training: dict | None = None) -> Plan:
    strategy = family.strategy
    if strategy.is_deepspeed:
        changes = bucket_changes(buckets, base.model.hidden_size)
        if changes:
            strategy = replace(strategy, **changes)
    # The base Plan already holds the request's model, cluster, sequence, LoRA, optimizer and loss chunks.
    if family.parallelism is not None:  # per_rank counts sequences per dp rank: world / (tp x cp x pp) of them
        base = base.with_changes(parallelism=family.parallelism)
    return base.with_changes(
        strategy=strategy,
        training={"micro_batch": micro, "grad_accum": per_rank // micro, "seq_len": seq, "precision": precision,
                  "loss_scaling": loss_scaling, "activation_checkpointing": ac,
                  "optimizer_impl": optimizer_impl_for(request, strategy), "loss": request.pins.loss or "standard",
                  # a state rung's optimizer has its own kernel: its implementation is "auto"
                  **({"optimizer_impl": request.pins.optimizer_impl or "auto"} if (rung_training or {}).get("optimizer")
                     not in (None, "adamw", "sgd") else {}),
                  **(rung_training or {})})


def _largest_fitting(search: _Search, make, micro_options: list[int]) -> Plan | None:
    """Bisection: the largest micro-batch whose plan fits (memory is monotone in micro-batch)."""
    lo, hi, best = 0, len(micro_options) - 1, None
    while lo <= hi:
        mid = (lo + hi) // 2
        plan = make(micro_options[mid])
        if search.fits(plan):
            best, lo = plan, mid + 1
        else:
            hi = mid - 1
    return best


def _sorted(cands: list[Candidate]) -> list[Candidate]:
    """Fastest first; within TIE of each other the field's order (simpler family, less AC) wins."""
    out = sorted(cands, key=lambda c: (c.time.total_s, c.order))
    changed = True
    while changed:
        changed = False
        for i in range(len(out) - 1):
            a, b = out[i], out[i + 1]
            if b.order < a.order and b.time.total_s <= a.time.total_s * (1 + TIE):
                out[i], out[i + 1] = b, a
                changed = True
    return out


def _search_family(search: _Search, fam: Family, make_for, ac_options, micro_options):
    """Each AC setting and buffer variant's largest fitting micro-batch (and the chunked loss's, where it
    is what makes the setting fit), ranked; and, when none fits, the leanest plan tried."""
    cands: list[Candidate] = []
    # Under tp the loss is vocab-parallel (V / tp logits per rank): the chunked loss is not searched there.
    losses = loss_options(search.request, search.request.base.model) if fam.parallelism is None else ("standard",)
    lean: tuple[int, Plan] | None = None
    variants = BUCKET_VARIANTS if fam.strategy.is_deepspeed else ("default",)
    for ac in ac_options:
        for buckets in variants:
            make = make_for(fam, ac, buckets)
            plan = _largest_fitting(search, make, micro_options)
            chunked = None
            if "chunked" in losses and make(micro_options[0]).training.loss == "standard":  # the next rung
                chunked = chunked_rung(lambda m: _largest_fitting(search, m, micro_options), make, micro_options,
                                       plan, search.request.base.training.loss_chunks)
            if plan is None and chunked is None:
                tried = make(micro_options[0])
                if "chunked" in losses:
                    tried = with_loss(tried, "chunked", search.request.base.training.loss_chunks)
                peak = search.peak(tried) if search.host_ok(tried) else 2**62
                if lean is None or peak <= lean[0]:  # ties go to the later, leaner setting
                    lean = (peak, tried)
                continue
            for found in (p for p in (plan, chunked) if p is not None):
                cands.append(Candidate(family=fam.label, plan=found, peak_bytes=search.peak(found),
                                       time=step_time(found, search.gpu), host_bytes=search.host_bytes(found),
                                       nvme_bytes=search.nvme_bytes(found),
                                       order=fam.order * 10 + ac_options.index(ac) * 2 + variants.index(buckets)))
    return _sorted(cands), (lean if not cands else None)


def _climb_rungs(search: _Search, request: FitRequest, precision: str, loss_scaling, base: Plan, per_rank: int,
                 all_families, ac_options, micro_options, found: dict):
    """The first state rung (fit/rungs.py) under which a family without offload fits: its candidates go
    into `found`; the rung is returned (None when none makes anything fit)."""
    for rung in rungs_for(request, precision):
        def make_for(fam: Family, ac: str, buckets: str, rung=rung):
            return lambda micro: _make_plan(base, fam, ac, buckets, micro, per_rank, request.base.training.seq_len, precision,
                                            loss_scaling, request, rung.training)
        hits = {}
        for fam in (f for f in all_families if f.tier == 0 and f.parallelism is None):
            try:
                validate_plan(make_for(fam, "none", "default")(micro_options[0]))
            except ShardfitError:
                continue  # e.g. pure bf16 under DeepSpeed (it always keeps fp32 masters)
            cands, _ = _search_family(search, fam, make_for, ac_options, micro_options)
            if cands:
                hits[fam.label] = [replace(c, rung=rung.name) for c in cands]
        if hits:
            found.update(hits)
            return rung
    return None


def fit(request: FitRequest, estimate_fn=None) -> FitResult:
    """The fastest plan predicted to fit with margin, alternatives, and why each family lost."""
    base, options = request.base, request.options
    model, cluster = base.model, base.cluster
    if not 0 <= options.margin < 1:
        raise ShardfitError(f"--margin must be between 0 and 1 (a fraction of device memory), got {options.margin}")
    if request.base.training.seq_len < 1 or cluster.gpus_per_node < 1 or cluster.nodes < 1:
        raise ShardfitError("--seq, --gpus and --nodes must be at least 1")
    search = _Search(request, estimate_fn)
    world = cluster.world_size
    global_batch = options.global_batch or 4 * world
    if global_batch < world or global_batch % world:
        lower, upper = (global_batch // world) * world, -(-global_batch // world) * world
        hint = f"{lower} or {upper}" if lower else f"{upper}"
        raise ShardfitError(f"--global-batch {global_batch} is not a multiple of the {world} GPUs: use {hint}")
    per_rank = global_batch // world
    precision, loss_scaling, precision_note = _precision(request, search.gpu)
    notes = [precision_note,
             f"global batch {global_batch} = micro-batch x accumulation x {world} GPUs ({per_rank} sequence{'' if per_rank == 1 else 's'} per GPU)",
             f"usable memory {fmt_bytes(search.usable)} of {search.gpu.memory_gib:g} GiB "
             f"({options.margin:.0%} margin{'' if options.device == 'cuda' else ', tensor bytes only: CPU run'})",
             assumption_note(request, search.gpu)]
    micro_options = divisors(per_rank)
    ac_options = AC_OPTIONS if model.has_shape else ("none",)
    if not selective_available(model):
        ac_options = tuple(ac for ac in ac_options if ac != "selective")
    all_families = [f for f in families(cluster.gpus_per_node, cluster.nodes, model.hidden_size, options.nvme_path)
                    if engine_of(f.strategy) in options.engines]
    if not all_families:
        raise ShardfitError(f"--engine {','.join(options.engines)} leaves nothing to search on {world} GPU(s): use "
                            "ddp, deepspeed or fsdp (single is for one GPU)")
    ac_options = pin_ac(request, ac_options, selective_available(model))
    micro_options = pin_micro_batch(request, micro_options, per_rank)
    all_families = pin_strategy(request, all_families)
    if options.layouts and "fsdp" in options.engines and base.training.lora is None and request.pins.strategy is None:
        # tp x pp x cp layouts (fit/layouts.py), after the data-parallel families without offload.
        split = next((i for i, f in enumerate(all_families) if f.tier > 0), len(all_families))
        all_families[split:split] = parallel_families(model, cluster, base.training.seq_len)

    def rank_batch(fam: Family) -> int:
        """Sequences per data-parallel rank: world / (tp x cp x pp) ranks share the global batch."""
        return per_rank * (fam.parallelism.model_parallel if fam.parallelism else 1)

    def micro_for(fam: Family) -> list[int]:
        if fam.parallelism is None:
            return micro_options
        pinned_micro = pin_micro_batch(request, divisors(rank_batch(fam)), rank_batch(fam))
        # 1F1B runs at least pp micro-batches (torch's Schedule1F1B refuses fewer: validate_parallelism).
        enough = [m for m in pinned_micro if rank_batch(fam) // m >= fam.parallelism.pp] or pinned_micro[:1]
        return micro_options_for(fam.parallelism, enough, base.training.seq_len, EFFICIENCY_FULL_TOKENS)

    def make_for(fam: Family, ac: str, buckets: str):
        return lambda micro: _make_plan(base, fam, ac, buckets, micro, rank_batch(fam), request.base.training.seq_len,
                                        precision, loss_scaling, request)

    # Families the request rules out (e.g. DeepSpeed offload with 8-bit Adam, pure bf16 on DeepSpeed). A
    # model-parallel layout the plan's own validation refuses is dropped without a line.
    invalid: dict[str, str] = {}
    for fam in all_families:
        try:
            validate_plan(make_for(fam, "none", "default")(micro_for(fam)[0]))
        except ShardfitError as exc:
            invalid[fam.label] = str(exc)
    layouts_refused = {f.label for f in all_families if f.parallelism is not None and f.label in invalid}
    all_families = [f for f in all_families if f.label not in invalid]
    invalid = {label: why for label, why in invalid.items() if label not in layouts_refused}

    found: dict[str, list[Candidate]] = {}
    smallest: dict[str, tuple[int, Plan]] = {}
    searched_tiers: set[int] = set()
    rung = None
    for tier in (0, 1, 2):  # offload tiers only when the tier before found nothing
        if any(found.values()):
            break
        if tier == 1:  # the state rungs come before offload
            rung = _climb_rungs(search, request, precision, loss_scaling, base, per_rank, all_families,
                                ac_options, micro_options, found)
            if rung is not None:
                searched_tiers.add(0)
                break
        searched_tiers.add(tier)
        for fam in (f for f in all_families if f.tier == tier):
            if fam.parallelism is not None:
                # A layout whose leanest plan (micro-batch 1, the last AC setting: full) does not fit is
                # out in one estimate: memory only grows with micro-batch and less recompute.
                leanest = make_for(fam, ac_options[-1], "default")(micro_for(fam)[0])
                if not search.fits(leanest):
                    found[fam.label], smallest[fam.label] = [], (search.peak(leanest), leanest)
                    continue
            found[fam.label], lean = _search_family(search, fam, make_for, ac_options, micro_for(fam))
            if lean is not None:
                smallest[fam.label] = lean
    ranked = _sorted([c[0] for c in found.values() if c])
    if world == 1:
        # NOTE: on one GPU every other family runs the same step plus its wrapper's buffers (DDP's bucket
        # copy of every gradient, DeepSpeed's buckets, FSDP's flat parameters) with nothing to shard or
        # reduce, and a second launcher to get right: single wins whenever it fits.
        ranked.sort(key=lambda c: c.family != "single")
    # A plan beyond the assumed host RAM (--host-memory-gib unset) is kept but flagged, and ranked after
    # every plan within it: it is never the recommendation while one within it fits.
    ranked.sort(key=lambda c: over_assumed(c.host_bytes, request, search.gpu))
    best = ranked[0] if ranked else None
    if best is not None and best.rung:
        full = best.plan.with_changes(training={"optimizer": request.base.training.optimizer, "precision": precision})
        before = search.peak(full)
        notes.append(rung_note(rung, best.family, before - best.peak_bytes, before, best.peak_bytes, fmt_bytes))
    if best is not None and separate_embedding_units(best.plan.strategy, best.plan.model):
        root = search.peak(best.plan.with_changes(strategy={"embedding_units": "root"}))
        if root > best.peak_bytes:  # not when the peak is elsewhere (the optimizer step)
            notes.append(f"fsdp2 wraps the embedding and head as units of their own (torchtitan): "
                         f"{fmt_bytes(root - best.peak_bytes)} per GPU less than keeping them in the root unit")
    if best is not None:
        warnings = validate_plan(best.plan)
        notes += [f"note: {w}" for w in warnings]
        if over_assumed(best.host_bytes, request, search.gpu):
            notes.append(f"WARNING: the best plan needs {needs_text(best.host_bytes, best.nvme_bytes, request, search.gpu)}")
    notes += kernel_notes(search, best, request)
    notes += layout_notes(best, found, smallest, all_families, search.usable, cluster, search.gpu)
    alternatives = tuple(ranked[1:1 + options.top])
    rejected = explain_rejections(best, found, smallest, all_families, searched_tiers, search)
    rejected += [Rejection(family=label, reason=f"not possible: {why}") for label, why in invalid.items()]
    suggestions = () if best else tuple(suggest(search, base, request, precision, loss_scaling))
    # (tp / cp / pp: the rank-local terms are before the SP and pipeline scaling, so no term is named.)
    largest = (largest_term(estimate(best.plan, device=options.device, explain=True))
               if best and estimate_fn is None and best.plan.parallelism.is_default else None)
    result = FitResult(request=request, gpu=search.gpu, usable_bytes=search.usable, best=best,
                       alternatives=alternatives, rejected=tuple(rejected), notes=tuple(notes),
                       suggestions=suggestions, estimates=search.calls, smallest=smallest,
                       largest_term=largest)
    if best is None and pinned(request):
        error = pin_error(request, result, lambda other: fit(other, estimate_fn))
        if error is not None:
            raise error
    return result
