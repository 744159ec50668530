"""One real `shardfit bench` run shared by the bench tests: the embedded default (every strategy,
2 ranks, gloo) plus one strategy made to fail with an impossible memory budget."""
from __future__ import annotations

import json
import time

import pytest

from launch import shardfit

DEFAULT = ["ddp", "fsdp:full_shard", "fsdp:shard_grad_op", "fsdp2", "zero1", "zero2", "zero3", "zero3+offload"]
DOOMED = "fsdp2:no_reshard"  # given a 1000-byte budget: must be reported as OOM, the others finish


@pytest.fixture(scope="session")
def bench_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    started = time.perf_counter()
    result = shardfit("bench", "--strategies", ",".join(DEFAULT + [DOOMED]), "--budget-bytes", f"{DOOMED}=1000",
                      "--out", str(out), timeout=900, check=False)
    seconds = time.perf_counter() - started
    assert (out / "report.json").is_file(), f"no report (exit {result.returncode}):\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    report = json.loads((out / "report.json").read_text())
    return {"out": out, "proc": result, "report": report, "seconds": seconds,
            "by_label": {r["strategy"]: r for r in report["results"]}}
