"""The README's first command, scripts/quickstart.sh: its analytic steps (plan, fit, emit) run as the
script writes them, so a change in what fit picks cannot leave the emit step behind (it once did: fit
moved to FSDP and the script's `--format deepspeed` refused the plan). Its train step is the default
run that tests/train covers."""
from __future__ import annotations

import shlex
import sys

from launch import REPO, run


def test_quickstart_plan_fit_emit_run_as_written(tmp_path):
    lines = [line for line in (REPO / "scripts" / "quickstart.sh").read_text().splitlines()
             if line.startswith("$sf ") and not line.startswith("$sf train")]
    assert [shlex.split(line)[1] for line in lines] == ["plan", "fit", "emit"]
    for line in lines:
        args = [arg.replace("$out", str(tmp_path)) for arg in shlex.split(line)[1:]]
        result = run([sys.executable, "-m", "shardfit", *args], timeout=120, check=False)
        assert result.returncode == 0, (line, result.stderr[-2000:])
    assert (tmp_path / "ds_config.json").is_file()
