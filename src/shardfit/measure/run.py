"""Run measured steps under torchrun and bring the ranks' reports back: the protocol between
`shardfit profile` / `fit --verify` and their workers (measure/worker.py, measure/script_runner.py).

A plan run writes its job as configs.json (a list of one config) for measure/worker.py, which
appends one JSON line per config to out.jsonl. A script run (`profile --script`) leaves one
rank<N>.json per rank in a temporary folder.
"""
from __future__ import annotations

import json
import tempfile
from pathlib import Path

from shardfit.errors import ShardfitError
from shardfit.launcher import free_port, torchrun
from shardfit.runtime_env import launch_env
from shardfit.spec.models import model_spec_for
from shardfit.spec.plan import Plan, plan_from_dict


def load_plan(data: dict) -> Plan:
    """The Plan of a config's plan data, as the worker loads it (the command loads it first, to fail
    fast with one line on a bad plan)."""
    return plan_from_dict(data, resolve_model=model_spec_for)


def _launch(target: list[str], nproc: int, timeout: float, what: str, env: dict | None = None):
    done = torchrun(target, nproc, timeout=timeout, endpoint=f"127.0.0.1:{free_port()}", capture=True, env=env)
    if done.timed_out:
        raise ShardfitError(f"{what} did not finish within {timeout:.0f}s (a hang?): raise --timeout")
    return done


def _tail(done, lines: int) -> str:
    return " | ".join((done.stderr or "").strip().splitlines()[-lines:])


def run_plan_worker(config: dict, nproc: int, timeout: float, what: str = "the profiled run", tail: int = 5) -> dict:
    """Run measure/worker.py on one config ({"plan": plan data, "steps", "checkpoint", "budget_bytes",
    "label", optional "timed_steps"}) on `nproc` ranks; its JSON result (the worker reports a failed
    or out-of-memory step in `error`, it never raises)."""
    with tempfile.TemporaryDirectory() as tmp:
        configs, out = Path(tmp) / "configs.json", Path(tmp) / "out.jsonl"
        configs.write_text(json.dumps([config]))
        done = _launch(["-m", "shardfit.measure.worker", str(configs), str(out)], nproc, timeout, what)
        if not out.exists():
            raise ShardfitError(f"{what} failed before reporting: {_tail(done, tail)}")
        return json.loads(out.read_text().splitlines()[0])


def run_script(script: Path, script_args: list[str], nproc: int, timeout: float,
               budget_bytes: int | None = None) -> tuple[list[dict], int]:
    """Run a user's script under shardfit.profile on `nproc` ranks: (each rank's report, torchrun's
    exit code)."""
    env = launch_env()
    if budget_bytes:
        env["SHARDFIT_MEMORY_BUDGET"] = str(int(budget_bytes))  # read by shardfit.profile in each rank
    with tempfile.TemporaryDirectory() as tmp:
        target = ["-m", "shardfit.measure.script_runner", tmp, str(script), *script_args]
        done = _launch(target, nproc, timeout, "the profiled run", env=env)
        files = sorted(Path(tmp).glob("rank*.json"))
        if not files:
            raise ShardfitError(f"the script failed before reporting (exit {done.returncode}): {_tail(done, 5)}")
        return [json.loads(f.read_text()) for f in files], done.returncode
