"""Run a user's training script under `shardfit.profile` (discovery mode: the model is found at its
first top-level forward, the optimizer at its first step) and write this rank's report as JSON.

    torchrun --nproc-per-node 2 -m shardfit.measure.script_runner OUTDIR train.py ARGS...

Each rank writes OUTDIR/rank{RANK}.json when the script ends, even if it raised (an OOM included),
so the reports survive a script that destroys its process group, and leaves with the script's exit
code past the interpreter's teardown (the script's exit handlers still run); `shardfit profile
--script` gathers the files. A failing script's own words travel with its report: the exit code, the phase
and step it reached, and the tail of what it wrote to stderr (its traceback included).
"""
from __future__ import annotations

import atexit
import collections
import json
import os
import runpy
import sys
import threading
import traceback
from pathlib import Path
from typing import NoReturn

from shardfit.measure.api import profile
from shardfit.runtime_env import leave

TAIL_LINES = 12


class _StderrTail:
    """sys.stderr as the script sees it: everything still goes to the real stderr; the last lines
    are kept for the report."""

    def __init__(self, stream):
        self._stream = stream
        self._lines = collections.deque(maxlen=TAIL_LINES)
        self._partial = ""

    def write(self, text):
        self._stream.write(text)
        self._partial += text
        *done, self._partial = self._partial.split("\n")
        self._lines.extend(line for line in done if line.strip())
        return len(text)

    def tail(self) -> list[str]:
        return list(self._lines) + ([self._partial] if self._partial.strip() else [])

    def __getattr__(self, name):  # flush, fileno, isatty, encoding...
        return getattr(self._stream, name)


def _print_script_traceback(exc, script: str) -> None:
    """The traceback as Python would print it for `python script.py`: from the script's own frame
    on, without this runner's and runpy's frames above it."""
    tb, target = exc.__traceback__, str(Path(script).resolve())
    while tb is not None and str(Path(tb.tb_frame.f_code.co_filename).resolve()) != target:
        tb = tb.tb_next
    traceback.print_exception(type(exc), exc, tb or exc.__traceback__)


class _LeftThroughExit(BaseException):
    """The script called os._exit(code): raised in its place, so this rank's report is still written."""

    def __init__(self, code: int):
        super().__init__(code)
        self.code = code


def _exit_from(real_exit):
    def exit_(code: int = 0):
        if threading.current_thread() is not threading.main_thread():
            real_exit(code)  # a watchdog thread ending a hung process: as the script meant
        raise _LeftThroughExit(int(code))
    return exit_


def main(argv=None) -> NoReturn:
    argv = sys.argv[1:] if argv is None else argv
    out_dir, script, script_args = Path(argv[0]), argv[1], argv[2:]
    sys.argv = [script, *script_args]
    sys.path.insert(0, str(Path(script).resolve().parent))
    # explain_oom=False: `shardfit profile --script` explains the worst rank's OOM once, not every rank.
    prof = profile(explain_oom=False, label=Path(script).name)
    tail = _StderrTail(sys.stderr)
    sys.stderr = tail
    code, leave_now = 0, False
    # NOTE: a script may end with os._exit (the scripts `shardfit emit` writes do on CPU, past gloo's
    # teardown abort): that would end this process before the report below is written. In its place
    # it ends the script only; this rank then leaves the same way, once the report is on disk.
    real_exit = os._exit
    os._exit = _exit_from(real_exit)
    try:
        with prof:
            runpy.run_path(script, run_name="__main__")
    except _LeftThroughExit as exc:
        code, leave_now = exc.code, True
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        if exc.code is not None and not isinstance(exc.code, int):
            print(exc.code, file=sys.stderr)  # sys.exit("message") prints it, as Python would
    except BaseException as exc:  # noqa: BLE001 - report what was measured, then fail like the script
        _print_script_traceback(exc, script)
        code = 1
    finally:
        sys.stderr = tail._stream
        os._exit = real_exit
    report = prof.report().to_dict()
    report["script"] = {"exit_code": code, "phase": prof.current_phase, "step": prof.step,
                        "stderr_tail": tail.tail() if code else []}
    rank = int(os.environ.get("RANK", "0"))
    (out_dir / f"rank{rank}.json").write_text(json.dumps(report))
    if not leave_now:
        # The script's own exit handlers run as they would have; only the interpreter's teardown is
        # skipped, where gloo can abort a rank whose script finished (SIGABRT, exit 1 for the profile).
        atexit._run_exitfuncs()
    leave(code)


if __name__ == "__main__":
    main()
