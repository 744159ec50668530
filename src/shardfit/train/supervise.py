"""What `shardfit train` does around the training loop so a failure ends in one readable line:
checks before torchrun starts, torchrun with restarts and without its own traceback, the worker's
handling of an OOM (autopilot) and of a lost peer. The loop itself is in loop.py.
"""
from __future__ import annotations

import json
import math
import os
import re
import signal
import sys
import time
from pathlib import Path

from shardfit.errors import ShardfitError
from shardfit.launcher import torchrun
from shardfit.measure.oom import collect_run_diagnosis, diagnose, format_diagnosis, untracked_oom, write_rank_diagnosis
from shardfit.measure.report import RankReport
from shardfit.runtime_env import launch_env
from shardfit.spec.engine_rules import train_layout_error
from shardfit.train import preempt, runlock
from shardfit.train.flags import TrainFlags
from shardfit.train.manifest import MANIFEST, step_folders

SUPERVISED_ENV = "SHARDFIT_SUPERVISED"  # set for workers whose supervisor prints the OOM diagnosis once
_PEER_LOST = ("Connection closed by peer", "Connection reset by peer", "Broken pipe", "Socket Timeout",
              "NCCL communicator was aborted")


def check_layout(plan) -> None:
    """The layouts the loop runs (spec/engine_rules.py): data parallel, and tp under FSDP2, where the
    data, the loss and evaluation split over the dp ranks and a TP group reads one batch."""
    error = train_layout_error(plan)
    if error:
        raise ShardfitError(error)


def check_run(plan, flags: TrainFlags, inside: bool) -> None:
    """What only `train` needs from a Plan and its flags: checked before torchrun starts, one line each."""
    if flags.model is not None and not flags.model.strip():
        raise ShardfitError("--model is empty: give a preset name (see `shardfit models`), a config path or pkg.module:fn")
    check_layout(plan)
    s = plan.schedule
    for name, value, low in (("steps", s.steps, 1), ("log_every", s.log_every, 0), ("eval_every", s.eval_every, 0),
                             ("save_every", s.save_every, 0), ("keep_checkpoints", s.keep_checkpoints, 0),
                             ("warmup_steps", s.warmup_steps, 0)):
        if value < low:
            raise ShardfitError(f"schedule.{name} must be at least {low}, got {value}")
    for name, value in (("lr", s.lr), ("weight_decay", s.weight_decay), ("grad_clip", s.grad_clip),
                        ("min_lr_ratio", s.min_lr_ratio)):
        if not math.isfinite(value) or value < 0:
            raise ShardfitError(f"schedule.{name} must be a finite number >= 0, got {value}")
    for name, value, known in (("save_mode", s.save_mode, ("sync", "async")),
                               ("on_save_error", s.on_save_error, ("stop", "continue"))):
        if value not in known:
            raise ShardfitError(f"schedule.{name} '{value}' is not known: use {' or '.join(known)}")
    if s.save_mode == "async" and plan.strategy.is_deepspeed:
        raise ShardfitError("schedule.save_mode async is not supported with DeepSpeed (its asynchronous checkpoint "
                            "engines need the async_io op: libaio and a GPU): use save_mode sync")
    preempt.signal_names(flags.stop_signals)
    for name, value in (("data.path", plan.data.path), ("data.tokenizer", plan.data.tokenizer)):
        if value and not Path(value).exists():
            raise ShardfitError(f"{name} '{value}' does not exist: give a local file or folder")

    out = Path(flags.out)
    if not inside:
        runlock.check(out)  # the workers' rank 0 takes the lock; refuse here already, before torchrun starts
    if not inside and not flags.resume and (step_folders(out / "checkpoints") or (out / "metrics.jsonl").exists()):
        # NOTE: a second run into the same folder would overwrite its checkpoints and mix its metrics.
        raise ShardfitError(f"--out {flags.out} already holds a run: continue it with --resume latest, or choose "
                            "another --out (nothing was changed)")
    if flags.resume in ("latest", "latest-valid") and not inside and not step_folders(Path(flags.out) / "checkpoints"):
        raise ShardfitError(f"--resume {flags.resume}: no checkpoint under {Path(flags.out) / 'checkpoints'} "
                            "(use --resume auto to start fresh when there is none)")
    if flags.resume and flags.resume not in ("latest", "latest-valid", "auto"):
        folder = Path(flags.resume)
        if not (folder / MANIFEST).is_file() and not step_folders(folder / "checkpoints"):
            raise ShardfitError(f"--resume {flags.resume}: not a checkpoint folder (no {MANIFEST}) nor a run folder with "
                                "checkpoints (give 'latest', 'latest-valid', 'auto', a run or a checkpoint folder)")
    for name, value in (("--memory-budget", flags.memory_budget), ("--collective-timeout", flags.collective_timeout)):
        if value is not None and (not math.isfinite(value) or value <= 0):
            raise ShardfitError(f"{name} must be a positive number, got {value}")
    if flags.max_restarts is not None and flags.max_restarts < 0:
        raise ShardfitError(f"--max-restarts must be 0 or more, got {flags.max_restarts}")
    if flags.nnodes > 1 and not flags.rdzv_endpoint:
        raise ShardfitError("--nnodes > 1 needs --rdzv-endpoint HOST:PORT (the same on every node)")


