"""`shardfit train`'s torchrun (supervise.relaunch) gets its environment from runtime_env.launch_env,
the one place that decides it (the DeepSpeed op cache keyed by the Python environment, one OpenMP
thread per rank), like train/launch.py, profile and bench. No torchrun is started here."""
from types import SimpleNamespace

import pytest

import shardfit.train.supervise as supervise
from shardfit.runtime_env import extensions_dir, launch_env


class FakeProcess:
    stderr = iter(())

    def wait(self):
        return 0


@pytest.mark.parametrize("debug", ["", "1"])
def test_relaunch_uses_the_launch_env(monkeypatch, debug):
    monkeypatch.delenv("TORCH_EXTENSIONS_DIR", raising=False)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setenv("SHARDFIT_DEBUG", debug)
    seen = {}

    def popen(command, env, **kwargs):
        seen.update(command=command, env=env)
        return FakeProcess()

    def call(command, env, **kwargs):
        seen.update(command=command, env=env)
        return 0

    monkeypatch.setattr(supervise.subprocess, "Popen", popen)
    monkeypatch.setattr(supervise.subprocess, "call", call)
    args = SimpleNamespace(nproc=2, nnodes=1, node_rank=0, rdzv_endpoint=None)
    assert supervise.relaunch(["train", "--out", "x"], args, restarts=0) == 0
    # plus, when its stderr is filtered, the mark that it prints the OOM diagnosis once for the workers
    assert seen["env"] == (launch_env() if debug else {**launch_env(), supervise.SUPERVISED_ENV: "1"})
    assert seen["env"]["TORCH_EXTENSIONS_DIR"] == extensions_dir() and seen["env"]["OMP_NUM_THREADS"] == "1"
    assert "--max-restarts=0" in seen["command"]
