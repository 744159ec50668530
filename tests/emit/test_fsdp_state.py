"""The emitted FSDP2 / FSDP1 (and DDP) scripts' weights and state, run for real on 2 gloo ranks: meta-device build
with the model's own init, pretrained safetensors read shard by shard, sharded checkpoints that survive
a kill, and an export that from_pretrained loads."""
import os
import re
import signal
import subprocess
import time

import pytest

from launch import test_env as launch_env, torchrun
from shardfit.emit import EmitOptions, emit
from shardfit.emit.common import PRESETS
from shardfit.launcher import torchrun_command
from shardfit.spec.models import load_model_spec
from shardfit.spec.plan import Cluster, Plan, Schedule, Training, parse_strategy

pytestmark = [pytest.mark.multirank, pytest.mark.slow]
TINY = load_model_spec("tiny-llama")
LOSS = re.compile(r"step (\d+) loss ([0-9.]+)")


def _script(tmp_path, fmt, weights=None, steps=6):
    plan = Plan(model=TINY, strategy=parse_strategy(fmt),
                training=Training(micro_batch=2, grad_accum=2, seq_len=32, precision="fp32",
                                  activation_checkpointing="every-2"),
                cluster=Cluster(nodes=1, gpus_per_node=2, gpu="custom:1"),
                schedule=Schedule(steps=steps, log_every=1, save_every=2, lr=1e-2))
    out = emit(plan, fmt, EmitOptions(weights=weights))
    name, text = next(iter(out.files.items()))
    path = tmp_path / name
    path.write_text(text)
    return path, text


def _env(tmp_path, **extra):
    return launch_env(CKPT_DIR=str(tmp_path / "ckpt"), EXPORT_DIR=str(tmp_path / "export"), **extra)


def _losses(stdout):
    return {int(step): float(loss) for step, loss in LOSS.findall(stdout)}


def _tiny_checkpoint(path):
    """A pretrained model as save_pretrained writes it: safetensors + config.json."""
    import json

    import torch
    from transformers import AutoConfig, AutoModelForCausalLM
    config = json.loads((PRESETS / "tiny-llama.json").read_text())
    torch.manual_seed(7)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(config.pop("model_type"), **config))
    model.save_pretrained(path)
    return model


# What each script must say it does: built on the meta device, materialised per rank, gradients synced
# on the last micro-batch only.
_MARKERS = {"fsdp2": ("model.to_empty(", "set_requires_gradient_sync"),
            "fsdp": ("module.to_empty(", "param_init_fn=materialise", "model.no_sync()"),
            "ddp": ("model.to_empty(", "model.no_sync()")}


@pytest.mark.parametrize("fmt", ["fsdp2", "fsdp", "ddp"])
def test_script_resumes_after_a_kill_and_exports_for_from_pretrained(tmp_path, fmt):
    import torch
    from transformers import AutoModelForCausalLM

    script, text = _script(tmp_path, fmt)
    assert 'with torch.device("meta")' in text and all(marker in text for marker in _MARKERS[fmt])
    assert "if False" not in text and "CPUOffloadPolicy" not in text  # no offload planned: none written
    # Kill the whole job once the step-2 checkpoint is in; STEPS=100: far from its end.
    process = subprocess.Popen(torchrun_command([str(script)], 2), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               text=True, env=_env(tmp_path, STEPS="100"), cwd=tmp_path, start_new_session=True)
    seen, deadline = "", time.monotonic() + 240
    try:
        for line in iter(process.stdout.readline, ""):
            seen += line
            if line.startswith("saved") and "step-2" in line or time.monotonic() > deadline:
                break
    finally:
        # torchrun's ranks run in sessions of their own: SIGTERM to torchrun is what reaches them (the
        # script has no handler, so they die where they are, as under a scheduler's kill).
        os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
    assert "saved" in seen, seen[-3000:]
    first = _losses(seen)
    complete = [int(d.name[5:]) for d in (tmp_path / "ckpt").iterdir()
                if d.name[5:].isdigit() and (d / ".metadata").exists()]
    saved = max(complete)
    assert saved >= 2 and saved < 6
    # A half-written save (a kill mid-save) is never taken for the newest checkpoint.
    (tmp_path / "ckpt" / "step-8.tmp").mkdir(exist_ok=True)
    done = torchrun([str(script)], nproc=2, timeout=240, env=_env(tmp_path), cwd=tmp_path)
    assert f"step-{saved} at step {saved}" in done.stdout, done.stdout[-2000:]
    second = _losses(done.stdout)
    assert sorted(second) == list(range(saved, 6)) and all(s in first for s in range(saved))
    losses = [first[s] for s in range(saved)] + [second[s] for s in range(saved, 6)]
    assert all(0 < loss < 20 for loss in losses) and losses[-1] < losses[0] - 1.0, losses  # learning, not noise
    assert (tmp_path / "ckpt" / "step-6" / ".metadata").exists()
    model, info = AutoModelForCausalLM.from_pretrained(tmp_path / "export", output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    assert all(torch.isfinite(p).all() for p in model.parameters())
    assert not (tmp_path / "export" / "sharded").exists()


@pytest.mark.parametrize("fmt", ["fsdp2", "fsdp", "ddp"])
def test_script_loads_pretrained_weights_shard_by_shard(tmp_path, fmt):
    import torch
    from safetensors.torch import load_file

    written = _tiny_checkpoint(tmp_path / "pretrained")
    script, text = _script(tmp_path, fmt, weights=str(tmp_path / "pretrained"))
    assert "HuggingFaceStorageReader" in text and "from_pretrained" not in text.split("def main")[1]
    # STEPS=0: load, then export untouched: the export must be the checkpoint, tensor for tensor.
    torchrun([str(script)], nproc=2, timeout=240, env=_env(tmp_path, STEPS="0", SAVE_EVERY="0"), cwd=tmp_path)
    exported = {}
    for name in (tmp_path / "export").glob("*.safetensors"):
        exported.update(load_file(name))
    expected = written.state_dict()
    assert set(exported) == set(expected)
    for key, value in expected.items():
        assert torch.equal(exported[key], value), key