def export_env(flags: TrainFlags) -> None:
    """The workers read these (also when a user starts them with torchrun directly)."""
    if flags.memory_budget is not None:
        os.environ["SHARDFIT_MEMORY_BUDGET"] = str(int(flags.memory_budget))
    if flags.collective_timeout is not None:
        os.environ["SHARDFIT_COLLECTIVE_TIMEOUT"] = str(flags.collective_timeout)
    if flags.stop_signals:
        os.environ["SHARDFIT_STOP_SIGNALS"] = flags.stop_signals


def relaunch(worker_argv: list[str], flags: TrainFlags, restarts: int) -> int:
    """torchrun with `restarts`; its own failure report (a traceback of the launcher and a table) is
    replaced by one line, the workers' own lines pass through untouched."""
    stops = preempt.signal_names(os.environ.get(preempt.ENV))
    # torchrun passes on the signals it handles to the workers (and gives them 30 s): the stop
    # signals must be among them, or SIGUSR1 would end torchrun itself.
    options = [f"--max-restarts={restarts}",
               "--signals-to-handle=" + ",".join(dict.fromkeys(("SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT", *stops)))]
    target = ["-m", "shardfit", *worker_argv]
    where = dict(nnodes=flags.nnodes, node_rank=flags.node_rank, endpoint=flags.rdzv_endpoint, options=options)
    env = launch_env()
    if os.environ.get("SHARDFIT_DEBUG"):
        return torchrun(target, flags.nproc, timeout=None, env=env, **where).returncode
    env[SUPERVISED_ENV] = "1"
    started = time.time() - 1  # file times have a coarse grain on some file systems
    failures: list = []

    def watch(process) -> None:
        # A signal to `shardfit train` itself goes on to torchrun, and from it to the workers.
        before = {name: signal.signal(getattr(signal, name), lambda signum, frame: process.send_signal(signum))
                  for name in stops}
        try:
            failures.extend(filter_launcher(process.stderr, sys.stderr))
            process.wait()
        finally:
            for name, handler in before.items():
                signal.signal(getattr(signal, name), handler)

    # A training run takes as long as it takes: no timeout (the watchdog stops a hang from inside).
    code = torchrun(target, flags.nproc, timeout=None, env=env, watch=watch, **where).returncode
    marker = preempt.read_marker(Path(flags.out)) if flags.out else None
    if code != 0 and marker and marker.get("unix_time", 0) >= started:
        print(f"shardfit: training preempted ({marker.get('signal')}) after step {marker.get('step')}: checkpoint "
              f"{marker.get('checkpoint')}; continue with --resume auto", file=sys.stderr, flush=True)
        return preempt.PREEMPTED_EXIT
    oom = _run_oom(flags.out, started) if code != 0 else None
    if oom is not None:
        diagnosis, text, path = oom
        print(text, file=sys.stderr)
        print(f"shardfit: error: training stopped: out of memory on rank {diagnosis.rank} in {diagnosis.phase} "
              f"(step {diagnosis.step}); this diagnosis is also in {path}: rerun with one of its changes, or with "
              "--autopilot", file=sys.stderr, flush=True)
    elif code != 0:
        if failures:  # the last one ended the job; earlier ones were recovered by restarts
            rank, status = failures[-1]
            what = f"rank {rank} " + (f"was killed (signal {-status})" if status < 0 else f"exited with code {status}")
        else:
            what = f"torchrun exited with code {code}"
        print(f"shardfit: error: training stopped: {what}; its own error is above"
              + ("" if restarts == 0 else f" ({restarts} restart(s) were allowed)"), file=sys.stderr, flush=True)
    return code


