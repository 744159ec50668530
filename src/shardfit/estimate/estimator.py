"""estimate(plan) -> Estimate: per-rank bytes by phase and category, composed from the term functions
in states.py, activations.py, temporaries.py and overhead.py.

Accounting modes:
- "real" (default): what the engines really allocate (fp32 master/grad partitions, buckets, gathered
  units, DeepSpeed's persistent buffers, the loss upcast, CUDA context...).
- "ideal": the ZeRO paper's model-state formulas (2P + 2P + K*P/N ...), no buffers, no overhead.
- "deepspeed": DeepSpeed's own estimator functions for zero2/zero3 (ideal for the other strategies).

Hot path: with explain=False nothing but integers is built, so `fit` can evaluate tens of thousands
of plans per second. explain=True also records every Term with its formula, inputs and source.
"""
from __future__ import annotations

from shardfit.errors import ShardfitError
from shardfit.estimate import model_parallel as mpar
from shardfit.estimate.result import Estimate
from shardfit.estimate.step_activations import Recorder, activations_step, selective_checkpointing
from shardfit.estimate.step_phases import overhead_step, phases_step
from shardfit.estimate.step_states import model_facts, states_and_buffers
from shardfit.spec.kernels import OPTIMIZER_IMPLS

ACCOUNTING = ("real", "ideal", "deepspeed")
CHECKPOINT_MODES = ("sharded", "full")
DEVICES = ("cuda", "cpu")


def shard_degree(plan) -> int:
    """Ranks that share one copy of the sharded states."""
    s, c = plan.strategy, plan.cluster
    world = c.nodes * c.gpus_per_node
    if s.kind in ("single", "ddp"):
        return 1
    if s.kind == "fsdp":
        if s.sharding == "no_shard":
            return 1
        if s.sharding == "hybrid_shard":
            return s.shard_group_size or c.gpus_per_node
        return world
    if s.kind == "fsdp2":
        return s.shard_group(c.gpus_per_node) or world
    return world


def estimate(plan, *, accounting: str = "real", device: str = "cuda", checkpoint: str = "sharded",
             optimizer_impl: str | None = None, explain: bool = False) -> Estimate:
    """Per-rank device bytes by phase and category for a (validated) plan.

    device "cpu" drops the CUDA-only overhead and uses the CPU kernels' dtypes (dropout masks).
    optimizer_impl "auto": torch's CUDA default (foreach) for DDP/FSDP and FusedAdam for DeepSpeed on
    cuda; the single-tensor loop on cpu (what `shardfit train` runs: foreach=False everywhere).
    None: the plan's training.optimizer_impl."""
    optimizer_impl = optimizer_impl or plan.training.optimizer_impl
    if accounting not in ACCOUNTING:
        raise ShardfitError(f"accounting '{accounting}' is not known: use one of {', '.join(ACCOUNTING)}")
    if optimizer_impl not in OPTIMIZER_IMPLS:
        raise ShardfitError(f"optimizer_impl '{optimizer_impl}' is not known: use one of {', '.join(OPTIMIZER_IMPLS)}")
    if checkpoint not in CHECKPOINT_MODES:
        raise ShardfitError(f"checkpoint '{checkpoint}' is not known: use sharded or full")
    if not plan.parallelism.is_default:  # tp / cp / pp: per-rank local plans (estimate/model_parallel.py)
        return mpar.estimate_model_parallel(plan, estimate, accounting=accounting, device=device, checkpoint=checkpoint,
                                            optimizer_impl=optimizer_impl, explain=explain)
    shard = shard_degree(plan)
    facts = model_facts(plan)
    record = Recorder() if explain else None
    activations = activations_step(plan, device, record)
    states = states_and_buffers(plan, activations, facts, shard, accounting=accounting, device=device,
                                optimizer_impl=optimizer_impl, checkpoint=checkpoint, record=record)
    if not states.counts_activations:
        activations = activations.uncounted()
    phases, peak = phases_step(plan, activations, states)
    overhead = overhead_step(plan, shard, peak, device=device, accounting=accounting, record=record)
    if record:
        record.notes.extend(_assumptions(plan, activations.regime, shard, accounting, device, checkpoint))
    return Estimate(strategy=plan.strategy.label, phases=phases, overhead=overhead, host=states.host,
                    nvme_bytes=int(states.nvme), terms=tuple(record.terms) if record else (),
                    assumptions=tuple(record.notes) if record else (),
                    warnings=_warnings(plan, states.host, shard, accounting))


