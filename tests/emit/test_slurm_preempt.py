"""The SLURM script emit writes survives a preemption: --signal and --requeue, torchrun passing the
stop signal on, and (run for real, with stand-ins for srun and scontrol) a USR1 to the batch shell
that ends in a stop checkpoint, a marker and a requeue."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from shardfit.emit import emit
from shardfit.spec.models import load_model_spec
from shardfit.spec.plan import plan_from_dict


def _plan(kind: str, nodes: int, gpus: int):
    return plan_from_dict({"model": "llama-3.1-8b", "strategy": {"kind": kind},
                           "cluster": {"nodes": nodes, "gpus_per_node": gpus}}, resolve_model=load_model_spec)


def test_slurm_script_signals_requeues_and_resumes(tmp_path):
    text = emit(_plan("fsdp2", 4, 8), "slurm").main
    assert "#SBATCH --signal=B:USR1@180" in text and "#SBATCH --requeue" in text
    assert "--signals-to-handle SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1 -m shardfit train plan.yaml --resume auto &" in text
    assert "trap 'stopping=1; kill -USR1 \"$job\" 2>/dev/null' USR1" in text
    assert 'scontrol requeue "$SLURM_JOB_ID"' in text
    path = tmp_path / "train.sbatch"
    path.write_text(text)
    subprocess.run(["bash", "-n", str(path)], check=True)
    # A user's own entry point gets the signal lines but no shardfit flag.
    from shardfit.emit.common import EmitOptions
    own = emit(_plan("fsdp2", 1, 8), "slurm", EmitOptions(entry="train.py --lr 1e-4")).main
    assert "--signals-to-handle SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1 train.py --lr 1e-4 &" in own


PLAN = """model: tiny-llama
strategy: {kind: single}
training: {micro_batch: 2, seq_len: 64, precision: fp32}
schedule: {steps: 400, log_every: 1, eval_every: 0, save_every: 0, lr: 0.003, warmup_steps: 2}
cluster: {nodes: 1, gpus_per_node: 1}
"""


@pytest.mark.multirank
@pytest.mark.slow
def test_usr1_to_the_batch_shell_stops_saves_and_requeues(tmp_path):
    (tmp_path / "plan.yaml").write_text(PLAN)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "srun").write_text('#!/bin/sh\nexec "$@"\n')  # one task, here: the command itself
    (bin_dir / "scontrol").write_text(f'#!/bin/sh\necho "$@" >> {tmp_path / "scontrol.log"}\n')
    for tool in ("srun", "scontrol"):
        (bin_dir / tool).chmod(0o755)
    from launch import test_env
    env = test_env(SLURM_JOB_ID="4242")
    env["PATH"] = os.pathsep.join([str(bin_dir), str(Path(sys.executable).parent), env.get("PATH", "")])
    subprocess.run([sys.executable, "-m", "shardfit", "emit", "plan.yaml", "--format", "slurm", "-o", "job/"],
                   check=True, cwd=tmp_path, env=env, capture_output=True)
    script = tmp_path / "job" / "train.sbatch"
    # A session of its own, as a batch shell has: no signal meant for the test runner's group reaches it.
    job = subprocess.Popen(["bash", str(script)], cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT, text=True, start_new_session=True)
    seen, deadline = [], time.monotonic() + 240
    try:
        for line in job.stdout:
            seen.append(line)
            if line.startswith("step 2/400"):
                job.send_signal(signal.SIGUSR1)  # what SLURM sends 180 s before the time limit
                break
            assert time.monotonic() < deadline, "".join(seen[-30:])
        rest, _ = job.communicate(timeout=180)
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
    log = "".join(seen) + rest
    assert job.returncode == 0, log[-3000:]  # requeued: the script itself ends cleanly
    assert (tmp_path / "scontrol.log").read_text().split() == ["requeue", "4242"]
    marker = json.loads((tmp_path / "shardfit-run" / "stopped.json").read_text())
    assert marker["signal"] == "SIGUSR1" and 2 <= marker["step"] < 400, (marker, log[-3000:])
    assert Path(marker["checkpoint"]).name == f"step-{marker['step']}"
    assert "training preempted (SIGUSR1)" in log and "Traceback" not in log, log[-3000:]
