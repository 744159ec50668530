"""Host work an engine does per parameter tensor or per submodule, beyond its collectives. Analytic.

DeepSpeed drives ZeRO from Python hooks. Two of them cost time in proportion to the model's
granularity, not its size, which is why ZeRO-3 falls behind ZeRO-1 on a 1.5B GPT-2 (published: 3.1x)
while moving only 1.5x the bytes:

- ZeRO-2 (and ZeRO-1 with overlap_comm, and ZeRO-3) register a hook on every trained parameter's
  gradient accumulation (stage_1_and_2.py: `partition_gradients or overlap_comm` ->
  create_reduce_and_remove_grad_hooks; stage3.py likewise); each copies the gradient into the bucket
  and does the bookkeeping, once per tensor per micro-batch.
- ZeRO-3 runs its fetch coordinator in each parameter-owning submodule's pre-forward and
  pre-backward hook (partitioned_param_coordinator.fetch_sub_module): trace bookkeeping, the
  all-gather launch or the availability check, the wait for the gathered parameters, and the
  release after. The module's kernels cannot start before the hook returns, so this is on the
  critical path and is not overlapped.

FSDP and FSDP2 hook once per wrapped unit (a block), which the collectives' latency already counts.

Per-op selective activation checkpointing (shardfit/sac.py, torchtitan's policy) is a
TorchDispatchMode: every aten op of a checkpointed block calls the policy in Python, in the forward
and again in the recompute (measured here: 70 calls per Llama block forward). A CPU device runs that
Python on the cores that compute, so it adds; a GPU's host issues kernels ahead of the device, so only
what a block's dispatch takes beyond its kernels' time is exposed (nothing for LLM-sized blocks).

Eager execution itself costs host time per aten op (the modules' Python, the dispatcher, autograd's
graph and its backward; torch.utils.checkpoint's hooks and the recompute per recomputed op), and the
torch wrappers add theirs: DDP's autograd hook per gradient; FSDP1 / FSDP2 per unit, per micro-batch
and per step (the all-gathers and reduce-scatters with their copy-in / copy-out and hooks, the
recompute's hooks, FSDP2's clipping and step through DTensor). A small model's step on a CPU is mostly
these (benchmarks/bench_fit_oracle.py: measured steps 2-4x the compute); for LLM-sized blocks on a GPU
the host issues ahead of the kernels and only the excess is exposed. Only a calibrated profile carries them
(`shardfit calibrate` measures each on the machine at hand); the catalog GPUs charge none.

The catalog figures were measured by the published runs themselves (DeepSpeedExamples autotuning,
16 x V100-32GB DGX-2, DeepSpeed of 2021, fp16, micro-batch 1-3 at seq 1024: benchmarks/
published_throughput.yaml), where the runs differ in this term alone; `shardfit calibrate` measures
the installed DeepSpeed on the machine at hand (GPU.measured.hooks), which replaces them.
"""
from __future__ import annotations

from shardfit.estimate.activations import checkpointed_blocks
from shardfit.estimate.step_activations import precision_regime
from shardfit.estimate.selective import selective_block_ops
from shardfit.estimate.states import model_linears
from shardfit.spec.gpus import GPU
from shardfit.spec.plan import Plan, is_selective_ac, parse_activation_checkpointing

# Seconds per trained parameter tensor per micro-batch in DeepSpeed's gradient hooks. ZeRO-2 minus
# ZeRO-1 (same bytes, ZeRO-1 with DeepSpeed's default overlap_comm off has no hooks), tuner metric,
# micro-batch as published: GPT2-large (436 tensors) 0.0669 s per step = 153 us per tensor; GPT2-xl
# (580 tensors) 0.0859 s = 148 us per tensor. Two models, one figure.
DS_GRAD_HOOK_S = 150e-6
# Seconds per submodule fetch event (pre-forward and pre-backward hook of each partitioned
# submodule, per micro-batch). GPT2-xl ZeRO-3 (193 submodules x 2 events), tuner metric: 1.244 s per
# step published against 0.518 s for the rest of the model (bytes, latency, compute, the gradient
# hooks above) = 1.9 ms per event. One published row: `shardfit calibrate` measures your DeepSpeed.
DS_ZERO3_FETCH_S = 1.9e-3
# Seconds of SAC's policy dispatch per aten op on a catalog GPU's host: `shardfit calibrate` on this
# project's 2-core EPYC VM (torch 2.13): a checkpointed chain of elementwise ops under the SAC context
# against plain checkpointing, 20-30 us per op. A GPU node's host is a server CPU of the same kind.
SAC_DISPATCH_S = 25e-6


def trained_tensors(plan: Plan) -> int:
    """Parameter tensors with gradients. Full training: each block linear's weight (and its bias in
    the LayerNorm-era families, GPT-2 / BERT / OPT, which carry biases and learned position
    embeddings where RMSNorm models have neither), two norms per block (weight, and bias for
    LayerNorm), the embeddings, the final norm and an untied head. LoRA: A and B of every adapted
    linear."""
    m, lora = plan.model, plan.training.lora
    if lora is not None:
        wanted = set(lora.target_modules)
        every = "all-linear" in wanted
        return 2 * sum(n for name, _, _, n in model_linears(m) if every or name in wanted)
    if not m.has_shape:
        return 0
    layernorm = m.norm == "layernorm"
    linears = sum(n for *_, n in model_linears(m)) * (2 if layernorm else 1)
    norms = 2 * m.num_layers * (2 if layernorm else 1)
    embeddings = 2 if layernorm else 1
    final_norm = 2 if layernorm else 1
    return linears + norms + embeddings + final_norm + (0 if m.tie_embeddings else 1)


