"""The training loop, engine-agnostic: accumulation, NaN/inf detection, logging, evaluation with a
generated sample, checkpoints and resume. One call per run, on every rank:

    records = train(plan, out_dir="runs/a", resume=None)
"""
from __future__ import annotations

import gc
import json
import math
import random
import resource
import sys
import time
from dataclasses import dataclass
from typing import Callable
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from shardfit import engines
from shardfit.data import DistributedBatches, collate, load_data
from shardfit.engines.base import DistContext, init_distributed
from shardfit.engines.chunked_loss import chunked_head, model_loss
from shardfit.engines.dcp_io import close_async_writer
from shardfit.engines.tensor_parallel import data_rank
from shardfit.errors import ShardfitError
from shardfit.measure.api import active_profiler
from shardfit.modeling import build_model as build
from shardfit.train import checkpoint as ckpt
from shardfit.train import faults, preempt, runlock
from shardfit.train.export import copy_tokenizer_note, export_engine
from shardfit.train.generate import engine_generate
from shardfit.train.saver import Saver
from shardfit.train.supervise import check_layout
from shardfit.train.watchdog import Watchdog
from shardfit.units import fmt_bytes

DEFAULT_PROMPT = "In the morning, the baker"


@dataclass(frozen=True)
class RunOptions:
    resume: str | None = None
    progress: bool = True
    prompt: str = DEFAULT_PROMPT
    new_tokens: int = 24
    eval_batches: int = 4
    export: str | None = None
    quiet: bool = False
    # Called with the engine once the run is done (tests and benchmarks that inspect the final state);
    # the engine is released when train returns otherwise.
    on_finish: Callable | None = None


def peak_memory_bytes(device) -> tuple[int | None, int]:
    """(tensor peak, process RSS peak). Tensors: the CUDA allocator's peak; on a CPU the memory
    budget's own accounting (None without a budget: nothing counts tensors there). The RSS holds the
    interpreter and libraries too (~0.4 GiB), so it is no tensor figure."""
    rss = int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024  # Linux reports KiB
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device)), rss
    profiler = active_profiler()
    return (profiler.tensor_peak_bytes if profiler is not None else None), rss


def stdout_is_terminal() -> bool:
    """A live progress bar only on a terminal: in a log or a pipe its redraws become one repeated
    line per update, interleaved with the log lines."""
    return sys.stdout.isatty()


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def build_model(plan):
    """On CPU, fp32, seeded: every engine and every rank starts from the same weights. A local model
    folder with weights (e.g. one `shardfit export` wrote) starts from those weights instead."""
    source = Path(plan.model.source)
    folder = source.parent if source.name == "config.json" else source
    if folder.is_dir() and any(folder.glob("*.safetensors")):
        from transformers import AutoModelForCausalLM

        torch.manual_seed(plan.schedule.seed)
        model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32,
                                                     attn_implementation=plan.training.attention)
        model.config.use_cache = False  # a KV cache under activation checkpointing breaks recompute
        return model.train()
    return build(plan.model, device="cpu", dtype="fp32", seed=plan.schedule.seed,
                 attn_implementation=plan.training.attention)


def train(plan, out_dir, options: RunOptions = RunOptions(), ctx: DistContext | None = None, model=None) -> list[dict]:
    ctx = ctx or init_distributed()
    out = Path(out_dir)
    check_layout(plan)
    if ctx.is_main:
        out.mkdir(parents=True, exist_ok=True)
    with runlock.held(out, ctx.is_main):  # one writer per run folder
        try:
            return _train(plan, out, options, ctx, model)
        finally:
            if plan.schedule.save_mode == "async":
                close_async_writer()


