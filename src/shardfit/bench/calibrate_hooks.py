"""The calibrate worker's engine-hook figures (bench/calibrate_worker.py runs them on every rank):
DeepSpeed's per-tensor and per-submodule host work, and per-op selective checkpointing's dispatch.
Also the worker's progress line, which the orchestrator (bench/calibrate.py) echoes by its prefix."""
from __future__ import annotations

import statistics
import time

from shardfit import sac
from shardfit.estimate.selective import selective_block_ops
from shardfit.modeling import build_model
from shardfit.spec.models import load_model_spec


def say(ctx, text: str) -> None:
    if ctx.rank == 0:
        print(f"calibrate: {text}", flush=True)


def round_robin(fns: dict, sync, rounds: int, barrier: bool = True) -> dict:
    """{key: median seconds} of each function, timed in turns (so the load of a shared machine drifts over
    all of them alike); with `barrier`, every rank starts each call together (collectives inside)."""
    import torch.distributed as dist

    times = {key: [] for key in fns}
    for _ in range(rounds):
        for key, fn in fns.items():
            if barrier:
                dist.barrier()
            sync()
            started = time.perf_counter()
            fn()
            sync()
            times[key].append(time.perf_counter() - started)
    return {key: statistics.median(values) for key, values in times.items()}


def linears(ctx):
    """HOOK_LAYERS bias-free HOOK_WIDTH linears, seeded: the hook measurements' model."""
    import torch

    torch.manual_seed(0)
    return torch.nn.Sequential(*[torch.nn.Linear(HOOK_WIDTH, HOOK_WIDTH, bias=False)
                                 for _ in range(HOOK_LAYERS)]).to(ctx.device)


# The hook measurement's model: many small linears, so the step is dominated by per-tensor and
# per-submodule work and not by bytes or FLOPs (which the other figures already measure).
HOOK_LAYERS = 24
HOOK_WIDTH = 32
# ZeRO-3 records the submodule order in its first step and prefetches only once that trace is
# complete: its first steps run 3-10x slower than the rest (measured here: 100, 38, 22 ms, then ~23).
HOOK_WARMUP_STEPS = 5
HOOK_ROUNDS = 30


def deepspeed_hooks(ctx, device: str, sync, latency_s: float) -> dict | None:
    """Seconds of DeepSpeed's host work per trained tensor (gradient hooks) and per ZeRO-3 submodule
    fetch event, on this machine with the installed DeepSpeed (fit/engine_overhead.py says where each
    hook runs). The same model of HOOK_LAYERS bias-free linears runs a step under ZeRO-1 with
    overlap_comm off (no hooks), ZeRO-2 (the gradient hooks) and ZeRO-3 (the hooks and a fetch in every
    linear's pre-forward and pre-backward hook; persistence threshold 0 so every linear is fetched):
    ZeRO-2 - ZeRO-1 over the tensors is the hook, ZeRO-3 - ZeRO-2 over the fetch events is the fetch,
    less the latency of the one collective ZeRO-3 adds here (the step-time model charges collectives apart).
    None when DeepSpeed does not import here."""
    try:
        import deepspeed
    except Exception:  # noqa: BLE001 - DeepSpeed is optional for calibrate; say so and go on
        say(ctx, "DeepSpeed hooks: not measured (deepspeed does not import); fit uses the published figures")
        return None
    import torch

    deepspeed.init_distributed(dist_backend=ctx.backend)
    batch = torch.randn(4, HOOK_WIDTH, device=ctx.device)
    steps = {}
    for stage in (1, 2, 3):
        model = linears(ctx)
        zero = {"stage": stage, "overlap_comm": stage == 3, "contiguous_gradients": True,
                "reduce_bucket_size": 10**8, "stage3_param_persistence_threshold": 0,
                "stage3_prefetch_bucket_size": 10**8}
        config = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1,
                  "zero_optimization": zero, "zero_allow_untested_optimizer": True, "steps_per_print": 10**9}
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=False)
        engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)

        def step(engine=engine):
            engine.backward(engine(batch).float().pow(2).mean())
            engine.step()

        for _ in range(HOOK_WARMUP_STEPS):
            step()
        steps[stage] = step
    seconds = round_robin(steps, sync, HOOK_ROUNDS)
    # ZeRO-3's collectives over ZeRO-2's two (one gradient reduction, one all-gather): every
    # parameter fits one prefetch bucket and one reduce bucket, so the first fetch plus one coalesced
    # all-gather in forward and one reduce-scatter in backward: one more (fit/steptime.py counts them so).
    extra_collectives = 1
    grad_hook = max(0.0, seconds[2] - seconds[1]) / HOOK_LAYERS
    fetch = max(0.0, seconds[3] - seconds[2] - extra_collectives * latency_s) / (2 * HOOK_LAYERS)
    say(ctx, f"DeepSpeed {deepspeed.__version__} hooks: {grad_hook * 1e6:.0f} us per gradient hook, "
             f"{fetch * 1e6:.0f} us per ZeRO-3 fetch (steps: ZeRO-1 {seconds[1] * 1e3:.1f} ms, ZeRO-2 "
             f"{seconds[2] * 1e3:.1f} ms, ZeRO-3 {seconds[3] * 1e3:.1f} ms over {HOOK_LAYERS} linears)")
    return {"deepspeed_grad_hook": grad_hook, "deepspeed_zero3_fetch": fetch, "deepspeed": deepspeed.__version__,
            "steps_s": {f"zero{stage}": s for stage, s in seconds.items()}}


