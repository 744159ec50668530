"""The estimator on architectures it has no hand-written rules for, against real 2-rank CPU steps.

For each architecture a tiny config of its own model type (shardfit.spec.tiny) is planned through the
derived path (meta-device spec, traced activation coefficients) and run for real under torchrun with
the tracker (shardfit.measure.worker: every engine, every phase, every rank; `single` on one rank). Printed per
configuration: the worst category error over all phases and the peak error; then the share of
configurations with every term within 5% (or 1% of its phase total when small) and every peak within
5%, and the terms that miss. --json writes every comparison.

Run: .venv/bin/python benchmarks/bench_any_model.py [--archs qwen3,phi3] [--strategies ddp,fsdp2]
     [--precisions fp32,bf16] [--ac none,full] [--json out.json]   (the full grid: ~10-20 min here)
     --strategies fsdp2 --tp 2 [--sp]: FSDP2 x TP on 4 ranks (a rank's sliced config, estimate/derived_parallel.py)
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

from shardfit.bench.run import torchrun_job
from shardfit.measure.compare import off_terms
from shardfit.spec.tiny import tiny_config
from shardfit.spec.plan import is_deepspeed_kind

# GQA/MQA, MoE with and without shared experts, multi-head latent attention, sliding-window and
# hybrid attention, parallel attention + MLP, LayerNorm and RMSNorm, tied and untied heads.
ARCHITECTURES = ("qwen3", "phi3", "olmo2", "deepseek_v3", "gpt_neox", "falcon", "gemma3_text", "qwen3_moe",
                 "starcoder2", "granitemoe", "opt", "bloom", "cohere")
TORCH = ("single", "ddp", "fsdp", "fsdp2")
DEEPSPEED = ("zero1", "zero2", "zero3")
SMALL_BUCKETS = {"reduce_bucket_size": 100_000, "allgather_bucket_size": 100_000, "prefetch_bucket_size": 100_000}


def plan_dict(model_dir: str, strategy: str, precision: str, ac: str, tp: int = 1, sp: bool = False) -> dict:
    kind, _, option = strategy.partition(":")
    fields = {"kind": kind}
    if option:
        fields["sharding"] = option
    if is_deepspeed_kind(kind):
        fields.update(SMALL_BUCKETS)
    out = {"model": model_dir, "strategy": fields,
           "cluster": {"nodes": 1, "gpus_per_node": 1 if kind == "single" else 2 * tp},
           "training": {"micro_batch": 2, "seq_len": 64, "precision": precision, "activation_checkpointing": ac}}
    if tp > 1:  # dp 2 x tp: the model's own TP plan, gathered logits (what the engine runs)
        out["parallelism"] = {"tp": tp, "loss_parallel": False, "sequence_parallel": sp}
    return out


def grid(folder: Path, archs, strategies, precisions, acs, tp: int = 1, sp: bool = False) -> list[dict]:
    configs = []
    for arch in archs:
        model = folder / "models" / arch
        model.mkdir(parents=True, exist_ok=True)
        (model / "config.json").write_text(json.dumps(tiny_config(arch)))
        for strategy in strategies:
            for precision in precisions:
                for ac in acs:
                    layout = f"/tp{tp}{'+sp' if sp else ''}" if tp > 1 else ""
                    configs.append({"label": f"{arch}/{strategy}{layout}/{precision}/ac-{ac}", "steps": 2,
                                    "plan": plan_dict(str(model), strategy, precision, ac, tp, sp)})
    return configs


def measure(configs: list[dict], folder: Path, name: str, timeout: float, nproc: int = 2) -> list[dict]:
    if not configs:
        return []
    (folder / f"{name}.json").write_text(json.dumps(configs))
    out, log = folder / f"{name}.jsonl", folder / f"{name}.log"
    code, seconds = torchrun_job([str(folder / f"{name}.json"), str(out)], nproc, timeout, log,
                                 module="shardfit.measure.worker")
    print(f"{name}: {len(configs)} configurations in {seconds:.0f} s (exit {code})", file=sys.stderr)
    return [json.loads(line) for line in out.read_text().splitlines()] if out.exists() else []


def summarize(results: list[dict]) -> tuple[list[str], dict]:
    lines = [f"{'configuration':<38}{'worst term':>12}{'peak':>8}  terms off"]
    clean = peaks = 0
    misses: dict[str, int] = {}
    for result in results:
        if result.get("error"):
            lines.append(f"{result['label']:<38}{'error':>12}{'':>8}  {result['error'][:80]}")
            continue
        comparison = result["comparison"]
        off = off_terms(comparison, peak_tolerance=0.05)
        worst = max((abs(row["error"]) for phase, rows in comparison.items() if phase != "peak"
                     for cat, row in rows.items() if cat != "total" and row["error"] is not None
                     and row["measured"] >= 0.01 * max(rows["total"]["measured"], 1)), default=0.0)
        peak = comparison["peak"]["error"] or 0.0
        clean += not off
        peaks += abs(peak) <= 0.05
        for term in off:
            misses[term] = misses.get(term, 0) + 1
        lines.append(f"{result['label']:<38}{worst:>11.1%}{peak:>+8.1%}  {', '.join(sorted(off)) or '-'}")
    total = max(len(results), 1)
    summary = {"configurations": len(results), "every_term_within": clean, "peak_within_5pct": peaks,
               "terms_off": dict(sorted(misses.items(), key=lambda item: -item[1]))}
    lines.append(f"every term within 5% (1% of phase when small): {clean}/{len(results)} ({clean / total:.0%}); "
                 f"peak within 5%: {peaks}/{len(results)} ({peaks / total:.0%})")
    lines.append("terms off, by count: " + (", ".join(f"{t} x{n}" for t, n in summary["terms_off"].items()) or "none"))
    return lines, summary


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--archs", default=",".join(ARCHITECTURES))
    parser.add_argument("--strategies", default=",".join(TORCH + DEEPSPEED))
    parser.add_argument("--precisions", default="fp32,bf16")
    parser.add_argument("--ac", default="none,full")
    parser.add_argument("--tp", type=int, default=1, help="tensor parallel over tp of 2 x tp ranks (fsdp2 only; "
                        "architectures whose TP plan a sliced config cannot reproduce report their one-line refusal)")
    parser.add_argument("--sp", action="store_true", help="sequence parallel in the TP regions (with --tp)")
    parser.add_argument("--timeout", type=float, default=1800)
    parser.add_argument("--json", help="write every result here")
    args = parser.parse_args()
    split = lambda text: [x for x in text.split(",") if x]  # noqa: E731
    strategies = split(args.strategies)
    if args.tp > 1 and any(s != "fsdp2" for s in strategies):
        parser.error("--tp runs under fsdp2 only (the engine's FSDP2 x TP): pass --strategies fsdp2")
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        os.environ.setdefault("SHARDFIT_CACHE_DIR", str(folder / "cache"))
        configs = grid(folder, split(args.archs), strategies, split(args.precisions), split(args.ac), args.tp, args.sp)
        kind = lambda config: config["plan"]["strategy"]["kind"]  # noqa: E731
        single = [c for c in configs if kind(c) == "single"]
        torch_configs = [c for c in configs if not is_deepspeed_kind(kind(c)) and kind(c) != "single"]
        ds_configs = [c for c in configs if is_deepspeed_kind(kind(c))]
        # One device, no wrapper: a one-rank job, as `shardfit train` launches it.
        results = (measure(single, folder, "single", args.timeout, nproc=1)
                   + measure(torch_configs, folder, "torch", args.timeout, nproc=2 * args.tp)
                   + measure(ds_configs, folder, "deepspeed", args.timeout))
    lines, summary = summarize(results)
    print(f"host: {platform.node()}, Python {platform.python_version()}, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; "
          f"{2 * args.tp} CPU ranks (single: 1){f', dp 2 x tp {args.tp}' if args.tp > 1 else ''}"
          f"{' + sp' if args.sp else ''}, micro-batch 2 x seq 64")
    print("\n".join(lines))
    if args.json:
        Path(args.json).write_text(json.dumps({"summary": summary, "results": results}, indent=1))
    return 0 if results and len(results) == len(configs) else 1


if __name__ == "__main__":
    raise SystemExit(main())
