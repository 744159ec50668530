"""Step time of a real Hugging Face Trainer with ShardfitCallback tracking over without (single
process, CPU), and with the callback switched off (must be ~1.00x).

    .venv/bin/python benchmarks/bench_integrations_overhead.py [--model tiny-llama] [--seq 256] [--steps 6]

Each mode trains a fresh Trainer for --steps steps (the callback tracks all of them); the median
step time (on_step_begin -> on_step_end, the first step dropped) is compared, rounds interleaved
so machine noise hits every mode alike.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path

PRESETS = Path(__file__).resolve().parents[1] / "src" / "shardfit" / "spec" / "presets"


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="tiny-llama")
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--steps", type=int, default=6, help="steps per round and mode")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()

    import torch
    import transformers
    from transformers import AutoConfig, AutoModelForCausalLM, Trainer, TrainingArguments

    from shardfit.integrations.transformers import ShardfitCallback

    torch.set_num_threads(1)
    transformers.logging.set_verbosity_error()
    config = AutoConfig.for_model(**json.loads((PRESETS / f"{args.model}.json").read_text()))
    ids = torch.randint(0, config.vocab_size, (args.batch * args.steps, args.seq), generator=torch.Generator().manual_seed(0))
    data = [{"input_ids": x, "labels": x} for x in ids]

    class Clock(transformers.TrainerCallback):
        def __init__(self):
            self.times, self._start = [], 0.0

        def on_step_begin(self, *a, **k):
            self._start = time.perf_counter()

        def on_step_end(self, *a, **k):
            self.times.append(time.perf_counter() - self._start)

    def run(mode: str) -> list[float]:
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config)
        clock = Clock()
        callbacks = [clock]  # the clock first: it stops before shardfit's step-end work
        if mode != "none":
            callbacks.append(ShardfitCallback(steps=args.steps + 1, enabled=mode == "on"))
        with tempfile.TemporaryDirectory() as out:
            targs = TrainingArguments(output_dir=out, max_steps=args.steps, per_device_train_batch_size=args.batch,
                                      use_cpu=True, report_to="none", save_strategy="no", disable_tqdm=True,
                                      optim="adamw_torch", logging_strategy="no", dataloader_num_workers=0)
            Trainer(model=model, args=targs, train_dataset=data, callbacks=callbacks).train()
        return clock.times[1:]

    modes = ("none", "off", "on")
    times: dict = {m: [] for m in modes}
    for _ in range(args.rounds):
        for mode in modes:
            times[mode] += run(mode)
    median = {m: statistics.median(v) for m, v in times.items()}
    print(f"measured on {platform.node()} ({os.cpu_count()} CPUs, 1 thread), torch {torch.__version__}, "
          f"transformers {transformers.__version__}: HF Trainer, {args.model}, micro-batch {args.batch} x seq {args.seq}, "
          f"{args.rounds} rounds x {args.steps} steps")
    for mode, label in (("none", "no callback"), ("off", "ShardfitCallback(enabled=False)"), ("on", "ShardfitCallback tracking")):
        print(f"  {label:<34} {median[mode] * 1e3:8.1f} ms/step  x{median[mode] / median['none']:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