SAC_CHAIN = 16  # elementwise triples in the chain SAC dispatch is measured on
SAC_ROUNDS = 60


def sac_dispatch(ctx, device: str, sync) -> float:
    """Seconds per aten op of per-op selective checkpointing's policy dispatch (shardfit/sac.py): a
    chain of elementwise ops checkpointed under SAC's context against the same chain under plain
    checkpointing. Both recompute every op (the policy keeps matmul outputs only, and the chain has
    none), so the difference is the dispatch mode, over the ops it sees in forward and recompute.
    Round-robin and medians, as for the hooks."""
    import torch
    from torch.utils.checkpoint import checkpoint
    from torch.utils._python_dispatch import TorchDispatchMode


    def chain(x):
        for _ in range(SAC_CHAIN):
            x = torch.sin(x) * 1.01 + 0.1
        return x

    class Count(TorchDispatchMode):
        ops = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            Count.ops += 1
            return func(*args, **(kwargs or {}))

    x = torch.randn(16, 16, device=ctx.device, requires_grad=True)
    with Count():
        chain(x)
    ops = Count.ops

    def plain():
        checkpoint(chain, x, use_reentrant=False).sum().backward()

    def selective():
        checkpoint(chain, x, use_reentrant=False, context_fn=sac.context_fn).sum().backward()

    for fn in (plain, selective):
        for _ in range(3):
            fn()
    seconds = round_robin({"plain": plain, "selective": selective}, sync, SAC_ROUNDS, barrier=False)
    per_op = max(0.0, seconds["selective"] - seconds["plain"]) / (2 * ops)
    say(ctx, f"selective checkpointing: {per_op * 1e6:.1f} us of policy dispatch per op ({ops} ops, forward "
             "and recompute)")
    return per_op


EAGER_ROUNDS = 40
EAGER_MODEL = "tiny-llama"  # a transformers block as users run it: modules, rotary, SDPA, the loss


