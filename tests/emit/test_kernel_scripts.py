"""Emitted scripts carry the plan's kernels and run them: the single-device and FSDP2 scripts with the
chunked cross-entropy and the fused AdamW step train the same model as with the model's own loss and the
default step (fp32: the same losses to rounding), on CPU (FSDP2: 2 gloo ranks)."""
import re
import subprocess
import sys

import pytest

from launch import test_env as launch_env, torchrun
from shardfit.emit import emit
from shardfit.spec.models import load_model_spec
from shardfit.spec.plan import Cluster, Plan, Schedule, Training, parse_strategy

pytestmark = pytest.mark.multirank
TINY = load_model_spec("tiny-llama")


def _plan(kind, gpus, **training):
    return Plan(model=TINY, strategy=parse_strategy(kind),
                training=Training(micro_batch=2, grad_accum=2, seq_len=32, precision="fp32", **training),
                cluster=Cluster(nodes=1, gpus_per_node=gpus, gpu="custom:1"), schedule=Schedule(steps=3, log_every=1))


def _losses(tmp_path, plan, fmt, nproc):
    name, text = next(iter(emit(plan, fmt).files.items()))
    script = tmp_path / f"{plan.training.loss}-{name}"
    script.write_text(text)
    if nproc == 1:
        result = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=240,
                                env=launch_env(STEPS="3"), check=True)
    else:
        # Checkpoints off: the second run must not resume from the first's (the same folder).
        result = torchrun([str(script)], nproc=nproc, timeout=240, env=launch_env(STEPS="3", SAVE_EVERY="0", EXPORT_DIR=""),
                          cwd=tmp_path)
    return text, [float(x) for x in re.findall(r"step \d+ loss ([0-9.]+)", result.stdout)]


@pytest.mark.parametrize("kind,fmt,nproc", [("single", "single", 1), ("fsdp2", "fsdp2", 2)])
def test_chunked_loss_and_fused_step_scripts_train_like_the_standard_ones(tmp_path, kind, fmt, nproc):
    _, standard = _losses(tmp_path, _plan(kind, nproc), fmt, nproc)
    text, chunked = _losses(tmp_path, _plan(kind, nproc, loss="chunked", loss_chunks=3, optimizer_impl="fused"),
                            fmt, nproc)
    assert "fused=True" in text and "patch_head(head, 3)" in text
    assert len(chunked) == 3 and chunked == pytest.approx(standard, rel=1e-4), (standard, chunked)
