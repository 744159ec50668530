"""torchtitan's launch line from a Plan: `torchrun ... -m torchtitan.train --module M --config C` plus
the CLI overrides its ConfigManager parses (torchtitan 0.3.0: a Python `config_registry` function per
model, overridden field by field through tyro; the TOML files of earlier releases are gone).

torchtitan trains its own model implementations, so a plan is written for the config function whose
architecture equals the plan's model (TITAN_MODELS, matched on the shapes, not the name); any other model
is refused in one line. Its data parallelism is FSDP2 over a (dp_replicate, dp_shard) mesh, always:
`apply_fsdp_to_decoder` runs even at shard degree 1, so a DDP plan becomes FSDP2 replicating.
tests/emit/test_emit_torchtitan.py parses the emitted lines with torchtitan's own loader and ParallelDims.
No torch here.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from shardfit.emit.common import Emitted, EmitOptions
from shardfit.emit.launch import MULTI_NODE_LINES, torchrun_command
from shardfit.errors import ShardfitError
from shardfit.spec.model_spec import ModelSpec
from shardfit.spec.parallelism import chunk_layers, resolve
from shardfit.spec.plan import Plan, is_selective_ac, parse_activation_checkpointing

TORCHTITAN_VERSION = "0.3.0"


@dataclass(frozen=True)
class TitanModel:
    """One torchtitan config function and the architecture its model_registry builds (torchtitan 0.3.0;
    the loader test compares every row with the registry itself)."""
    module: str
    config: str
    families: tuple[str, ...]  # our spec families (transformers model_type) of that architecture
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int  # dense MLP width (0: MoE blocks)
    vocab: int
    experts: int = 0
    note: str = ""


TITAN_MODELS = (
    TitanModel("llama3", "llama3_8b", ("llama",), 4096, 32, 32, 8, 14336, 128256),
    TitanModel("llama3", "llama3_70b", ("llama",), 8192, 80, 64, 8, 28672, 128256),
    TitanModel("llama3", "llama3_405b", ("llama",), 16384, 126, 128, 8, 53248, 128256,
               note="torchtitan's llama3_405b config swaps the block linears to Float8Linear (torchao, "
                    "NVIDIA SM89+ / MI300+): matmul inputs in float8 for the saved activations, which the "
                    "plan's bf16 estimate does not include"),
    TitanModel("qwen3", "qwen3_0_6b", ("qwen3",), 1024, 28, 16, 8, 3072, 151936),
    TitanModel("qwen3", "qwen3_1_7b", ("qwen3",), 2048, 28, 16, 8, 6144, 151936),
    TitanModel("qwen3", "qwen3_14b", ("qwen3",), 5120, 40, 40, 8, 17408, 151936),
    TitanModel("qwen3", "qwen3_32b", ("qwen3",), 5120, 64, 64, 8, 25600, 151936),
    TitanModel("qwen3", "qwen3_30b_a3b", ("qwen3_moe",), 2048, 48, 32, 4, 0, 151936, experts=128),
)

# torch.distributed.pipelining's get_schedule_class names, which torchtitan's config takes.
_SCHEDULES = {"gpipe": "GPipe", "1f1b": "1F1B", "interleaved": "Interleaved1F1B",
              "zero-bubble": "InterleavedZeroBubble", "zbv": "ZBVZeroBubble", "dualpipev": "DualPipeV"}
_ADAMW_IMPL = {"auto": "foreach", "foreach": "foreach", "single": "for-loop", "fused": "fused"}
# torchtitan's data parallel is FSDP2 (fully_shard over dp_replicate x dp_shard); these plans map onto it.
_STRATEGIES = ("single", "ddp", "fsdp2")


def titan_model(spec: ModelSpec) -> TitanModel:
    for candidate in TITAN_MODELS:
        if (spec.family in candidate.families and spec.hidden_size == candidate.hidden
                and spec.num_layers == candidate.layers and spec.num_heads == candidate.heads
                and (spec.num_kv_heads or spec.num_heads) == candidate.kv_heads and spec.vocab_size == candidate.vocab
                and spec.num_experts == candidate.experts
                and (candidate.experts or spec.intermediate_size == candidate.intermediate)):
            return candidate
    known = ", ".join(m.config for m in TITAN_MODELS)
    raise ShardfitError(f"torchtitan trains its own model definitions and none has {spec.name}'s shape "
                        f"(hidden {spec.hidden_size}, {spec.num_layers} layers, {spec.num_heads} heads): plan one "
                        f"of its configs ({known}) or use --format fsdp2 (the same FSDP2 x TP for any model)")


def torchtitan_runs(plan: Plan) -> bool:
    """Whether `emit --format torchtitan` writes this plan (fit's next-step hint)."""
    try:
        torchtitan_args(plan)
    except ShardfitError:
        return False
    return True


def _check_plan(plan: Plan) -> None:
    s, t = plan.strategy, plan.training
    if s.kind not in _STRATEGIES:
        raise ShardfitError(f"torchtitan shards data parallel with FSDP2 only, not {s.label}: re-run fit or plan with "
                            "--strategy fsdp2 (or use --format deepspeed for ZeRO)")
    if t.precision == "fp16":
        raise ShardfitError("torchtitan trains in bf16 or fp32, not fp16: set training.precision to bf16")
    if t.lora is not None or t.optimizer != "adamw":
        what = "LoRA" if t.lora is not None else t.optimizer
        raise ShardfitError(f"the torchtitan format writes full fine-tuning with AdamW, not {what}: use --format "
                            "fsdp2 (a script with the plan's LoRA and optimizer)")


def _pipeline_parts(plan: Plan, layout) -> list[str]:
    """torchtitan's `module_fqns_per_model_part`: the plan's own split (spec/parallelism.chunk_layers) in model
    order, the embedding in the first chunk and the final norm and head in the last. torchtitan places chunk
    k on rank k % pp, or in a V under ZBVZeroBubble / DualPipeV (spec/parallelism.rank_chunks), as
    shardfit's estimate does."""
    sizes = chunk_layers(plan.model.num_layers, layout.pp * layout.virtual)
    parts, start = [], 0
    for index, size in enumerate(sizes):
        names = [f"layers.{i}" for i in range(start, start + size)]
        start += size
        if index == 0:
            names.insert(0, "tok_embeddings")
        if index == len(sizes) - 1:
            names += ["norm", "lm_head"]
        parts.append(",".join(names))
    return parts


def torchtitan_args(plan: Plan, options: EmitOptions | None = None) -> tuple[list[str], list[str]]:
    """(the arguments after `-m torchtitan.train`, notes)."""
    options = options or EmitOptions()
    _check_plan(plan)
    model = titan_model(plan.model)
    s, t, sched = plan.strategy, plan.training, plan.schedule
    layout = resolve(plan)
    notes = [model.note] if model.note else []
    local_batch, pp_args = t.micro_batch, []
    if layout.pp > 1:
        if t.grad_accum % layout.microbatches:
            raise ShardfitError(f"torchtitan runs whole pipeline steps of {layout.microbatches} micro-batches: make "
                                f"training.grad_accum ({t.grad_accum}) a multiple of parallelism.pp_microbatches")
        local_batch = t.micro_batch * layout.microbatches
        pp_args = ["--parallelism.pipeline_parallel_schedule", _SCHEDULES[layout.schedule],
                   "--parallelism.pipeline_parallel_microbatch_size", str(t.micro_batch),
                   "--parallelism.module_fqns_per_model_part", *_pipeline_parts(plan, layout),
                   # torchtitan refuses CUDA graph capture under a pipeline ("not supported yet").
                   "--training.disable_cuda_graphs"]
    args = ["--module", model.module, "--config", model.config,
            "--parallelism.data_parallel_replicate_degree", str(layout.dp_replicate),
            "--parallelism.data_parallel_shard_degree", str(layout.dp_shard),
            "--parallelism.tensor_parallel_degree", str(layout.tp),
            "--parallelism.enable_sequence_parallel" if layout.sequence_parallel
            else "--parallelism.no_enable_sequence_parallel",
            "--parallelism.context_parallel_degree", str(layout.cp),
            "--parallelism.pipeline_parallel_degree", str(layout.pp),
            "--parallelism.expert_parallel_degree", str(layout.ep),
            "--parallelism.fsdp_reshard_after_forward",
            "default" if s.kind != "fsdp2" or s.reshard_after_forward else "never",
            *pp_args,
            "--training.local_batch_size", str(local_batch),
            "--training.global_batch_size", str(plan.global_batch),
            "--training.seq_len", str(t.seq_len),
            "--training.steps", str(sched.steps),
            "--training.max_norm", str(sched.grad_clip),
            "--training.dtype", "bfloat16" if t.precision == "bf16-pure" else "float32",
            "--training.mixed_precision_param", "bfloat16" if t.precision == "bf16" else "float32",
            "--optimizer.implementation", _ADAMW_IMPL[t.optimizer_impl],
            "--loss.num_chunks", str(t.loss_chunks if t.loss == "chunked" else 1),
            "--lr_scheduler.warmup_steps", str(sched.warmup_steps),
            "--dump_folder", options.out_dir]
    if s.offload_params:
        args.append("--training.enable_cpu_offload")
    if sched.save_every:
        args += ["--checkpoint.enable", "--checkpoint.interval", str(sched.save_every)]
    every = parse_activation_checkpointing(t.activation_checkpointing)
    if every > 1:
        notes.append(f"torchtitan {TORCHTITAN_VERSION} checkpoints every block or per op, not every {every}-th "
                     "block: this line checkpoints every block (more recompute, less memory than the plan)")
    ac = "none" if every == 0 else "selective" if is_selective_ac(t.activation_checkpointing) else "full"
    # The subcommand goes last: tyro reads the options after it as the policy's own.
    args.append(f"activation-checkpoint:{ac}")
    if s.kind in ("single", "ddp"):
        notes.append("torchtitan replicates with FSDP2 at shard degree 1 (fully_shard over the replicate mesh), "
                     "not DDP's reducer: no gradient buckets, parameters cast to the compute dtype per block")
    if layout.tp > 1 and not layout.loss_parallel:
        notes.append("torchtitan keeps the logits vocab-sharded into its vocab-parallel loss under tp: its memory "
                     "is the plan's with parallelism.loss_parallel true")
    notes.append(f"for torchtitan {TORCHTITAN_VERSION}: its config {model.module}.{model.config} supplies the data "
                 "set, tokenizer (hf_assets_path), learning rate and weight decay; these lines set the layout, "
                 "batch, precision and checkpointing")
    return args, notes


def emit_torchtitan(plan: Plan, options: EmitOptions) -> Emitted:
    args, notes = torchtitan_args(plan, options)
    c = plan.cluster
    launch = torchrun_command(plan, replace(options, entry="-m torchtitan.train"))
    lines = ["#!/usr/bin/env bash",
             f"# {plan.model.name}: {plan.strategy.label}, {resolve(plan).describe()}, "
             f"{c.nodes} node(s) x {c.gpus_per_node} GPU(s); torchtitan {TORCHTITAN_VERSION} (written by shardfit)",
             "set -euo pipefail"]
    if c.nodes > 1:
        lines += MULTI_NODE_LINES
    lines.append(launch + " \\")
    pairs = _pair(args)
    lines += [f"  {item} \\" for item in pairs[:-1]] + [f"  {pairs[-1]}"]
    return Emitted(files={"run_torchtitan.sh": "\n".join(lines) + "\n"}, notes=tuple(notes))


def _pair(args: list[str]) -> list[str]:
    """One option and its values a line (values never start with --)."""
    rows: list[str] = []
    for item in args:
        if item.startswith("--") or not rows or item.startswith("activation-checkpoint:"):
            rows.append(item)
        else:
            rows[-1] += f" {item}"
    return rows