_AGENT_LINE = re.compile(r"^[IWE]\d{4} \d\d:\d\d:\d\d\.\d+ +\d+ \S*torch/distributed/")
_AGENT_FAILED = re.compile(r"failed \(exitcode: (-?\d+)\) local_rank: (\d+)")


def filter_launcher(lines, sink) -> list[tuple[int, int]]:
    """Drop torchrun's own log lines and its ChildFailedError report; return (local rank, exit code)
    of each failure it logged, in order."""
    failures, block = [], None
    for line in lines:
        if block is not None:
            block.append(line)
            launcher = any("torch/distributed/" in b or "ChildFailedError" in b for b in block)
            if launcher and line.startswith("====") and any(b.startswith("Root Cause") for b in block):
                block = None  # the end of torchrun's report: drop it whole
            elif launcher and "elastic.multiprocessing.api.SignalException:" in line:
                block = None  # torchrun passed a stop signal on: the workers say what they did with it
            elif not launcher and (len(block) > 400 or (line.strip() and not line.startswith((" ", "Traceback")))):
                sink.writelines(block)
                block = None
            continue
        if _AGENT_LINE.match(line):
            found = _AGENT_FAILED.search(line)
            if found:
                failures.append((int(found.group(2)), int(found.group(1))))
            continue
        if line.startswith("Traceback (most recent call last)"):
            block = [line]
            continue
        sink.write(line)
        sink.flush()
    if block:
        sink.writelines(block)
    return failures


def _run_oom(out, since: float):
    try:
        return collect_run_diagnosis(out, since)
    except OSError:
        return None


def explain_oom(exc, profiler, plan, out, rank: int) -> int:
    """A worker's out-of-memory error without --autopilot: the diagnosis `shardfit profile` gives
    (phase, what grew by category, the smallest changes that fit, as flags and plan fields), written
    to OUT/oom/rank-N.json. Under `shardfit train` the supervisor prints the worst rank's once;
    a worker started by torchrun directly prints its own."""
    if profiler is not None and getattr(profiler, "oom", None):
        report = profiler.report()
    else:
        step = next_step(out) or 0
        report = RankReport(rank=rank, world_size=int(os.environ.get("WORLD_SIZE", "1")), device="cuda",
                            oom=untracked_oom(exc, step))
    try:
        diagnosis = diagnose(report, plan)
    except ShardfitError:
        diagnosis = None
    if diagnosis is None:
        raise oom_error(exc, rank)
    try:
        write_rank_diagnosis(diagnosis, out)
    except OSError:
        pass  # a full disk must not hide the diagnosis: it is printed below
    else:
        if os.environ.get(SUPERVISED_ENV):
            return 2
    print(format_diagnosis(diagnosis), file=sys.stderr, flush=True)
    return 2


def oom_error(exc, rank: int) -> ShardfitError:
    detail = str(exc).strip().strip("'\"").splitlines()[0] if str(exc).strip() else type(exc).__name__
    return ShardfitError(f"out of memory on rank {rank} ({detail}): rerun with --autopilot, or see `shardfit fit` "
                         "for a plan that fits")


def lost_peer(exc: BaseException) -> ShardfitError | None:
    """The one-line error for a collective that failed because another rank died, else None."""
    text = str(exc)
    if not any(sign in text for sign in _PEER_LOST):
        return None
    detail = re.sub(r"^\[[^\]]*\] ", "", text.splitlines()[0]).split(". This is typically")[0][-120:]
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)
    then = ("torchrun restarts every rank from the newest intact checkpoint"
            if attempt < int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0") or 0) else "resume with --resume latest-valid")
    return ShardfitError(f"rank {os.environ.get('RANK', '?')} lost contact with another rank ({detail}): that rank "
                         f"crashed or was killed, see its own error above; {then}")


def next_step(out) -> int | None:
    """The step that was running: one past the last one logged (rank 0 writes metrics.jsonl)."""
    try:
        lines = (Path(out) / "metrics.jsonl").read_text().splitlines()
        return int(json.loads(lines[-1])["step"]) + 1 if lines else 1
    except FileNotFoundError:
        return 1
    except (OSError, ValueError, KeyError, IndexError):
        return None
