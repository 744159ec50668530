"""A runnable FSDP1 / FSDP2 training script from a Plan: NCCL on GPUs, gloo on CPU.

The script follows torchtitan's order: build the model on the meta device, LoRA, activation
checkpointing, shard each block then the root, materialise the shards (the model's own init, or
`--weights` read shard by shard: fsdp_state.py), and only then build the optimizer (an optimizer
built before `fully_shard` holds the unsharded parameters). It checkpoints, resumes and exports
(fsdp_state.py). Its data is `--data` (data_code.py: `shardfit train`'s conventions) or, by default, random tokens.
"""
from __future__ import annotations

import textwrap

from shardfit.emit.common import (
    SCRIPT_FINISH,
    EmitOptions,
    Emitted,
    ac_every,
    block_class,
    model_functions,
    script_inputs,
)
from shardfit.emit.data_code import DATA_CODE
from shardfit.emit.fsdp_state import STATE_CODE
from shardfit.emit.fsdp_tp import TP_CODE
from shardfit.emit.kernels import script_fields
from shardfit.emit.optimizer_code import optimizer_code
from shardfit.errors import ShardfitError
from shardfit.spec.fsdp_units import separate_embedding_units
from shardfit.spec.plan import Plan

_DTYPES = {"bf16": "torch.bfloat16", "bf16-pure": "torch.bfloat16", "fp16": "torch.float16", "fp32": None}

# The settings every multi-rank script (FSDP1, FSDP2, DDP) starts with: model, weights, checkpoints,
# export (RUN_IO) and data (RUN_DATA), as template text.
RUN_IO = '''    LORA = {lora}
    MODEL_CONFIG = {config}
    TIED = {tied}  # the head shares the embedding's weight (the model's own default when its config is silent)
    # Pretrained weights: a save_pretrained folder of *.safetensors; empty = the model's own init.
    WEIGHTS = os.environ.get("WEIGHTS", {weights})
    # Sharded checkpoints every SAVE_EVERY steps (0 = none) in CKPT_DIR, resumed from the newest complete one;
    # the trained model goes to EXPORT_DIR as safetensors (empty = no export).
    CKPT_DIR = os.environ.get("CKPT_DIR", {ckpt_dir})
    SAVE_EVERY = int(os.environ.get("SAVE_EVERY", "{save_every}")){save_note}
    EXPORT_DIR = os.environ.get("EXPORT_DIR", {export_dir})
'''
RUN_DATA = '''    # Data: a .txt / .jsonl file or a save_to_disk folder, tokenized by TOKENIZER (a local folder; empty =
    # byte-level), padded per batch to its longest row, batches grouped by length; PACK=1 packs documents
    # into full rows. Empty DATA = stand-in random tokens.
    DATA = os.environ.get("DATA", {data})
    TOKENIZER = os.environ.get("TOKENIZER", {tokenizer})
    PACK = os.environ.get("PACK", "{pack}") == "1"
    GROUP_BY_LENGTH = True


    {model_functions}{loss_code}
'''


_HEADER = '''    """{kind} training script written by `shardfit emit --format {fmt}` for {model}: {label},
    {nodes} node(s) x {gpus} GPU(s), micro-batch {micro} x accumulation {accum} x {world} ranks = global batch {global_batch}.

    Run:  torchrun --nproc-per-node {gpus} {{this file}}     (multi-node: `shardfit emit --format torchrun`)
    On CPU it runs with gloo (e.g. torchrun --nproc-per-node 2); STEPS=3 overrides the step count.
    """
    import contextlib
    import os
    import sys
    import time

    import torch
    import torch.distributed as dist

    STEPS = int(os.environ.get("STEPS", "{steps}"))
    MICRO_BATCH, GRAD_ACCUM, SEQ_LEN = {micro}, {accum}, {seq}
    LR, WEIGHT_DECAY, GRAD_CLIP, SEED, LOG_EVERY = {lr}, {wd}, {clip}, {seed}, {log_every}
    BLOCK_CLASS = "{block}"  # the repeated layer: the FSDP unit and the activation-checkpointing unit
    AC_EVERY = {ac_every}  # checkpoint every N-th block; 0 = off
    SHARD_GROUP = {group}  # ranks per shard group (hybrid sharding across nodes); None = all ranks
    TP = {tp}  # tensor-parallel ranks (inside a node): FSDP2 shards over the other world // TP; 1 = off
    LOSS_PARALLEL = {loss_parallel}  # under TP: a vocab-parallel loss instead of gathered logits
    COMPUTE_DTYPE = {dtype}  # None = fp32
    PURE_BF16 = {pure}  # bf16 weights, gradients and optimizer states (no fp32 master, no MixedPrecision)
''' + RUN_IO + '''    # Gradient sync on the last micro-batch only: one reduce-scatter per optimizer step instead of one per
    # micro-batch, at the cost of holding unsharded gradients until then ({no_sync_cost} per rank).
    NO_SYNC = GRAD_ACCUM > 1
''' + RUN_DATA