def _train(plan, out: Path, options: RunOptions, ctx: DistContext, model) -> list[dict]:
    s, t = plan.schedule, plan.training
    stop = preempt.StopRequest.install()  # before the slow set-up: a signal during it stops at step 1
    model = model if model is not None else build_model(plan)
    vocab = int(getattr(getattr(model, "config", None), "vocab_size", 0) or 0)
    tokenizer, data = load_data(plan.data.path, plan.data.tokenizer, t.seq_len, vocab)
    engine = engines.setup(plan, model, ctx)
    settle_garbage_collector()
    lengths = [len(e) for e in data.train]
    # The ranks of one TP group read the same batch: the data splits over the dp ranks only.
    shard = data_shard(plan, ctx)
    batches = DistributedBatches(lengths, t.micro_batch, *shard, s.seed)
    # Identical randomness on every rank (dropout masks differ only through data).
    seed_everything(s.seed)

    start = 0
    path = ckpt.resolve_resume(options.resume, out, log=lambda text: _say(ctx, options, text)) if options.resume else None
    if path is not None:  # None: `--resume auto` found no checkpoint, a fresh start
        start, position = ckpt.load_checkpoint(engine, path)
        batches = DistributedBatches(lengths, t.micro_batch, *shard, s.seed, position=position)
        _say(ctx, options, f"resumed from {path} at step {start}")
    if ctx.is_main:
        preempt.clear_marker(out)
    saver = Saver(engine, out / "checkpoints", s.keep_checkpoints, s.save_mode, s.on_save_error,
                  log=lambda text: _say(ctx, options, text, bar))
    slots = preempt.StepSlots(stop, saver)

    metrics_file = out / "metrics.jsonl"
    records: list[dict] = []
    bar = None  # the saver's log reads it when it is set
    if ctx.is_main and options.progress and not options.quiet and stdout_is_terminal():
        from tqdm import tqdm
        # On stdout, with the log lines it makes room for: `shardfit train` relays its workers'
        # stderr through a pipe, so a bar there would be redrawn out of order with them.
        bar = tqdm(total=s.steps, initial=start, desc=f"train {engine.kind}", unit="step", leave=False, file=sys.stdout)
    window_tokens, window_start = 0, time.perf_counter()
    dog = Watchdog.for_context(ctx)
    for step in range(start, s.steps):
        step_start = time.perf_counter()
        local = torch.zeros(2 + slots.COUNT, dtype=torch.float64)
        for micro in range(t.grad_accum):
            batch = collate([data.train[i] for i in batches.next()], data.pad_id)
            faults.hit("micro", step + 1, ctx.rank)
            with dog.watch(step + 1, f"forward/backward {micro + 1}/{t.grad_accum} ({_collectives(engine.kind)})"):
                loss = engine.forward_backward(batch, micro == t.grad_accum - 1)
            local[0] += loss.double().cpu()
            local[1] += float(batch["attention_mask"].sum())
        faults.hit("step", step + 1, ctx.rank)
        slots.fill(local, 2)  # the stop requests and the asynchronous writes ride on the loss all-reduce
        reduced = local.to(ctx.device)
        with dog.watch(step + 1, "all_reduce(loss)"):
            dist.all_reduce(reduced)  # SUM: gloo has no AVG
        stopping, writes_done = slots.read(reduced, 2)
        step_loss = float(reduced[0]) / (ctx.world_size * t.grad_accum)
        tokens = int(reduced[1]) // plan.parallelism.model_parallel  # each batch counted once per TP rank
        if not math.isfinite(step_loss):
            if s.nan_policy == "stop" or plan.strategy.is_deepspeed:
                raise ShardfitError(f"loss is {step_loss} at step {step + 1}: lower the lr, use bf16 instead of fp16, "
                                    "or set schedule.nan_policy: skip")
            engine.zero_grad()
            record = {"step": step + 1, "loss": step_loss, "skipped": True}
        else:
            with dog.watch(step + 1, "optimizer step (grad-norm all_reduce)"):
                grad_norm, stepped = engine.step()
            window_tokens += tokens
            record = {"step": step + 1, "loss": step_loss, "grad_norm": grad_norm,
                      "lr": _lr(engine), "tokens": tokens, "skipped": not stepped}
        record["step_time"] = time.perf_counter() - step_start
        records.append(record)
        if (step + 1) % max(1, s.log_every) == 0 or step + 1 == s.steps:
            elapsed = time.perf_counter() - window_start
            record["tokens_per_s"] = window_tokens / elapsed if elapsed > 0 else 0.0
            tensors, record["rss_bytes"] = peak_memory_bytes(ctx.device)
            if tensors is not None:
                record["peak_mem_bytes"] = tensors
            window_tokens, window_start = 0, time.perf_counter()
            _say(ctx, options, _log_line(record, s.steps), bar)
        if s.eval_every and (step + 1) % s.eval_every == 0:
            with dog.watch(step + 1, "evaluation (all_reduce, generation)", scale=3):
                record.update(evaluate(engine, data, tokenizer, options))
            sample = (f"sample {options.prompt!r} -> {record['sample']!r}" if engine.eval_loss is None
                      else "no sample (no pipeline rank holds the whole model)")
            _say(ctx, options, f"eval step {step + 1}: val_loss {record['val_loss']:.4f} | {sample}", bar)
        if ctx.is_main:
            with metrics_file.open("a") as fh:
                fh.write(json.dumps(record) + "\n")
        if saver.pending is not None and writes_done:
            with dog.watch(step + 1, "checkpoint publish (checksums, manifest)", scale=6):
                saver.finish()
        saved = None
        if s.save_every and ((step + 1) % s.save_every == 0 or step + 1 == s.steps):
            with dog.watch(step + 1, "checkpoint save (barrier, checksums)", scale=6):
                saved = saver.save(step + 1, batches.position, blocking=step + 1 == s.steps)
        if bar is not None:
            bar.update(1)
        if stopping and step + 1 < s.steps:
            with dog.watch(step + 1, "checkpoint save before stopping", scale=6):
                saved = _stop_checkpoint(saver, saved, step + 1, batches.position)
                saver.close()
            signum = slots.agreed_signal()
            if ctx.is_main:
                preempt.write_marker(out, step + 1, signum, saved)
            dog.close()
            if bar is not None:
                bar.close()
            raise preempt.Preempted(step + 1, signum, saved)
    with dog.watch(s.steps, "checkpoint publish (checksums, manifest)", scale=6):
        saver.close()
    dog.close()
    if bar is not None:
        bar.close()
    if options.export:
        export_engine(engine, Path(options.export))
        if ctx.is_main:
            copy_tokenizer_note(Path(options.export), tokenizer.name)
        _say(ctx, options, f"exported {options.export}")
    if options.on_finish is not None:
        options.on_finish(engine)
    return records


