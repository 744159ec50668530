"""Benchmark: fit's step-time model against published training throughput.

Every row of benchmarks/published_throughput.yaml is a published run with its setup stated exactly
(model, GPUs, strategy, micro-batch, sequence, precision, checkpointing). This script builds the same
Plan, asks the step-time model for tokens/s per GPU, and prints predicted beside published, the error
distribution, and whether the predicted ORDER inside each group (one source, one machine) is the
published order: fit picks by that order, so it matters more than the absolute figure.

Run: python benchmarks/bench_published.py [--json OUT.json]   (analytic: no torch, well under a second)
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from dataclasses import dataclass, replace
from itertools import combinations
from pathlib import Path

import yaml

from shardfit.estimate import estimate
from shardfit.fit.steptime import step_time
from shardfit.spec.models import load_model_spec
from shardfit.spec.plan import Cluster, Plan, Training, parse_strategy

TABLE = Path(__file__).with_name("published_throughput.yaml")
NOISE = 0.05  # published figures closer than this are not ordered


@dataclass(frozen=True)
class Row:
    id: str
    source: str
    group: str
    plan: Plan
    published: float  # tokens/s per GPU
    note: str
    memory_gib: float | None


@dataclass(frozen=True)
class Compared:
    row: Row
    predicted: float  # tokens/s per GPU
    peak_gib: float  # predicted device peak per GPU

    @property
    def error(self) -> float:
        """predicted / published - 1: positive = the model is optimistic."""
        return self.predicted / self.row.published - 1.0


def load_rows(path: Path = TABLE) -> tuple[dict, list[Row]]:
    data = yaml.safe_load(path.read_text())
    rows = []
    for raw in data["rows"]:
        gpus, nodes = raw["gpus"], raw["nodes"]
        strategy = parse_strategy(raw["strategy"])
        if "overlap_comm" in raw:
            strategy = replace(strategy, overlap_comm=bool(raw["overlap_comm"]))
        plan = Plan(model=load_model_spec(raw["model"]), strategy=strategy,
                    training=Training(micro_batch=raw["micro_batch"], seq_len=raw["seq"],
                                      grad_accum=raw.get("grad_accum", 1), precision=raw["precision"],
                                      activation_checkpointing=raw["ac"], attention=raw.get("attention", "sdpa")),
                    cluster=Cluster(nodes=nodes, gpus_per_node=gpus // nodes, gpu=raw["gpu"]))
        if "tokens_per_gpu_s" in raw:
            published = float(raw["tokens_per_gpu_s"])
        else:
            published = float(raw["samples_per_s"]) * raw["seq"] / gpus
        rows.append(Row(id=raw["id"], source=raw["source"], group=raw["group"], plan=plan, published=published,
                        note=raw.get("as_published", ""), memory_gib=raw.get("memory_gib")))
    return data["sources"], rows


def compare(rows: list[Row]) -> list[Compared]:
    out = []
    for row in rows:
        st = step_time(row.plan)
        est = estimate(row.plan)
        out.append(Compared(row=row, predicted=st.tokens / st.total_s, peak_gib=est.device_peak_bytes / 2**30))
    return out


def order_agreement(compared: list[Compared]) -> dict[str, tuple[int, int]]:
    """Per group: (pairs ordered as published, pairs) over pairs whose published figures differ by
    more than NOISE (closer than that, the source's own noise decides: torchtitan logs one iteration,
    the autotuner a few)."""
    groups: dict[str, list[Compared]] = {}
    for c in compared:
        groups.setdefault(c.row.group, []).append(c)
    out = {}
    for name, items in groups.items():
        agree = total = 0
        for a, b in combinations(items, 2):
            if abs(a.row.published / b.row.published - 1.0) <= NOISE:
                continue
            total += 1
            agree += (a.row.published > b.row.published) == (a.predicted > b.predicted)
        if total:
            out[name] = (agree, total)
    return out


def summary(compared: list[Compared]) -> dict:
    errors = [abs(c.error) for c in compared]
    pairs = order_agreement(compared)
    return {"rows": len(compared), "median_abs_error": statistics.median(errors), "max_abs_error": max(errors),
            "within_25pct": sum(e <= 0.25 for e in errors), "within_50pct": sum(e <= 0.5 for e in errors),
            "pairs_ordered": sum(a for a, _ in pairs.values()), "pairs": sum(t for _, t in pairs.values())}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="write rows and summary here")
    args = parser.parse_args(argv)
    sources, rows = load_rows()
    compared = compare(rows)
    print(f"# bench_published  {len(rows)} published runs from {len(sources)} sources  ({TABLE.name})")
    print(f"{'row':26s} {'setup':44s} {'published':>9s} {'predicted':>9s} {'error':>7s} {'peak':>9s}")
    for c in compared:
        p = c.row.plan
        setup = (f"{p.model.name} {p.cluster.world_size}x{p.cluster.gpu} {p.strategy.label} mb{p.training.micro_batch} "
                 f"s{p.training.seq_len} {p.training.activation_checkpointing}")
        memory = f" (pub {c.row.memory_gib:g})" if c.row.memory_gib else ""
        print(f"{c.row.id:26s} {setup:44s} {c.row.published:9,.0f} {c.predicted:9,.0f} {c.error:+7.0%} "
              f"{c.peak_gib:6.1f} GiB{memory}")
    print(f"\norder inside each group (pairs whose published figures differ by > {NOISE:.0%}):")
    for name, (agree, total) in order_agreement(compared).items():
        print(f"  {name:22s} {agree}/{total} pairs in the published order")
    s = summary(compared)
    print(f"\nabsolute error: median {s['median_abs_error']:.0%}, max {s['max_abs_error']:.0%}; "
          f"{s['within_25pct']}/{s['rows']} rows within 25%, {s['within_50pct']}/{s['rows']} within 50%; "
          f"order: {s['pairs_ordered']}/{s['pairs']} pairs; torch imported: {'torch' in sys.modules}")
    if args.json:
        Path(args.json).write_text(json.dumps({"summary": s, "rows": [
            {"id": c.row.id, "published": c.row.published, "predicted": c.predicted, "error": c.error,
             "peak_gib": c.peak_gib} for c in compared]}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