def fetch_units(plan: Plan) -> int:
    """Submodules ZeRO-3 fetches: every block linear (above the persistence threshold, which at
    DeepSpeed's default keeps norms and biases resident), plus the embedding."""
    m = plan.model
    return max(sum(n for *_, n in model_linears(m)), m.num_layers) + 1 if m.has_shape and m.num_layers else 1


def _has_grad_hooks(plan: Plan) -> bool:
    s = plan.strategy
    return s.kind in ("zero2", "zero3") or (s.kind == "zero1" and s.overlap_comm)


def host_seconds(plan: Plan, gpu: GPU) -> float:
    """The engine's per-tensor and per-submodule host work per optimizer step on one rank."""
    if not plan.strategy.is_deepspeed:
        return 0.0
    grad_hook, fetch = DS_GRAD_HOOK_S, DS_ZERO3_FETCH_S
    if gpu.measured is not None:
        grad_hook = gpu.measured.hook("deepspeed_grad_hook", grad_hook)
        fetch = gpu.measured.hook("deepspeed_zero3_fetch", fetch)
    per_micro_batch = 0.0
    if _has_grad_hooks(plan):
        per_micro_batch += trained_tensors(plan) * grad_hook
    if plan.strategy.kind == "zero3":
        per_micro_batch += 2 * fetch_units(plan) * fetch
    return per_micro_batch * plan.training.grad_accum


def sac_dispatch_seconds(plan: Plan, gpu: GPU, block_forward_s: float) -> float:
    """Per-op selective checkpointing's policy dispatch per optimizer step on one rank: the block's
    forward ops, in the forward and in the recompute, over every checkpointed block. block_forward_s:
    the device time of one block's forward (what a GPU hides the dispatch behind)."""
    t, m = plan.training, plan.model
    if not (is_selective_ac(t.activation_checkpointing) and m.has_shape and m.num_layers):
        return 0.0
    blocks = checkpointed_blocks(m.num_layers, parse_activation_checkpointing(t.activation_checkpointing))
    regime = precision_regime(t.precision, plan.strategy.kind, t.lora)
    ops = selective_block_ops(m, regime, t.attention)
    per_op = SAC_DISPATCH_S if gpu.measured is None else gpu.measured.hook("sac_dispatch_per_op", SAC_DISPATCH_S)
    dispatch = ops * per_op
    on_the_device = gpu.measured is not None and gpu.measured.device == "cpu"
    exposed = dispatch if on_the_device else max(0.0, dispatch - block_forward_s)
    return 2 * blocks * exposed * t.grad_accum


def eager_seconds(plan: Plan, gpu: GPU, block_forward_s: float, block_backward_s: float) -> float:
    """Eager host work per optimizer step on one rank: the model's forward aten ops (each block's traced
    count, times the layers, plus the non-block ops calibrate counted on its reference model), their
    backward, and the recomputed blocks' ops, at the calibrated seconds per op. On a CPU device all of
    it adds; on a GPU, per block, only what outlasts the block's kernels. 0 without a calibrated profile."""
    m, t = plan.model, plan.training
    measured = gpu.measured
    if measured is None or not (m.has_shape and m.num_layers):
        return 0.0
    forward_op, backward_op = measured.hook("eager_forward_op", 0.0), measured.hook("eager_backward_op", 0.0)
    recompute_op = measured.hook("eager_recompute_op", 0.0)
    if not (forward_op or backward_op):
        return 0.0
    regime = precision_regime(t.precision, plan.strategy.kind, t.lora)
    ops = selective_block_ops(m, regime, t.attention)
    recomputed = checkpointed_blocks(m.num_layers, parse_activation_checkpointing(t.activation_checkpointing))
    head_ops = measured.hook("eager_head_ops", 0.0)
    on_the_device = measured.device == "cpu"

    def exposed(host: float, device: float) -> float:
        return host if on_the_device else max(0.0, host - device)

    per_micro = (m.num_layers * (exposed(ops * forward_op, block_forward_s) + exposed(ops * backward_op, block_backward_s))
                 + recomputed * exposed(ops * recompute_op, block_forward_s) + head_ops * (forward_op + backward_op))
    return per_micro * t.grad_accum


def fsdp_hook_prefix(plan: Plan) -> str | None:
    """The profile's name for the plan's FSDP flavour (calibrate measures each), None for no FSDP."""
    s = plan.strategy
    if s.kind == "fsdp2":
        return "fsdp2" if s.reshard_after_forward else "fsdp2_no_reshard"
    if s.kind == "fsdp" and s.sharding != "no_shard":
        return "fsdp_full_shard" if s.sharding in ("full_shard", "hybrid_shard") else "fsdp_shard_grad_op"
    return None


def wrapper_seconds(plan: Plan, gpu: GPU, block_s: float) -> float:
    """The torch wrappers' host work per optimizer step on one rank, beyond their collectives' latency:
    DDP's hook per gradient every micro-batch; FSDP's per unit (the blocks and the root) per micro-batch
    and per step, as calibrate measured them through the engines (bench/calibrate_engines.py). block_s:
    one block's device time per micro-batch, which a GPU hides a unit's host work behind."""
    measured, t, m = gpu.measured, plan.training, plan.model
    if measured is None or not m.has_shape:
        return 0.0
    if plan.strategy.kind == "ddp":
        return trained_tensors(plan) * measured.hook("ddp_grad_hook", 0.0) * t.grad_accum
    prefix = fsdp_hook_prefix(plan)
    if prefix is None:
        return 0.0
    hidden = 0.0 if measured.device == "cpu" else block_s
    units = (m.num_layers or 0) + 1
    return units * (t.grad_accum * max(0.0, measured.hook(f"{prefix}_unit_micro", 0.0) - hidden)
                    + max(0.0, measured.hook(f"{prefix}_unit_step", 0.0) - hidden))