def _stop_checkpoint(saver, saved, step: int, position):
    """The checkpoint of `step` before a stop: the one this step already saved, once published."""
    pending = saver.pending
    if pending is not None and pending.step == step:
        return saver.finish()
    saver.finish()
    if saved is not None:
        return saved
    return saver.save(step, position, blocking=True)


def data_shard(plan, ctx: DistContext) -> tuple[int, int]:
    """(this rank's index among the data-parallel ranks, their number)."""
    return data_rank(plan, ctx.rank), ctx.world_size // plan.parallelism.model_parallel


def settle_garbage_collector() -> None:
    """Collect once, then move every object alive now (the model, the engine, the imported
    libraries: about a million with torch and transformers) out of the collector's reach. Without
    this, each full collection walks all of them: a pause of ~0.2 s here that lands on whatever step,
    checkpoint save or load happens to cross the collector's threshold."""
    gc.collect()
    gc.freeze()


def _collectives(kind: str) -> str:
    return {"single": "no collectives", "ddp": "gradient all_reduce", "fsdp": "all_gather/reduce_scatter",
            "fsdp2": "all_gather/reduce_scatter"}.get(kind, "DeepSpeed all_gather/reduce_scatter")


def evaluate(engine, data, tokenizer, options: RunOptions) -> dict:
    """Validation loss over the first eval_batches global batches of the held-out split (the same
    examples every time), and a greedy sample from the prompt."""
    ctx, t = engine.ctx, engine.plan.training
    rank, ranks = data_shard(engine.plan, ctx)
    span = t.micro_batch * ranks
    count = max(1, min(options.eval_batches, len(data.val) // span))
    if engine.eval_loss is not None:
        return _pipeline_evaluate(engine, data, count, rank, ranks)
    total = torch.zeros(1, dtype=torch.float64)
    with engine.inference() as model:
        head = chunked_head(model)  # the plan's loss, as in training
        for k in range(count):
            start = k * span + rank * t.micro_batch
            batch = collate(list(data.val[start:start + t.micro_batch]), data.pad_id)
            batch = {key: value.to(ctx.device) for key, value in batch.items()}
            total += float(model_loss(model, batch, head).float())
    total = total.to(ctx.device)
    dist.all_reduce(total)
    tokens, text = engine_generate(engine, tokenizer, options.prompt, options.new_tokens)
    return {"val_loss": float(total) / (count * ctx.world_size), "sample": text, "sample_ids": tokens}


def _pipeline_evaluate(engine, data, count: int, rank: int, ranks: int) -> dict:
    """evaluate() under pipeline parallelism: the held-out micro-batches go through the schedule in
    groups of its micro-batch count (the same examples every time, wrapping around a short split);
    the last stage's ranks hold the losses. No sample: no rank holds the whole model to generate."""
    ctx, t = engine.ctx, engine.plan.training
    group = engine.plan.parallelism.pp_microbatches or t.grad_accum
    count = -(-count // group) * group
    span = t.micro_batch * ranks
    total = torch.zeros(1, dtype=torch.float64)
    for first in range(0, count, group):
        batches = []
        for k in range(first, first + group):
            start = k * span + rank * t.micro_batch
            batches.append(collate([data.val[i % len(data.val)] for i in range(start, start + t.micro_batch)],
                                   data.pad_id))
        total += float(engine.eval_loss(batches))
    total = total.to(ctx.device)
    dist.all_reduce(total)  # the last stage's dp x tp ranks: each dp replica's sum, tp times
    last_stage = ctx.world_size // engine.plan.parallelism.pp
    return {"val_loss": float(total) / (count * last_stage), "sample": "", "sample_ids": []}


def _lr(engine) -> float:
    return float(engine.optimizer.param_groups[0]["lr"])


def _log_line(record: dict, total: int) -> str:
    memory = f"rss {fmt_bytes(record.get('rss_bytes', 0))}"
    if record.get("peak_mem_bytes") is not None:
        memory = f"peak tensors {fmt_bytes(record['peak_mem_bytes'])} | " + memory
    return (f"step {record['step']}/{total} | loss {record['loss']:.4f} | lr {record.get('lr', 0):.2e} | "
            f"grad {record.get('grad_norm', float('nan')):.3f} | {record.get('tokens_per_s', 0):,.0f} tok/s | "
            + memory + (" | skipped" if record.get("skipped") else ""))


def _say(ctx, options, text, bar=None):
    if ctx.is_main and not options.quiet:
        if bar is not None:
            bar.write(text)
        else:
            print(text, flush=True)
