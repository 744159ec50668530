"""What the fuzz tests share (test_fuzz_plans.py, test_fuzz_commands.py): the in-process CLI runner
with torchrun replaced by a sentinel, the one-line-error contract, and the base plan and bad values
the fuzzers mutate with.

Contract checked everywhere: a rejected input exits non-zero with exactly ONE line on stderr
(`shardfit: error: ...`), never a traceback and never `internal error` (that line means an
exception escaped the validation: a bug), and never leaves a partial output file behind.
Nothing here launches training: the launchers are replaced by a sentinel that stops the command
at the point where validation is over, so an input that reaches it was *accepted*.

A test module gets the sentinel by importing the autouse fixture: `from fuzz_helpers import no_launch`.
"""
from __future__ import annotations

import contextlib
import io

import pytest
from hypothesis import HealthCheck, settings, strategies as st

import shardfit.bench.run as bench_run
import shardfit.measure.run as measure_run
import shardfit.train.supervise as supervise
from shardfit.cli import main

FUZZ = settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)


class WouldLaunch(BaseException):
    """Raised instead of starting torchrun: BaseException so the CLI's last-resort handler lets it by."""


@pytest.fixture(autouse=True)
def no_launch(monkeypatch):
    def stop(*args, **kwargs):
        raise WouldLaunch()

    # NOTE: the torchrun start itself: everything `shardfit train` and `profile` check before it still runs.
    monkeypatch.setattr(supervise, "relaunch", stop)
    monkeypatch.setattr(measure_run, "torchrun", stop)
    monkeypatch.setattr(bench_run, "bench", stop)
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)


def cli(*argv: str) -> tuple[int | str, str, str]:
    """Run the CLI in-process; rc is 'launch' when the input passed validation and would train."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            rc = main([str(a) for a in argv])
        except WouldLaunch:
            rc = "launch"
    return rc, out.getvalue(), err.getvalue()


def assert_one_line_error(rc, err: str, argv=()) -> str:
    lines = [line for line in err.splitlines() if line.strip()]
    assert rc not in (0, "launch"), f"accepted bad input {list(argv)}: rc={rc}"
    assert "Traceback" not in err, f"traceback for {list(argv)}:\n{err}"
    assert len(lines) == 1, f"{list(argv)}: expected one line on stderr, got {len(lines)}:\n{err}"
    assert lines[0].startswith("shardfit: error: "), f"{list(argv)}: {lines[0]}"
    assert "internal error" not in lines[0], f"{list(argv)}: {lines[0]}"
    return lines[0]


def assert_clean(rc, err: str, argv=()) -> None:
    """Accepted or rejected, but never a crash."""
    if rc in (0, "launch"):
        assert "Traceback" not in err and "internal error" not in err, f"{list(argv)}:\n{err}"
    elif rc == 1 and not err.strip():
        pass  # an explicit negative answer ("nothing fits"), printed on stdout
    else:
        assert_one_line_error(rc, err, argv)


BASE_PLAN = {
    "model": "tiny-llama",
    "strategy": {"kind": "ddp"},
    "training": {"micro_batch": 2, "seq_len": 64, "grad_accum": 1, "precision": "fp32"},
    "cluster": {"nodes": 1, "gpus_per_node": 2, "gpu": "H100-80GB"},
    "schedule": {"steps": 4, "lr": 1e-3},
    "data": {},
}
BAD_WORDS = ["", "zero9", "fsdp3", "H900", "custom:-4", "custom:abc", "nvme", "every-0", "every-x", "bf17",
             "!!python/object:os.system", "-1", "1e400", "nan", "inf", "\x00", "é" * 3, "a" * 300]
VALUES = st.one_of(
    st.integers(min_value=-(2**70), max_value=2**70),
    st.sampled_from([0, -1, 1, 2**31, 2**63, 10**30]),
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from(BAD_WORDS),
    st.text(max_size=12),
    st.booleans(),
    st.none(),
    st.lists(st.integers(-3, 3), max_size=3),
    st.dictionaries(st.text(max_size=5), st.integers(-3, 3), max_size=2),
)
