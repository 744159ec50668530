"""`shardfit train`'s torchrun (supervise.relaunch) gets its environment from runtime_env.launch_env,
the one place that decides it (the DeepSpeed op cache keyed by the Python environment, one OpenMP
thread per rank), and starts through the one launcher, like profile and bench. No torchrun is
started here: the launcher is replaced by a recorder."""
import pytest

import shardfit.train.supervise as supervise
from shardfit.launcher import Launched
from shardfit.runtime_env import extensions_dir, launch_env
from shardfit.train.flags import TrainFlags


class FakeProcess:
    stderr = iter(())

    def wait(self):
        return 0

    def send_signal(self, signum):
        pass


@pytest.mark.parametrize("debug", ["", "1"])
def test_relaunch_uses_the_launch_env(monkeypatch, debug):
    monkeypatch.delenv("TORCH_EXTENSIONS_DIR", raising=False)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setenv("SHARDFIT_DEBUG", debug)
    seen = {}

    def torchrun(target, nproc, *, env, options, timeout, watch=None, **where):
        seen.update(command=[*options, *target], env=env, timeout=timeout)
        if watch is not None:
            watch(FakeProcess())
        return Launched(returncode=0, seconds=0.0, command=tuple(target))

    monkeypatch.setattr(supervise, "torchrun", torchrun)
    flags = TrainFlags(nproc=2, nnodes=1, node_rank=0, rdzv_endpoint=None)
    assert supervise.relaunch(["train", "--out", "x"], flags, restarts=0) == 0
    assert seen["timeout"] is None  # a training run is not cut short by the launcher
    # plus, when its stderr is filtered, the mark that it prints the OOM diagnosis once for the workers
    assert seen["env"] == (launch_env() if debug else {**launch_env(), supervise.SUPERVISED_ENV: "1"})
    assert seen["env"]["TORCH_EXTENSIONS_DIR"] == extensions_dir() and seen["env"]["OMP_NUM_THREADS"] == "1"
    assert "--max-restarts=0" in seen["command"]


@pytest.mark.parametrize("local_key", ["LOCAL_WORLD_SIZE", "LOCAL_SIZE"])
def test_the_cluster_is_the_launch_under_torchrun_and_the_deepspeed_launcher(monkeypatch, local_key):
    """torchrun names the ranks per node LOCAL_WORLD_SIZE, DeepSpeed's launcher (`emit --format
    deepspeed-launcher`) LOCAL_SIZE: either way 16 ranks, 8 per node, are 2 nodes x 8."""
    from shardfit.train.launch import build_plan

    for key in ("LOCAL_WORLD_SIZE", "LOCAL_SIZE"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("WORLD_SIZE", "16")
    monkeypatch.setenv(local_key, "8")
    cluster = build_plan(TrainFlags(strategy="zero2")).cluster
    assert (cluster.nodes, cluster.gpus_per_node) == (2, 8)
