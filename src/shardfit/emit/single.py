"""A runnable single-device training script from a Plan: no process group, no wrapper.

The model goes to the device as it is; bf16/fp16 run under torch.autocast over fp32 weights (fp16
with a GradScaler), bf16-pure casts the weights. It trains on random tokens so it runs anywhere;
swap `batches()` and `build_model()` for real data and weights.
"""
from __future__ import annotations

import textwrap

from shardfit.emit.common import Emitted, EmitOptions, ac_every, block_class, model_functions, script_inputs
from shardfit.emit.kernels import script_fields
from shardfit.emit.optimizer_code import optimizer_code
from shardfit.errors import ShardfitError
from shardfit.spec.plan import Plan

_SCRIPT = '''    """Single-device training script written by `shardfit emit --format single` for {model}: one device,
    no wrapper, micro-batch {micro} x accumulation {accum} = global batch {global_batch}.

    Run:  python {{this file}}     (no torchrun: one process, no process group)
    Without a GPU it runs on the CPU; STEPS=3 overrides the step count.
    """
    import os
    import time

    import torch

    STEPS = int(os.environ.get("STEPS", "{steps}"))
    MICRO_BATCH, GRAD_ACCUM, SEQ_LEN = {micro}, {accum}, {seq}
    LR, WEIGHT_DECAY, GRAD_CLIP, SEED, LOG_EVERY = {lr}, {wd}, {clip}, {seed}, {log_every}
    BLOCK_CLASS = "{block}"  # the repeated layer: the activation-checkpointing unit
    AC_EVERY = {ac_every}  # checkpoint every N-th block; 0 = off
    PRECISION = "{precision}"  # fp32 | bf16, fp16: autocast over fp32 weights | bf16-pure: bf16 weights
    LORA = {lora}
    MODEL_CONFIG = {config}


    {model_functions}{loss_code}


    def batches(vocab, device):
        gen = torch.Generator().manual_seed(SEED)
        while True:
            ids = torch.randint(0, vocab, (MICRO_BATCH, SEQ_LEN), generator=gen)
            yield ids.to(device)


    def main():
        cuda = torch.cuda.is_available()
        device = torch.device("cuda") if cuda else torch.device("cpu")
        torch.manual_seed(SEED)
        model = build_model()
        {head_setup}
        if AC_EVERY:
            apply_activation_checkpointing(model)
        if PRECISION == "bf16-pure":
            model = model.to(torch.bfloat16)
        model = model.to(device)  # the whole model on the one device: nothing is sharded or replicated
        params = [p for p in model.parameters() if p.requires_grad]
        {optimizer_note}
        {optimizer}
        autocast_dtype = {{"bf16": torch.bfloat16, "fp16": torch.float16}}.get(PRECISION)
        scaler = torch.amp.GradScaler(device.type) if PRECISION == "fp16" else None  # fp16 needs loss scaling
        data = batches(MODEL_CONFIG.get("vocab_size", 32000), device)
        start = time.perf_counter()
        for step in range(STEPS):
            total = 0.0
            for _ in range(GRAD_ACCUM):
                ids = next(data)
                with torch.autocast(device.type, dtype=autocast_dtype, enabled=autocast_dtype is not None):
                    {loss_line}
                (scaler.scale(loss) if scaler else loss).backward()  # gradients accumulate in .grad
                total += loss.item()
            if scaler:
                scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(params, GRAD_CLIP)
            if scaler:
                scaler.step(optimizer)
                scaler.update()
            else:
                optimizer.step()
            optimizer.zero_grad(set_to_none=True)  # frees the gradients until the next backward
            if step % LOG_EVERY == 0 or step == STEPS - 1:
                print(f"step {{step}} loss {{total:.4f}} {{time.perf_counter() - start:.1f}}s", flush=True)
        if cuda:
            print(f"peak allocated {{torch.cuda.max_memory_allocated(device) / 2**30:.2f}} GiB", flush=True)


    if __name__ == "__main__":
        main()
'''


def single_script(plan: Plan) -> str:
    t, sched = plan.training, plan.schedule
    config, lora = script_inputs(plan, "single-device script", "--format accelerate")
    fields = dict(model=plan.model.name, micro=t.micro_batch, accum=t.grad_accum, global_batch=plan.global_batch,
                  seq=t.seq_len, steps=sched.steps, lr=sched.lr, wd=sched.weight_decay, clip=sched.grad_clip,
                  seed=sched.seed, log_every=max(sched.log_every, 1),
                  block=plan.strategy.wrap_unit or block_class(plan.model), ac_every=ac_every(plan), model_functions=model_functions(plan),
                  precision=t.precision, lora=repr(lora), config=repr(config), **script_fields(plan),
                  optimizer=optimizer_code(plan, "params"))
    # The template is indented in this file (so no line here reads as a top-level import) and dedented here.
    return textwrap.dedent(_SCRIPT).format(**fields)


def emit_single(plan: Plan, options: EmitOptions) -> Emitted:
    s, c = plan.strategy, plan.cluster
    notes: list[str] = []
    if s.kind == "ddp" and c.world_size == 1:
        notes.append("the plan says ddp on one GPU; this script runs the same training without DDP's reducer "
                     "(and its bucket copy of every gradient)")
    elif s.kind != "single":
        raise ShardfitError(f"the plan's strategy is {s.label} on {c.world_size} GPU(s): the single-device script is for "
                            "single plans; use --format fsdp2, deepspeed or torchrun")
    return Emitted(files={"train_single.py": single_script(plan)}, notes=tuple(notes))
