"""A runnable DDP training script from a Plan: NCCL on GPUs, gloo on CPU.

The same structure as the FSDP scripts (fsdp.py): meta-device build, materialised straight on each
rank's device with the model's own init (or `--weights`), no-sync accumulation, sharded DCP
checkpoints with resume, the data path of data_code.py. What differs is DDP's: every rank holds the
whole model, gradients are all-reduced in buckets during the last micro-batch's backward, mixed
precision is torch.autocast over fp32 weights, and the export is rank 0's save_pretrained (the
replicas are identical, nothing needs gathering).
"""
from __future__ import annotations

import textwrap

from shardfit.emit.common import SCRIPT_FINISH, EmitOptions, Emitted, script_inputs
from shardfit.emit.data_code import DATA_CODE
from shardfit.emit.fsdp import RUN_DATA, RUN_IO, run_fields
from shardfit.emit.fsdp_state import state_functions
from shardfit.emit.kernels import script_fields
from shardfit.emit.optimizer_code import optimizer_code
from shardfit.errors import ShardfitError
from shardfit.spec.plan import Plan

_HEADER = '''    """DDP training script written by `shardfit emit --format ddp` for {model}: {label},
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
    BLOCK_CLASS = "{block}"  # the repeated layer: the activation-checkpointing unit
    AC_EVERY = {ac_every}  # checkpoint every N-th block; 0 = off
    PRECISION = "{precision}"  # fp32 | bf16, fp16: autocast over fp32 weights | bf16-pure: bf16 weights
    PURE_BF16 = PRECISION == "bf16-pure"
    AUTOCAST_DTYPE = {{"bf16": torch.bfloat16, "fp16": torch.float16}}.get(PRECISION)  # None: no autocast
''' + RUN_IO + '''    # Gradient all-reduce on the last micro-batch only (DDP's no_sync on the others): one all-reduce per
    # optimizer step instead of one per micro-batch, at no memory cost (each rank holds full gradients anyway).
    NO_SYNC = GRAD_ACCUM > 1
''' + RUN_DATA

_DDP = '''

    def parallelize(model, device, world):
        from torch.nn.parallel import DistributedDataParallel as DDP
        # Gradients all-reduced in buckets (25 MiB) overlapped with backward; gradient_as_bucket_view: the
        # gradients are views into the buckets, not a second copy of them. Frozen (LoRA base) weights get none.
        return DDP(model, device_ids=[device.index] if device.type == "cuda" else None, gradient_as_bucket_view=True)


    def clip(model):
        # After the all-reduce every rank holds the same full gradients: the same norm, no communication.
        torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.grad is not None], GRAD_CLIP)


    def sync_gradients(model, last):
        return contextlib.nullcontext() if last or not NO_SYNC else model.no_sync()


    def export(model, rank):
        # The replicas are identical: rank 0 writes the model as save_pretrained does (safetensors +
        # config.json; a tied head once), which AutoModelForCausalLM.from_pretrained(EXPORT_DIR) loads.
        if LORA:
            export_adapters(model, rank)
            return
        if rank == 0:
            model.module.save_pretrained(EXPORT_DIR)
            print(f"exported {{EXPORT_DIR}}", flush=True)
        dist.barrier()
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
        torch.manual_seed(SEED)  # the same initial weights on every rank (DDP also broadcasts rank 0's)
        # Built on the meta device and materialised straight on this rank's device: DDP keeps a whole replica
        # per rank, but no extra copy is built in host RAM first.
        with torch.device("meta"):
            model = build_model()
        {head_setup}
        if AC_EVERY:
            apply_activation_checkpointing(model)
        model.to_empty(device=device)
        if TIED:  # to_empty gives the head a weight of its own: share the embedding's again
            model.get_output_embeddings().weight = model.get_input_embeddings().weight
        init_weights(model, list(model.modules()))
        if PURE_BF16:
            model = model.to(torch.bfloat16)
        if WEIGHTS:
            load_weights(model, WEIGHTS)
        model = parallelize(model, device, world)
        {optimizer_note}
        {optimizer}
        scaler = torch.amp.GradScaler(device.type) if PRECISION == "fp16" else None  # fp16 needs loss scaling
        resume, first = newest_checkpoint() if SAVE_EVERY else (None, 0)
        if resume:
            load_checkpoint(model, optimizer, resume)
            if rank == 0:
                print(f"resumed from {{resume}} at step {{first}}", flush=True)
        data = batches(MODEL_CONFIG.get("vocab_size", 32000), device, rank, world, first * GRAD_ACCUM)
        start = time.perf_counter()
        for step in range(first, STEPS):
            total = 0.0
            for micro in range(GRAD_ACCUM):
                batch = next(data)
                with sync_gradients(model, last=micro == GRAD_ACCUM - 1):
                    with torch.autocast(device.type, dtype=AUTOCAST_DTYPE, enabled=AUTOCAST_DTYPE is not None):
                        {loss_line}
                    (scaler.scale(loss) if scaler else loss).backward()
                total += loss.item()
            if scaler:
                scaler.unscale_(optimizer)
            clip(model)
            if scaler:
                scaler.step(optimizer)
                scaler.update()
            else:
                optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            if rank == 0 and (step % LOG_EVERY == 0 or step == STEPS - 1):
                print(f"step {{step}} loss {{total:.4f}} {{time.perf_counter() - start:.1f}}s", flush=True)
            if SAVE_EVERY and ((step + 1) % SAVE_EVERY == 0 or step == STEPS - 1):
                save_checkpoint(model, optimizer, step + 1, rank)
        if os.environ.get("CHECKSUM"):  # replicas must agree: compare this line across ranks
            local = sum(float(p.detach().float().sum()) for p in model.parameters())
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


def ddp_script(plan: Plan, options: EmitOptions) -> str:
    config, lora = script_inputs(plan, "DDP script", "--format accelerate or torchrun")
    kernels = script_fields(plan, indent="    ", batch="batch")
    # Templates are indented in this file (so no line here reads as a top-level import) and dedented here.
    header = textwrap.dedent(_HEADER).format(**run_fields(plan, options, config, lora), precision=plan.training.precision,
                                             loss_code=kernels.pop("loss_code"))
    main = textwrap.dedent(_MAIN).format(
        **kernels, optimizer=optimizer_code(plan, "[p for p in model.parameters() if p.requires_grad]"),
        finish=SCRIPT_FINISH)
    state = state_functions("init_weights", "load_weights", "newest_checkpoint", "save_checkpoint",
                            "load_checkpoint", "export_adapters")
    return header + DATA_CODE + textwrap.dedent(_DDP).format() + state + main


def emit_ddp(plan: Plan, options: EmitOptions) -> Emitted:
    kind = plan.strategy.kind
    if kind == "single":
        raise ShardfitError("the plan is single-device: use --format single (no process group, no DDP)")
    if kind != "ddp":
        raise ShardfitError(f"the plan's strategy is {plan.strategy.label}: the DDP script replicates the whole model "
                            "on every rank; use --format fsdp2 (sharded) or deepspeed for this plan")
    return Emitted(files={"train_ddp.py": ddp_script(plan, options)})
