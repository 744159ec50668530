"""shardfit's Lightning callback in a real Lightning Trainer on 2 CPU ranks: DDP and
ModelParallelStrategy (FSDP2); an OOM said in Lightning's terms. (Lightning refuses FSDPStrategy
and DeepSpeedStrategy on its CPU accelerator; see lightning_script.py.)"""
from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from launch import oom_exit_codes, test_env as rank_env, torchrun

SCRIPT = str(Path(__file__).with_name("lightning_script.py"))
PARAM_BYTES = 225_856 * 4


def _run(tmp_path, strategy, **env):
    out = tmp_path / strategy
    result = torchrun([SCRIPT, str(out), strategy], timeout=120, env=rank_env(**env), check=not env)
    return out, result


@pytest.mark.multirank
@pytest.mark.parametrize("strategy, shard", [("ddp", 1), ("fsdp2", 2)])
def test_the_lightning_callback_reports_the_strategys_memory(tmp_path, strategy, shard):
    out, result = _run(tmp_path, strategy)
    assert result.stdout.count("measured (worst rank) vs predicted") == 1
    report = json.loads((out / "shardfit-memory.json").read_text())
    assert report["framework"] == "lightning" and report["strategy"] == strategy and report["world_size"] == 2
    assert report["plan"]["training"]["micro_batch"] == 4 and report["plan"]["training"]["seq_len"] == 64
    for rank in report["ranks"]:
        phases = rank["phases"]
        assert abs(phases["forward"]["params"] - PARAM_BYTES / shard) < 0.01 * PARAM_BYTES
        assert abs(phases["optimizer"]["optimizer"] - 2 * PARAM_BYTES / shard) < 0.01 * PARAM_BYTES
        # Lightning zeroes gradients after training_step: the last step's are live in the forward.
        assert abs(phases["forward"]["grads"] - PARAM_BYTES / shard) < 0.01 * PARAM_BYTES
    assert abs(report["comparison"]["peak"]["error"]) < 0.05, report["comparison"]["peak"]
    assert any("Lightning zeroes gradients" in line for line in report["assumed"])
    losses = json.loads((out / "losses.json").read_text())["losses"]
    assert len(losses) >= 4 and all(math.isfinite(x) for x in losses)


@pytest.mark.multirank
def test_an_oom_under_lightning_is_said_in_lightnings_terms(tmp_path):
    out, result = _run(tmp_path, "ddp", SHARDFIT_MEMORY_BUDGET="8MiB")
    assert result.returncode != 0 and result.stderr.count("OUT OF MEMORY") == 1, result.stderr
    codes = oom_exit_codes(result.stderr)
    assert len(codes) == 2 and 3 in codes and set(codes) <= {3, -15}, result.stderr
    assert "smallest fix in the Lightning Trainer:" in result.stderr
    fixes = json.loads((out / "shardfit-oom.json").read_text())["fixes_in_terms"]
    assert {"DataLoader.batch_size": 2, "accumulate_grad_batches": 2} in [f["arguments"] for f in fixes]