def eager_dispatch(ctx, device: str, sync) -> dict:
    """Seconds of eager host work per aten op of a transformers model's forward, with and without its
    backward: tiny-llama at 1 x 8 tokens (the compute is nothing), forward with autograd recording,
    then forward + backward, over the forward's aten ops. A small model's step on a CPU is mostly this
    (the modules' Python, the dispatcher, autograd's graph and its backward); a GPU hides it behind
    kernels longer than the launch (fit/engine_overhead.py scales it by each model's traced ops)."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode


    model = build_model(load_model_spec(EAGER_MODEL), device=ctx.device.type, dtype="fp32", seed=0,
                        attn_implementation="sdpa").train()
    ids = torch.randint(0, model.config.vocab_size, (1, 8), device=ctx.device)

    class Count(TorchDispatchMode):
        ops = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            Count.ops += 1
            return func(*args, **(kwargs or {}))

    with Count():
        model(input_ids=ids, labels=ids)
    ops = Count.ops

    # One block's forward ops as the step-time model counts them (the same trace it scales by).
    block_ops = selective_block_ops(load_model_spec(EAGER_MODEL), "fp32", "sdpa")

    def forward():
        model(input_ids=ids, labels=ids)

    def both():
        model(input_ids=ids, labels=ids).loss.backward()

    def checkpointed():
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        try:
            both()
        finally:
            model.activation_checkpointing_disable()

    for fn in (forward, both, checkpointed):
        for _ in range(3):
            fn()
    seconds = round_robin({forward: forward, both: both, checkpointed: checkpointed}, sync, EAGER_ROUNDS,
                          barrier=False)
    per_forward = seconds[forward] / ops
    per_backward = max(0.0, seconds[both] - seconds[forward]) / ops
    # Full checkpointing: the recompute of every block plus torch.utils.checkpoint's own machinery
    # (its saved-tensor hooks, the recompute's bookkeeping), per op of the blocks it recomputes.
    recomputed = model.config.num_hidden_layers * block_ops
    per_recomputed = max(0.0, seconds[checkpointed] - seconds[both]) / max(recomputed, 1)
    say(ctx, f"eager host work: {per_forward * 1e6:.1f} us per forward op, {per_backward * 1e6:.1f} us for its "
             f"backward, {per_recomputed * 1e6:.1f} us per checkpointed op ({EAGER_MODEL}, {ops} ops)")
    # The ops outside the blocks (embedding, final norm, head, loss), counted on this model: the step-time
    # model adds them to every model's blocks.
    head_ops = max(0.0, ops - model.config.num_hidden_layers * block_ops)
    return {"eager_forward_op": per_forward, "eager_backward_op": per_backward, "eager_recompute_op": per_recomputed,
            "eager_head_ops": head_ops}


def ddp_hook(ctx, device: str, sync, latency_s: float) -> dict:
    """Seconds of DDP's host work per trained tensor beyond its all-reduce's latency (its autograd hook
    copies each gradient into the bucket), on HOOK_LAYERS bias-free linears against the same model with
    no wrapper; forward + backward timed, round-robin and medians, as for DeepSpeed's hooks. (FSDP's
    per-unit work is measured through the engines on a transformers model: calibrate_engines.py.)"""
    import torch
    from torch.nn.parallel import DistributedDataParallel

    batch = torch.randn(4, HOOK_WIDTH, device=ctx.device)
    runs = {}
    for name, m in (("plain", linears(ctx)), ("ddp", DistributedDataParallel(linears(ctx)))):
        def backward(m=m):
            m(batch).float().pow(2).mean().backward()
            m.zero_grad(set_to_none=True)

        for _ in range(HOOK_WARMUP_STEPS):
            backward()
        runs[name] = backward
    seconds = round_robin(runs, sync, HOOK_ROUNDS)
    # One bucket here (25 MiB holds every gradient), so one all-reduce.
    ddp = max(0.0, seconds["ddp"] - seconds["plain"] - latency_s) / HOOK_LAYERS
    say(ctx, f"DDP: {ddp * 1e6:.0f} us per gradient (forward + backward: none {seconds['plain'] * 1e3:.1f} ms, DDP "
             f"{seconds['ddp'] * 1e3:.1f} ms over {HOOK_LAYERS} linears)")
    return {"ddp_grad_hook": ddp}