_FSDP2 = '''

    EMBEDDING_UNITS = {separate}  # the embedding and head as FSDP units of their own (torchtitan wrapping)


    def parallelize(model, device, world):
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import {fsdp2_imports}
        if TP > 1:
            # A 2-D (dp, tp) mesh, tp innermost (torchtitan's order: a TP group's ranks are neighbours in a node).
            mesh_2d = init_device_mesh(device.type, (world // TP, TP), mesh_dim_names=("dp", "tp"))
            tensor_parallel(model, mesh_2d["tp"])
            mesh = mesh_2d["dp"]
        elif SHARD_GROUP and SHARD_GROUP < world:
            mesh = init_device_mesh(device.type, (world // SHARD_GROUP, SHARD_GROUP), mesh_dim_names=("replicate", "shard"))
        else:
            mesh = init_device_mesh(device.type, (world,))
        kwargs = {{"mesh": mesh, "reshard_after_forward": {reshard}}}
        if COMPUTE_DTYPE is not None and not PURE_BF16:
            kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=COMPUTE_DTYPE, reduce_dtype=torch.float32)
{offload_line}        # The embedding and head as units of their own (torchtitan): the embedding resharded after its forward,
        # the head kept gathered until its backward. A tied head shares the embedding's weight: it stays in the root.
        embedding, head = model.get_input_embeddings(), model.get_output_embeddings()
        separate = EMBEDDING_UNITS and head is not None and embedding.weight is not head.weight
        if separate:
            fully_shard(embedding, **kwargs)
        for block in [m for m in model.modules() if type(m).__name__ == BLOCK_CLASS]:
            fully_shard(block, **kwargs)
        if separate:
            fully_shard(head, **{{**kwargs, "reshard_after_forward": False}})
        fully_shard(model, **kwargs)
        # Materialise: each rank allocates only its shards on its device, then fills them. A tied head keeps
        # sharing the embedding's weight: FSDP2 manages the one shared parameter through to_empty.
        model.to_empty(device={materialise_device})
        init_weights(model, list(model.modules()))
        return model


    def clip(model):
        # On the sharded gradients (DTensors): the norm is reduced across ranks, no gradient is gathered.
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        if TP == 1:
            torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.grad is not None], GRAD_CLIP)
            return
        # Under TP the gradients live on two meshes (2-D dp x tp for the sliced linears, 1-D dp for the
        # norms), which clip_grad_norm_ cannot stack: each norm is made a plain tensor first.
        from torch.distributed.tensor import DTensor
        squares = torch.zeros((), dtype=torch.float32)
        for grad in grads:
            norm = torch.linalg.vector_norm(grad, dtype=torch.float32)
            squares = squares + (norm.full_tensor() if isinstance(norm, DTensor) else norm).to(squares.device) ** 2
        coef = float(torch.clamp(GRAD_CLIP / (squares.sqrt() + 1e-6), max=1.0))
        for grad in grads:
            grad.mul_(coef)


''' + TP_CODE + '''    def sync_gradients(model, last):
        model.set_requires_gradient_sync(last or not NO_SYNC)
        if TP > 1 and LOSS_PARALLEL:  # the loss and its backward on the vocab-sharded logits
            from torch.distributed.tensor.parallel import loss_parallel
            return loss_parallel()
        return contextlib.nullcontext()
'''

