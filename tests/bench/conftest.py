"""One real `shardfit bench` run shared by the bench tests: the embedded default (every strategy,
2 ranks, gloo) plus one strategy made to fail with an impossible memory budget."""
from __future__ import annotations

import json
import subprocess
import time

import pytest
from filelock import FileLock

from launch import shardfit

DEFAULT = ["ddp", "fsdp:full_shard", "fsdp:shard_grad_op", "fsdp2", "zero1", "zero2", "zero3", "zero3+offload"]
DOOMED = "fsdp2:no_reshard"  # given a 1000-byte budget: must be reported as OOM, the others finish


@pytest.fixture(scope="session")
def bench_run(tmp_path_factory):
    # The suite runs a file per pytest-xdist worker, so a session fixture runs once per worker that
    # asks for it: the bench (~4 minutes of both cores) ran twice. The first worker runs it under a
    # lock in the directory all workers share; the others wait there and read its result.
    shared = tmp_path_factory.getbasetemp().parent
    out, record = shared / "bench-run", shared / "bench-run.json"
    with FileLock(str(shared / "bench-run.lock")):
        if not record.is_file():
            out.mkdir(exist_ok=True)
            started = time.perf_counter()
            result = shardfit("bench", "--strategies", ",".join(DEFAULT + [DOOMED]), "--budget-bytes",
                              f"{DOOMED}=1000", "--out", str(out), timeout=900, check=False)
            record.write_text(json.dumps({"returncode": result.returncode, "stdout": result.stdout,
                                          "stderr": result.stderr, "seconds": time.perf_counter() - started}))
    ran = json.loads(record.read_text())
    proc = subprocess.CompletedProcess(["shardfit", "bench"], ran["returncode"], ran["stdout"], ran["stderr"])
    assert (out / "report.json").is_file(), f"no report (exit {proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    report = json.loads((out / "report.json").read_text())
    return {"out": out, "proc": proc, "report": report, "seconds": ran["seconds"],
            "by_label": {r["strategy"]: r for r in report["results"]}}
