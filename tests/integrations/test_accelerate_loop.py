"""`shardfit.integrations.accelerate.track` in a real custom Accelerate loop on 2 CPU ranks."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from launch import oom_exit_codes, test_env as rank_env, torchrun

SCRIPT = str(Path(__file__).with_name("accelerate_script.py"))
PARAM_BYTES = 225_856 * 4
BUDGET = 8 * 2**20


@pytest.mark.multirank
def test_track_reports_what_the_tracker_measures_in_an_accelerate_loop(tmp_path):
    out = tmp_path / "tracked"
    result = torchrun([SCRIPT, str(out), json.dumps({"micro_batch": 2, "grad_accum": 2})], timeout=120)
    assert result.stdout.count("measured (worst rank) vs predicted") == 1
    report = json.loads((out / "shardfit-memory.json").read_text())
    t = report["plan"]["training"]
    assert report["framework"] == "accelerate" and report["strategy"] == "ddp" and report["world_size"] == 2
    assert (t["micro_batch"], t["grad_accum"], t["seq_len"]) == (2, 2, 64)  # from the Accelerator and the batch
    for rank in report["ranks"]:
        assert abs(rank["phases"]["optimizer"]["optimizer"] - 2 * PARAM_BYTES) < 0.01 * PARAM_BYTES
        assert abs(rank["phases"]["forward"]["params"] - PARAM_BYTES) < 0.01 * PARAM_BYTES
    assert abs(report["comparison"]["peak"]["error"]) < 0.05, report["comparison"]["peak"]
    plain = tmp_path / "plain"
    plain.mkdir()
    torchrun(["-m", "shardfit.measure.script_runner", str(plain), SCRIPT, str(tmp_path / "plain-run"),
              json.dumps({"micro_batch": 2, "grad_accum": 2, "track": False})], timeout=120)
    for rank in (0, 1):
        tracker = json.loads((plain / f"rank{rank}.json").read_text())["phases"]
        mine = report["ranks"][rank]["phases"]
        for phase in ("forward", "backward", "optimizer"):
            # Temporaries differ by the data set itself: `profile --script` starts before the script
            # builds its token tensor (a 128 KiB temporary there); track() starts after prepare().
            for category in ("params", "grads", "optimizer", "activations"):
                assert abs(mine[phase][category] - tracker[phase][category]) <= 0.02 * max(tracker[phase][category], 2**16), \
                    (rank, phase, category, str(mine[phase]), str(tracker[phase]))


@pytest.mark.multirank
def test_an_oom_in_an_accelerate_loop_names_a_fix_that_runs(tmp_path):
    out = tmp_path / "oom"
    result = torchrun([SCRIPT, str(out), "{}"], timeout=120, check=False, env=rank_env(SHARDFIT_MEMORY_BUDGET="8MiB"))
    assert result.returncode != 0 and result.stderr.count("OUT OF MEMORY") == 1, result.stderr
    assert "smallest fix in your Accelerate loop:" in result.stderr
    codes = oom_exit_codes(result.stderr)
    assert len(codes) == 2 and 3 in codes and set(codes) <= {3, -15}, result.stderr
    fixes = json.loads((out / "shardfit-oom.json").read_text())["fixes_in_terms"]
    batch = next(f for f in fixes if "DataLoader.batch_size" in f["arguments"])
    assert batch["fits"] and batch["arguments"] == {"DataLoader.batch_size": 2, "Accelerator.gradient_accumulation_steps": 2}
    fixed = tmp_path / "fixed"
    options = {"micro_batch": 2, "grad_accum": 2}  # the fix as written, the global batch kept
    torchrun([SCRIPT, str(fixed), json.dumps(options), "4"], timeout=120, env=rank_env(SHARDFIT_MEMORY_BUDGET="8MiB"))
    report = json.loads((fixed / "shardfit-memory.json").read_text())
    assert report["measured_peak_bytes"] <= BUDGET and report["steps_measured"] == 4
    assert len(json.loads((fixed / "losses.json").read_text())["losses"]) == 4


def test_off_track_installs_nothing(monkeypatch):
    import torch
    from accelerate import Accelerator

    from shardfit.integrations.accelerate import track

    monkeypatch.setenv("SHARDFIT_PROFILE", "0")
    model = torch.nn.Linear(4, 4)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    accelerator = Accelerator(cpu=True)
    model, optimizer = accelerator.prepare(model, optimizer)
    session = track(accelerator, model, optimizer)
    assert not session.enabled and session.profiler is None and session.tracked is None
    assert not model._forward_pre_hooks and not optimizer.optimizer._optimizer_step_post_hooks