_FSDP1 = '''

    def parallelize(model, device, world):
        from torch.distributed.fsdp import (
            BackwardPrefetch,
            CPUOffload,
            MixedPrecision,
            ShardingStrategy,
        )
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
        from torch.distributed.fsdp.wrap import ModuleWrapPolicy
        block_types = {{type(m) for m in model.modules() if type(m).__name__ == BLOCK_CLASS}}

        embedding, head = model.get_input_embeddings(), model.get_output_embeddings()

        def materialise(module):
            module.to_empty(device=device, recurse=False)
            init_weights(model, [module])
            if TIED and not embedding.weight.is_meta:
                # to_empty gives the head a weight of its own: share the embedding's again (FSDP1 calls
                # this per module of a unit, before it flattens the unit, so the last call leaves them tied).
                head.weight = embedding.weight
        kwargs = {{}}
        if SHARD_GROUP and SHARD_GROUP < world:
            from torch.distributed.device_mesh import init_device_mesh
            kwargs["device_mesh"] = init_device_mesh(device.type, (world // SHARD_GROUP, SHARD_GROUP))
        if COMPUTE_DTYPE is not None and not PURE_BF16:
            kwargs["mixed_precision"] = MixedPrecision(param_dtype=COMPUTE_DTYPE, reduce_dtype=torch.float32,
                                                       buffer_dtype=COMPUTE_DTYPE)
        return FSDP(model, auto_wrap_policy=ModuleWrapPolicy(block_types),
                    sharding_strategy=ShardingStrategy.{sharding},
                    backward_prefetch={prefetch},
                    cpu_offload=CPUOffload(offload_params={offload}),
                    device_id=device,  # FSDP1 needs device_id=cpu on CPU, the GPU index on GPUs
                    # The model is on the meta device: each unit is materialised on the device just before it
                    # is sharded, and initialised there by the model's own init (the same seed on every rank).
                    param_init_fn=materialise,
                    use_orig_params=True, limit_all_gathers=True, **kwargs)


    def clip(model):
        model.clip_grad_norm_(GRAD_CLIP)


    def sync_gradients(model, last):
        # no_sync() keeps full unsharded gradients of every unit until the last micro-batch.
        return contextlib.nullcontext() if last or not NO_SYNC else model.no_sync()
'''

_MAIN = '''

    def main():
        cuda = torch.cuda.is_available()
        dist.init_process_group("nccl" if cuda else "gloo")
        rank, world = dist.get_rank(), dist.get_world_size()
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))  # not the global rank: that breaks on node 2+
        device = torch.device("cuda", local_rank) if cuda else torch.device("cpu")
        if cuda:
            torch.cuda.set_device(device)
        torch.manual_seed(SEED)  # the same initial weights on every rank
        # Built on the meta device (shapes, no memory) and materialised shard by shard while sharding: no
        # rank ever holds the whole model, in host RAM or on its device (torchtitan's order).
        with torch.device("meta"):
            model = build_model()
        {head_setup}{ac_before}
        if PURE_BF16:
            model = model.to(torch.bfloat16)
        model = parallelize(model, device, world){ac_after}
        if WEIGHTS:
            load_weights(model, WEIGHTS)
        # The optimizer comes after sharding so it holds the sharded parameters.
        {optimizer_note}
        {optimizer}
        {scaler_setup}
        resume, first = newest_checkpoint() if SAVE_EVERY else (None, 0)
        if resume:
            load_checkpoint(model, optimizer, resume)
            if rank == 0:
                print(f"resumed from {{resume}} at step {{first}}", flush=True)
        # The ranks of one TP group read the same batch: data comes per data-parallel rank.
        data = batches(MODEL_CONFIG.get("vocab_size", 32000), device, rank // TP, world // TP, first * GRAD_ACCUM)
        start = time.perf_counter()
        for step in range(first, STEPS):
            total = 0.0
            for micro in range(GRAD_ACCUM):
                batch = next(data)
                with sync_gradients(model, last=micro == GRAD_ACCUM - 1):
                    {loss_line}
                    {backward}
                total += (loss.full_tensor() if hasattr(loss, "full_tensor") else loss).item()
            {step_code}
            optimizer.zero_grad(set_to_none=True)
            if rank == 0 and (step % LOG_EVERY == 0 or step == STEPS - 1):
                print(f"step {{step}} loss {{total:.4f}} {{time.perf_counter() - start:.1f}}s", flush=True)
            if SAVE_EVERY and ((step + 1) % SAVE_EVERY == 0 or step == STEPS - 1):
                save_checkpoint(model, optimizer, step + 1, rank)
        if os.environ.get("CHECKSUM"):  # replicas must agree: compare this line across ranks
            local = sum(float((p.to_local() if hasattr(p, "to_local") else p).detach().float().sum())
                        for p in model.parameters())
            print(f"rank {{rank}} checksum {{local:.6f}}", flush=True)
        if EXPORT_DIR:
            export(model, rank)
        if cuda:
            peak = torch.cuda.max_memory_allocated(device) / 2**30
            print(f"rank {{rank}} peak allocated {{peak:.2f}} GiB", flush=True)
        {finish}


    if __name__ == "__main__":
        main()
'''

