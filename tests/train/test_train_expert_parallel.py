"""`shardfit train` with expert parallelism (engines/expert_parallel.py: transformers' own EP under
FSDP2): a tiny Qwen3-MoE with ep = 2 on 2 CPU ranks trains the same steps as ep = 1 (losses, gradient
norms, held-out loss), its DCP checkpoint resumes at ep = 1, and its export is the ep = 1 run's model."""
from __future__ import annotations

import json

import pytest
from launch import run_records, shardfit
from launch import test_env as launch_env
from shardfit.spec.tiny import tiny_config

pytest.importorskip("torch")
pytestmark = [pytest.mark.multirank, pytest.mark.slow]

COMMON = ("--nproc", "2", "--steps", "4", "--seq", "64", "--micro-batch", "2", "--grad-accum", "2",
          "--save-every", "2", "--eval-every", "4", "--no-progress")


def _plan(tmp_path, ep: int):
    model = tmp_path / "qwen3moe"
    model.mkdir(exist_ok=True)
    (model / "config.json").write_text(json.dumps(tiny_config("qwen3_moe")))
    path = tmp_path / f"ep{ep}.yaml"
    path.write_text(f"model: {model}\nstrategy: {{kind: fsdp2}}\ncluster: {{nodes: 1, gpus_per_node: 2}}\n"
                    "training: {precision: fp32, activation_checkpointing: none}\nschedule: {warmup_steps: 0}\n"
                    f"parallelism: {{ep: {ep}}}\n")
    return str(path)


def test_expert_parallel_trains_like_ep_1_and_resumes_there(tmp_path):
    import torch
    from safetensors.torch import load_file

    env = launch_env(SHARDFIT_CACHE_DIR=str(tmp_path / "cache"))
    sharded, plain, resumed = tmp_path / "ep2", tmp_path / "ep1", tmp_path / "resumed"
    shardfit("train", _plan(tmp_path, 2), *COMMON, "--out", str(sharded), "--export", str(sharded / "export"),
             timeout=300, env=env)
    shardfit("train", _plan(tmp_path, 1), *COMMON, "--out", str(plain), "--export", str(plain / "export"),
             timeout=300, env=env)
    got, want = run_records(sharded), run_records(plain)
    assert [r["step"] for r in got] == [1, 2, 3, 4]
    for a, b in zip(got, want):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5) and a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-5)
    assert got[-1]["val_loss"] == pytest.approx(want[-1]["val_loss"], rel=1e-5)

    again = shardfit("train", _plan(tmp_path, 1), *COMMON, "--out", str(resumed), "--resume",
                     str(sharded / "checkpoints" / "step-2"), timeout=300, env=env)
    assert "resumed from" in again.stdout and "at step 2" in again.stdout
    after = {r["step"]: r["loss"] for r in run_records(resumed)}
    assert sorted(after) == [3, 4] and all(after[s] == pytest.approx(got[s - 1]["loss"], rel=1e-5) for s in after)

    a = load_file(str(next((sharded / "export").glob("*.safetensors"))))
    b = load_file(str(next((plain / "export").glob("*.safetensors"))))
    assert a.keys() == b.keys()
    for name, tensor in b.items():
        torch.testing.assert_close(a[name], tensor, rtol=1e-4, atol=1e-6, msg=name)
