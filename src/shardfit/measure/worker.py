"""The profiling harness, run on every rank under torchrun: for each configuration in a JSON list,
build the Plan's model on shardfit.engines, run a few real steps under `shardfit.profile`, gather the
ranks on rank 0 and append one JSON line (measured, estimated, errors) to the output file.

    torchrun --nproc-per-node 2 -m shardfit.measure.worker CONFIGS.json OUT.jsonl

One launch loops over many configurations: process start and imports dominate a tiny model's run.
Each configuration: {"plan": {...plan dict, model by preset name...}, "steps": 2, "checkpoint": false,
"budget_bytes": null, "budget_of": null}. `budget_of: [k, f]` sets the budget to f times the forward
peak that configuration k measured (a forced OOM in forward when f < 1).
"""
from __future__ import annotations

import gc
import json
import sys
import tempfile
import time
import traceback

import torch
import torch.distributed as dist

from shardfit import engines
from shardfit.engines.base import init_distributed
from shardfit.engines.tensor_parallel import data_rank
from shardfit.estimate.estimator import estimate
from shardfit.measure.api import profile
from shardfit.measure.compare import compare
from shardfit.measure.oom import worst_rank_diagnosis
from shardfit.measure.report import gather
from shardfit.measure.run import load_plan
from shardfit.modeling import build_model
from shardfit.runtime_env import leave
from shardfit.spec.plan import is_deepspeed_kind


def make_batch(plan, step: int, rank: int, vocab: int) -> dict:
    t = plan.training
    rank = data_rank(plan, rank)  # the ranks of one TP group / one pipeline read the same batch
    generator = torch.Generator().manual_seed(plan.schedule.seed * 1000 + step * 17 + rank)
    ids = torch.randint(0, vocab, (t.micro_batch, t.seq_len), generator=generator)
    return {"input_ids": ids, "labels": ids.clone()}


def estimate_dict(plan, device: str = "cpu") -> dict:
    est = estimate(plan, device=device)
    return {"phases": est.phases, "peak_phase": est.peak_phase, "peak_bytes": est.peak_bytes,
            "overhead": est.overhead, "host": est.host, "assumptions": list(est.assumptions)}


def run_one(config: dict, ctx, previous: list) -> dict:
    plan = load_plan(config["plan"])
    steps = int(config.get("steps", 2))
    budget = config.get("budget_bytes")
    if config.get("budget_of") is not None:
        index, fraction = config["budget_of"]
        forward = previous[index]["measured"]["forward"]
        budget = int(fraction * sum(v for k, v in forward.items() if k != "host"))
    started = time.perf_counter()
    prof = profile(plan=plan, budget_bytes=budget, explain_oom=False, label=plan.strategy.label)
    engine = None
    error = None
    losses = []  # per optimizer step, the last micro-batch's; "repeat_batch": the same batch every step
    with prof:
        try:
            model = build_model(plan.model.source, device="cpu", dtype=None, seed=plan.schedule.seed,
                                attn_implementation=plan.training.attention)
            engine = engines.setup(plan, model, ctx)
            del model
            prof.attach(engine.model, engine.optimizer)
            vocab = plan.model.vocab_size
            for step in range(steps):
                for micro in range(plan.training.grad_accum):
                    index = micro if config.get("repeat_batch") else step * plan.training.grad_accum + micro
                    batch = make_batch(plan, index, ctx.rank, vocab)
                    loss = engine.forward_backward(batch, last=micro == plan.training.grad_accum - 1)
                # The pipeline engine's last micro-batch returns the step's sum: its mean is recorded.
                losses.append(float(loss) / (plan.training.grad_accum if engine.kind == "pipeline" else 1))
                if not is_deepspeed_kind(engine.kind):
                    engine.step()
            if config.get("checkpoint"):
                with tempfile.TemporaryDirectory() as directory, prof.phase("checkpoint"):
                    engine.save(directory)
        except torch.OutOfMemoryError as exc:
            prof.record_oom(exc)
            error = "oom"
    report = prof.report()
    step_times = _timed_steps(engine, plan, ctx, vocab, steps, int(config.get("timed_steps", 0))) if error is None else []
    engine = None
    gc.collect()
    gathered = gather(report, everywhere=True)

    estimate = estimate_dict(plan, "cuda" if ctx.device.type == "cuda" else "cpu")
    out = {"label": config.get("label") or plan.strategy.label, "plan": config["plan"], "budget_bytes": budget,
           "error": error, "seconds": round(time.perf_counter() - started, 2), "measured": gathered.phases,
           "step_times_s": step_times, "losses": losses,
           "report": gathered.to_dict(), "estimate": estimate,
           "comparison": compare(gathered.phases, estimate["phases"]) if estimate else None}
    if error == "oom":
        diagnosis = worst_rank_diagnosis(gathered.ranks, plan)
        out["diagnosis"] = diagnosis.to_dict() if diagnosis else None
    return out


def _timed_steps(engine, plan, ctx, vocab: int, first: int, count: int) -> list[float]:
    """Seconds of `count` more optimizer steps, outside the profiler (its hooks cost time): what
    `fit --verify` compares with the step-time model. Each rank's time is the slowest rank's."""
    accum = plan.training.grad_accum
    times = []
    for step in range(first, first + count):
        batches = [make_batch(plan, step * accum + micro, ctx.rank, vocab) for micro in range(accum)]
        dist.barrier()
        if ctx.device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        for micro, batch in enumerate(batches):
            loss = engine.forward_backward(batch, last=micro == accum - 1)
        if not is_deepspeed_kind(engine.kind):
            engine.step()
        float(loss)
        if ctx.device.type == "cuda":
            torch.cuda.synchronize()
        seconds = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
        dist.all_reduce(seconds, op=dist.ReduceOp.MAX)
        times.append(float(seconds))
    return times


def _reset_zero3_linear() -> None:
    """Undo ZeRO-3's process-wide F.linear replacement before the next configuration. DeepSpeed swaps in
    LinearFunctionForZeroStage3, which saves every linear's input, frozen or not, and says "This will persist
    unless manually reset" (partition_parameters.py _enable_mem_efficient_linear): a ZeRO-2 LoRA run after a
    ZeRO-3 one measured ZeRO-3's activations (1,541,128 B instead of 1,278,984 B on tiny-llama)."""
    zero = sys.modules.get("deepspeed.runtime.zero.partition_parameters")
    original = getattr(getattr(zero, "InsertPostInitMethodToModuleSubClasses", None), "linear_bk", None)
    if original is not None:
        torch.nn.functional.linear = original


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    configs_path, out_path = argv[0], argv[1]

    ctx = init_distributed()
    torch.set_num_threads(1)
    with open(configs_path) as handle:
        configs = json.load(handle)
    results = []
    for config in configs:
        try:
            result = run_one(config, ctx, results)
        except Exception as exc:  # noqa: BLE001 - one bad configuration must not hide the others
            result = {"label": config.get("label"), "plan": config.get("plan"), "error": f"{type(exc).__name__}: {exc}",
                      "traceback": traceback.format_exc()[-3000:]}
            if ctx.rank == 0:
                print(result["traceback"], file=sys.stderr)
        results.append(result)
        _reset_zero3_linear()
        if ctx.rank == 0:
            with open(out_path, "a") as handle:
                handle.write(json.dumps(result) + "\n")
        dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    leave(main())  # without the interpreter's teardown, where gloo can abort a finished rank