# Inserted into the dedented _MAIN: continuation lines carry the indentation of their place there.
_FP16_SCALER = ("from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler\n"
                "    scaler = ShardedGradScaler(device.type)  # fp16 needs loss scaling")
_FP16_STEP = ("scaler.unscale_(optimizer)\n        clip(model)\n        scaler.step(optimizer)\n"
              "        scaler.update()")
_STEP = "clip(model)\n        optimizer.step()"
# FSDP2 (torchtitan's order): checkpoint the blocks, then shard them. FSDP1: wrap, then checkpoint inside.
_AC = "\n    if AC_EVERY:\n        apply_activation_checkpointing(model)"
_AC_INSIDE_UNITS = ("\n    # FSDP1: checkpoint the blocks inside their FSDP units, after wrapping (torch's order): a checkpoint\n"
                    "    # wrapper around a unit leaves \"_fsdp_wrapped_module\" in the optimizer state's names, and resume fails.\n"
                    "    if AC_EVERY:\n        apply_activation_checkpointing(model)")


def fsdp_script(plan: Plan, version: int, options: EmitOptions | None = None) -> str:
    options = options or EmitOptions()
    s, t, c, sched = plan.strategy, plan.training, plan.cluster, plan.schedule
    config, lora = script_inputs(plan, "FSDP script", "--format accelerate or torchrun")
    group = s.shard_group(c.gpus_per_node)
    if version == 1 and group == 1 and c.world_size > 1:
        raise ShardfitError("FSDP1 hybrid shard with a shard group of 1 never syncs replicas: use --format fsdp2")
    fields = dict(run_fields(plan, options, config, lora), kind="FSDP1" if version == 1 else "FSDP2",
                  fmt="fsdp" if version == 1 else "fsdp2", group=group, dtype=_DTYPES[t.precision],
                  pure=t.precision == "bf16-pure", tp=plan.parallelism.tp,
                  loss_parallel=plan.parallelism.tp > 1 and plan.parallelism.loss_parallel,
                  no_sync_cost=f"{plan.model.n_params * _GRAD_BYTES[t.precision] / 2**30:.2f} GiB")
    if version == 2:
        offload = bool(s.offload_params)
        body = _FSDP2.format(reshard=s.reshard_after_forward if s.sharding != "shard_grad_op" else False,
                             separate=separate_embedding_units(s, plan.model) and plan.parallelism.tp == 1,
                             fsdp2_imports="(\n            CPUOffloadPolicy,\n            MixedPrecisionPolicy,\n"
                             "            fully_shard,\n        )" if offload
                             else "MixedPrecisionPolicy, fully_shard",
                             offload_line='        kwargs["offload_policy"] = CPUOffloadPolicy(pin_memory=device.type == "cuda")\n'
                             if offload else "", materialise_device='"cpu"' if offload else "device")
    else:
        mode = s.sharding
        if group and group < c.world_size:
            mode = "hybrid_shard"
        elif s.kind == "fsdp2":
            mode = "shard_grad_op" if not s.reshard_after_forward else ("hybrid_shard" if group else "full_shard")
        sharding = {"full_shard": "FULL_SHARD", "shard_grad_op": "SHARD_GRAD_OP", "no_shard": "NO_SHARD",
                    "hybrid_shard": "HYBRID_SHARD"}[mode]
        prefetch = {"backward_pre": "BackwardPrefetch.BACKWARD_PRE", "backward_post": "BackwardPrefetch.BACKWARD_POST",
                    "none": "None"}[s.backward_prefetch]
        body = _FSDP1.format(sharding=sharding, prefetch=prefetch, offload=bool(s.offload_params))
    # Templates are indented in this file (so no line here reads as a top-level import) and dedented here.
    kernels = script_fields(plan, batch="batch")
    header = textwrap.dedent(_HEADER).format(**fields, loss_code=kernels.pop("loss_code"))
    fp16 = t.precision == "fp16"
    main = textwrap.dedent(_MAIN).format(
        **kernels, optimizer=optimizer_code(plan, "[p for p in model.parameters() if p.requires_grad]"),
        scaler_setup=_FP16_SCALER if fp16 else "# bf16 / fp32: no loss scaling",
        backward="scaler.scale(loss).backward()" if fp16 else "loss.backward()",
        step_code=_FP16_STEP if fp16 else _STEP,
        finish=SCRIPT_FINISH, ac_before=_AC if version == 2 else "", ac_after=_AC_INSIDE_UNITS if version == 1 else "")
    return header + DATA_CODE + textwrap.dedent(body) + STATE_CODE + main


