"""When nothing fits: the first-line fixes the field reaches for, each with its numbers (memory per
GPU and host RAM per node), whether or not it alone is enough.

Order: LoRA, QLoRA, the state rungs (8-bit AdamW, pure bf16, both: fit/rungs.py, with their costs), a
shorter sequence, more GPUs, a bigger GPU. Each lever is
tried on the leanest plans of the engines asked for (full sharding, then with offload; micro-batch 1,
full activation checkpointing), so a lever that does not make a plan fit says how far it still is.
"""
from __future__ import annotations


from shardfit.errors import ShardfitError
from shardfit.estimate.lora_targets import lora_for
from shardfit.fit.host import needs_text
from shardfit.fit.rungs import RUNG_NAMES, rungs_for
from shardfit.spec.gpus import CATALOG, get_gpu
from shardfit.spec.plan import Strategy, validate_plan
from shardfit.units import fmt_bytes


def _lean_strategies(request) -> list[tuple[str, Strategy]]:
    out = []
    if "deepspeed" in request.options.engines or "fsdp" not in request.options.engines:
        out += [("zero3", Strategy(kind="zero3")),
                ("zero3+offload", Strategy(kind="zero3", offload_optimizer="cpu", offload_params="cpu"))]
    if "fsdp" in request.options.engines:
        out += [("fsdp2", Strategy(kind="fsdp2")), ("fsdp2+offload", Strategy(kind="fsdp2", offload_params="cpu")),
                # FSDP1 last: what 8-bit AdamW runs on (bitsandbytes rejects FSDP2's DTensors).
                ("fsdp:full_shard", Strategy(kind="fsdp")),
                ("fsdp:full_shard+offload", Strategy(kind="fsdp", offload_params="cpu"))]
    return out


def _lean_plan(base, request, precision, loss_scaling, strategy: Strategy, req):
    """The leanest plan of a strategy: micro-batch 1, full activation checkpointing."""
    return base.with_changes(
        strategy=strategy,
        training={"micro_batch": 1, "grad_accum": 1, "seq_len": req.base.training.seq_len, "precision": req.pins.precision or precision,
                  "loss_scaling": loss_scaling, "activation_checkpointing": "full" if base.model.has_shape else "none",
                  "lora": req.base.training.lora, "optimizer": req.base.training.optimizer},
        cluster={"nodes": req.base.cluster.nodes, "gpus_per_node": req.base.cluster.gpus_per_node, "gpu": req.base.cluster.gpu,
                 "host_memory_gib": req.base.cluster.host_memory_gib})


class _Levers:
    def __init__(self, search, base, request, precision, loss_scaling):
        self.search, self.base, self.request = search, base, request
        self.precision, self.loss_scaling = precision, loss_scaling
        self.strategies = _lean_strategies(request)

    def best(self, **overrides):
        """(fits, label, peak bytes, host bytes, nvme bytes) of the first lean strategy that fits with
        these request changes, else of the one closest to fitting; None when no strategy is valid."""
        req = self.request.with_changes(**overrides)
        gpu = get_gpu(req.base.cluster.gpu)
        limit = int(gpu.memory_bytes * (1.0 - req.options.margin))
        closest = None
        for label, strategy in self.strategies:
            plan = _lean_plan(self.base, req, self.precision, self.loss_scaling, strategy, req)
            try:
                validate_plan(plan)
                peak = self.search.peak(plan)
            except ShardfitError:
                continue  # e.g. 8-bit Adam under DeepSpeed's CPU offload
            est = self.search.run(plan)
            row = (self.search.fits(plan, limit), label, peak, self.search.host_bytes(plan),
                   est.nvme_bytes * req.base.cluster.gpus_per_node)
            if row[0]:
                return row
            if self.search.host_ok(plan) and (closest is None or peak < closest[2]):
                closest = row
        return closest

    def line(self, lever: str, flags: str, row, note: str = "") -> str:
        fits, label, peak, host, nvme = row
        needs = needs_text(host, nvme, self.request, self.search.gpu)
        tail = f" ({note})" if note else ""
        if fits:
            return f"{lever}: {flags} with {label} needs {fmt_bytes(peak)} per GPU, {needs}{tail}"
        return (f"{lever}: {flags} alone is not enough: {fmt_bytes(peak)} per GPU with {label} > "
                f"{fmt_bytes(self.search.usable)} usable, {needs}{tail}")


def suggest(search, base, request, precision, loss_scaling) -> list[str]:
    levers = _Levers(search, base, request, precision, loss_scaling)
    lean = next((label for label, strategy in reversed(levers.strategies) if strategy.kind != "fsdp"), "offload")
    out = [f"nothing fits in {fmt_bytes(search.usable)} per GPU, even {lean} with micro-batch 1 and full "
           "activation checkpointing"]
    model = base.model
    if model.has_shape and model.family != "params":
        current = request.base.training.lora
        tries = []
        if current is None:
            tries.append(("LoRA", lora_for(model), "--lora-r 16"))
        if current is None or current.base_dtype not in ("int8", "nf4"):
            tries.append(("QLoRA", lora_for(model, base_dtype="nf4", lora=current), "--lora-r 16 --lora-base nf4"
                          if current is None else "--lora-base nf4"))
        for lever, lora, flags in tries:
            row = levers.best(lora=lora)
            if row:
                out.append(levers.line(lever, flags, row, f"adapts {','.join(lora.target_modules)}"))
    # Every rung the hardware allows, pinned or not: a suggestion says what would change.
    for rung in rungs_for(request.with_changes(rungs=RUNG_NAMES, optimizer="adamw" if request.base.training.optimizer == "adamw8bit"
                                  else request.base.training.optimizer, precision=None), precision):
        if all(request.knob(k) == v for k, v in rung.changes):
            continue  # already asked for
        row = levers.best(**rung.training)
        if row:
            out.append(levers.line(rung.name, rung.flags, row, f"cost: {rung.cost}"))
    if model.has_shape:
        seq, closest = request.base.training.seq_len // 2, None
        while seq >= 128:
            row = levers.best(seq_len=seq)
            if row and row[0]:
                out.append(levers.line("shorter sequence", f"--seq {seq}", row))
                break
            closest = (seq, row) if row else closest
            seq //= 2
        else:
            if closest:
                out.append(levers.line("shorter sequence", f"--seq {closest[0]}", closest[1]))
    for factor in (2, 4, 8, 16, 32, 64, 128):
        nodes = request.base.cluster.nodes * factor
        row = levers.best(nodes=nodes)
        if row and row[0]:
            gpus = nodes * request.base.cluster.gpus_per_node
            out.append(levers.line("more GPUs", f"--gpus {gpus} --nodes {nodes} ({nodes} nodes x "
                                   f"{request.base.cluster.gpus_per_node})", row))
            break
    for gpu in sorted(CATALOG.values(), key=lambda g: g.memory_gib):
        if gpu.memory_gib <= search.gpu.memory_gib * 1.1:  # only a real step up
            continue
        row = levers.best(gpu=gpu.name)
        if row and row[0]:
            out.append(levers.line("a bigger GPU", f"--gpu {gpu.name} ({gpu.memory_gib:g} GiB)", row))
            break
    if len(out) == 1:
        out.append("no single change found: check the model size and units (--params counts parameters)")
    return out
