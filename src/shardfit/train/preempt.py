"""Preemption: a signal (SIGTERM, SIGUSR1: what SLURM and torchrun send before they kill) asks the job to
stop. The handler only records it; every step's loss all-reduce carries each rank's request, so all
ranks see the same sum after the same step, finish that step, save, write OUT/stopped.json and exit
with PREEMPTED_EXIT. No collective is left unpaired: no rank leaves a step the others are still in.

    stop = StopRequest.install()            # once, on every rank, before the loop
    slots = StepSlots(stop, saver)          # the extra numbers the step's all-reduce carries
"""
from __future__ import annotations

import json
import os
import signal
import threading
import time
from pathlib import Path

from shardfit.errors import ShardfitError

# EX_TEMPFAIL: "try again later". Not a failure: the emitted SLURM script requeues on it, and a
# torchrun restart resumes from the checkpoint the stop wrote.
PREEMPTED_EXIT = 75
DEFAULT_SIGNALS = ("SIGTERM", "SIGUSR1")
MARKER = "stopped.json"
ENV = "SHARDFIT_STOP_SIGNALS"  # comma-separated signal names (`--stop-signals`), or "none"


def signal_names(text: str | None) -> tuple[str, ...]:
    """Parse `SIGTERM,SIGUSR1` (the SIG prefix optional); one line on a name Python does not know."""
    if text is None or not text.strip():
        return DEFAULT_SIGNALS
    if text.strip().lower() == "none":
        return ()
    names = []
    for word in filter(None, (w.strip().upper() for w in text.split(","))):
        name = word if word.startswith("SIG") else f"SIG{word}"
        if not isinstance(getattr(signal, name, None), signal.Signals) or name in ("SIGKILL", "SIGSTOP"):
            raise ShardfitError(f"--stop-signals: '{word}' is not a signal a process can catch: use names such as "
                                "SIGTERM,SIGUSR1 (or none)")
        names.append(name)
    return tuple(names)


class StopRequest:
    """The first stop signal this process received (its number), or 0."""

    def __init__(self):
        self.signum = 0

    @classmethod
    def install(cls, names: tuple[str, ...] | None = None) -> "StopRequest":
        request = cls()
        if threading.current_thread() is not threading.main_thread():
            return request  # Python takes signals in the main thread only: nothing to install here
        for name in signal_names(os.environ.get(ENV)) if names is None else names:
            signal.signal(getattr(signal, name), request._handle)
        return request

    def _handle(self, signum, frame) -> None:  # noqa: ARG002 - the signal module's signature
        # Only a flag: the step in progress finishes; its all-reduce tells every rank. A second
        # signal of the same kind is not caught: it ends the process as it would have without us.
        if not self.signum:
            self.signum = int(signum)
        if frame is not None:
            signal.signal(signum, signal.SIG_DFL)

    def ask(self, signum: int) -> None:
        """As if the signal had arrived (tests, faults)."""
        self._handle(signum, None)


class StepSlots:
    """Two extra float64s appended to the step's [loss, tokens] all-reduce (SUM): how many ranks were
    asked to stop, and how many are still writing an asynchronous checkpoint. No extra collective
    in a step; every rank reads the same sums, so every rank takes the same decision."""

    COUNT = 2

    def __init__(self, stop: StopRequest, saver):
        self.stop, self.saver = stop, saver

    def fill(self, local, offset: int) -> None:
        local[offset] = 1.0 if self.stop.signum else 0.0
        local[offset + 1] = float(self.saver.writing())

    @staticmethod
    def read(reduced, offset: int) -> tuple[bool, bool]:
        """(stop after this step; every rank's asynchronous write is done)."""
        return float(reduced[offset]) > 0, float(reduced[offset + 1]) == 0

    def agreed_signal(self) -> int:
        """Collective, only once the ranks agreed to stop: the signal that asked (the lowest rank's)."""
        import torch.distributed as dist

        numbers = [0] * dist.get_world_size()
        dist.all_gather_object(numbers, self.stop.signum)
        return next((n for n in numbers if n), int(signal.SIGTERM))


def signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


def write_marker(out: Path, step: int, signum: int, checkpoint: Path | None) -> dict:
    """OUT/stopped.json (rank 0): why and where the run stopped, and how it continues."""
    data = {"reason": "preempted", "signal": signal_name(signum), "step": step,
            "checkpoint": str(checkpoint) if checkpoint is not None else None,
            "exit_code": PREEMPTED_EXIT, "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "unix_time": time.time(), "continue": "shardfit train ... --resume auto"}
    tmp = Path(out) / f".{MARKER}.tmp"
    tmp.write_text(json.dumps(data, indent=2) + "\n")
    os.replace(tmp, Path(out) / MARKER)
    return data


def read_marker(out: Path) -> dict | None:
    try:
        return json.loads((Path(out) / MARKER).read_text())
    except (OSError, ValueError):
        return None


def clear_marker(out: Path) -> None:
    """A run that starts again is no longer stopped."""
    try:
        (Path(out) / MARKER).unlink()
    except FileNotFoundError:
        pass


class Preempted(Exception):
    """Raised on every rank after the stop checkpoint is written; the CLI exits PREEMPTED_EXIT."""

    def __init__(self, step: int, signum: int, checkpoint: Path | None):
        self.step, self.signum, self.checkpoint = step, signum, checkpoint
        where = f"saved {checkpoint}" if checkpoint is not None else "no checkpoint could be saved"
        super().__init__(f"training stopped by {signal_name(signum)} after step {step}: {where}; "
                         "continue with --resume auto")