def run_fields(plan: Plan, options: EmitOptions, config: dict, lora: dict | None) -> dict:
    """Template fields every multi-rank training script (FSDP1, FSDP2, DDP) shares: shapes, schedule,
    model, weights, data, checkpoints and export."""
    s, t, c, sched = plan.strategy, plan.training, plan.cluster, plan.schedule
    eight_bit = t.optimizer == "adamw8bit"
    return dict(model=plan.model.name, label=s.label, nodes=c.nodes, gpus=c.gpus_per_node, world=c.world_size,
                micro=t.micro_batch, accum=t.grad_accum, global_batch=plan.global_batch, seq=t.seq_len,
                steps=sched.steps, lr=sched.lr, wd=sched.weight_decay, clip=sched.grad_clip, seed=sched.seed,
                log_every=max(sched.log_every, 1), block=s.wrap_unit or block_class(plan.model),
                ac_every=ac_every(plan), model_functions=model_functions(plan), lora=repr(lora),
                config=repr(config), tied=plan.model.tie_embeddings, weights=repr(options.weights or ""),
                data=repr(options.data or plan.data.path or ""),
                tokenizer=repr(options.tokenizer or plan.data.tokenizer or ""), pack="1" if options.pack else "0",
                ckpt_dir=repr(f"{options.out_dir}/checkpoints"), save_every=0 if eight_bit else sched.save_every or sched.steps,
                save_note=_NO_8BIT_SAVE if eight_bit else "", export_dir=repr(f"{options.out_dir}/export"))


# DCP's get_state_dict cannot flatten bitsandbytes' 8-bit optimizer state ("Boolean value of Tensor with
# more than one value is ambiguous", torch 2.13, bitsandbytes 0.50): such a script saves no checkpoints
# unless asked, and says so where the setting is.
_NO_8BIT_SAVE = "  # 0: DCP's get_state_dict cannot flatten bitsandbytes' 8-bit AdamW state"


# Bytes per parameter of the gradients no-sync accumulation holds unsharded (the reduce dtype is fp32
# under mixed precision; pure bf16 keeps bf16 gradients).
_GRAD_BYTES = {"bf16": 4, "fp16": 4, "fp32": 4, "bf16-pure": 2}


def _check_kind(plan: Plan, version: int) -> list[str]:
    kind = plan.strategy.kind
    if kind in ("fsdp", "fsdp2"):
        if (kind == "fsdp") != (version == 1):
            return [f"the plan says {plan.strategy.label}; this script uses FSDP{version} with the same sharding"]
        return []
    if kind == "zero3":
        return [f"the plan says {kind}; the FSDP{version} equivalent (full shard) is written instead"]
    other = {"single": "single", "ddp": "ddp"}.get(kind, "deepspeed or torchrun")
    raise ShardfitError(f"the plan's strategy is {plan.strategy.label}: FSDP scripts are for fsdp/fsdp2/zero3 plans; "
                        f"use --format {other}")


def emit_fsdp(plan: Plan, options: EmitOptions, version: int = 1) -> Emitted:
    notes = _check_kind(plan, version)
    if plan.parallelism.tp > 1:
        if plan.strategy.kind != "fsdp2" or plan.training.loss == "chunked" or plan.training.lora is not None:
            raise ShardfitError("the FSDP2 x TP script runs strategy fsdp2 with the standard loss and no LoRA: "
                                "change the plan, or use --format accelerate")
        head = "a vocab-parallel loss" if plan.parallelism.loss_parallel else "gathered logits"
        notes.append(f"tp={plan.parallelism.tp}: the script runs the model's own transformers TP plan ({head}, no "
                     "sequence parallel): memory as `shardfit plan ... --tp N` without --sp")
    if plan.strategy.kind == "zero3":
        from dataclasses import replace
        offload = "cpu" if plan.strategy.offload_params else None
        plan = replace(plan, strategy=replace(plan.strategy, kind="fsdp" if version == 1 else "fsdp2",
                                              sharding="full_shard", offload_optimizer=None, offload_params=offload))
    name = "train_fsdp.py" if version == 1 else "train_fsdp2.py"
    return Emitted(files={name: fsdp_script(plan, version, options)}, notes=tuple(notes))