def _warnings(plan, host: dict[str, int], shard: int, accounting: str) -> tuple[str, ...]:
    model, cluster = plan.model, plan.cluster
    warnings = ()
    if plan.strategy.kind in ("fsdp", "fsdp2") and not model.block_params and accounting == "real" and shard > 1:
        warnings += ("FSDP without a block size wraps the whole model as one unit: every rank gathers all of it; "
                     "give --largest-layer or a model with shapes",)
    if cluster.host_memory_gib and host:
        per_node = sum(host.values()) * cluster.gpus_per_node
        if per_node > cluster.host_memory_gib * 1024**3:
            warnings += (f"host RAM: {per_node / 1024**3:.1f} GiB per node needed, {cluster.host_memory_gib:g} GiB available",)
    return warnings


def _assumptions(plan, regime, shard, accounting, device, checkpoint) -> list[str]:
    s, t = plan.strategy, plan.training
    out = [f"per rank; {plan.cluster.nodes}x{plan.cluster.gpus_per_node} ranks; states sharded over {shard}",
           f"activation dtype regime '{regime}' ({t.precision}, {s.kind})",
           f"micro-batch {t.micro_batch} x seq {t.seq_len}, activation checkpointing {t.activation_checkpointing}, "
           f"attention {t.attention}",
           f"checkpoint save: {checkpoint}; device: {device}; accounting: {accounting}",
           "loop does `loss = model(**batch).loss`: the logits are freed before backward" if t.loss == "standard" else
           f"chunked loss: head + cross-entropy in {t.loss_chunks} row chunks, logits recomputed in backward"]
    m = plan.model
    if m.derived:
        out.append(f"{m.model_class}: no hand-written rules; spec from a meta-device build, saved activations "
                   f"traced from its forward on fake tensors (CPU kernels), cached by config ({m.config_hash})")
    if m.num_experts:
        out.append(f"MoE: {m.experts_per_token} of {m.num_experts} experts per token; saved tensors count b*s*top_k "
                   f"routed rows (routing-independent); the backward working set assumes balanced routing")
    if selective_checkpointing(t.activation_checkpointing):
        out.append("selective checkpointing: torchtitan's per-op policy (attention and every other mm kept; shardfit/sac.py)")
    if t.lora is not None:
        out.append(f"LoRA r={t.lora.rank} on {','.join(t.lora.target_modules)}: adapters fp32, base "
                   f"{t.lora.base_dtype} frozen")
        if t.lora.base_dtype in ("nf4", "int8"):
            out.append("QLoRA as peft sets it up: prepare_model_for_kbit_training keeps embeddings, norms and head in "
                       "fp32; its default gradient checkpointing is not assumed (the plan's activation_checkpointing is)")
    if s.kind == "single":
        out.append("single: one device, no wrapper: no reducer buckets, no collectives; grads live from backward "
                   "to zero_grad(set_to_none=True)")
    if s.kind == "ddp" and plan.cluster.world_size == 1 and not s.ddp_gradient_as_bucket_view:
        out.append("ddp on one GPU still allocates the reducer's flat bucket copy of every gradient: "
                   "strategy single trains the same way without it")
    if s.kind in ("zero1", "zero2", "zero3"):
        out.append("DeepSpeed: 16-bit params + fp32 master + fp32 grad partition at step; FusedAdam (no step scratch)")
    return out
