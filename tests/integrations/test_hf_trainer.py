"""ShardfitCallback in a real Hugging Face Trainer on 2 CPU ranks (torchrun, gloo, tiny-llama)."""
from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from launch import oom_exit_codes, test_env as rank_env, torchrun

from shardfit.estimate.result import CATEGORIES

SCRIPT = str(Path(__file__).with_name("hf_trainer_script.py"))
BUDGET = 8 * 2**20
# tiny-llama's parameters in fp32 (the shipped config; tests/spec pins the count).
PARAM_BYTES = 225_856 * 4


def _report(out: Path) -> dict:
    return json.loads((out / "shardfit-memory.json").read_text())


@pytest.mark.multirank
def test_the_callbacks_report_agrees_with_the_tracker_on_every_rank(tmp_path):
    out = tmp_path / "callback"
    result = torchrun([SCRIPT, str(out), "{}"], timeout=120)
    assert result.stdout.count("measured (worst rank) vs predicted") == 1, result.stdout  # rank 0 alone prints
    report = _report(out)
    assert report["world_size"] == 2 and len(report["ranks"]) == 2 and report["strategy"] == "ddp"
    t = report["plan"]["training"]
    assert (t["micro_batch"], t["grad_accum"], t["seq_len"], t["precision"]) == (4, 1, 64, "fp32")
    # What the tracker must see whatever it is wrapped in: DDP keeps full fp32 parameters, their
    # gradients at the step and AdamW's two moments on every rank.
    for rank in report["ranks"]:
        phases = rank["phases"]
        assert abs(phases["forward"]["params"] - PARAM_BYTES) < 0.01 * PARAM_BYTES
        assert abs(phases["optimizer"]["grads"] - PARAM_BYTES) < 0.01 * PARAM_BYTES
        assert abs(phases["optimizer"]["optimizer"] - 2 * PARAM_BYTES) < 0.01 * PARAM_BYTES
    assert abs(report["comparison"]["peak"]["error"]) < 0.05, report["comparison"]["peak"]
    # The same script without the callback, measured by `shardfit profile --script`'s runner.
    plain = tmp_path / "plain"
    plain.mkdir()
    torchrun(["-m", "shardfit.measure.script_runner", str(plain), SCRIPT, str(tmp_path / "plain-run"), "{}"],
             timeout=120, env=rank_env(SHARDFIT_TEST_CALLBACK="0"))
    for rank in (0, 1):
        tracker = json.loads((plain / f"rank{rank}.json").read_text())["phases"]
        callback = report["ranks"][rank]["phases"]
        for phase in ("forward", "backward", "optimizer"):
            for category in ("params", "grads", "optimizer", "activations"):
                assert abs(callback[phase][category] - tracker[phase][category]) <= 0.02 * max(tracker[phase][category], 2**16), \
                    (rank, phase, category, callback[phase], tracker[phase])
    losses = json.loads((out / "losses.json").read_text())["losses"]
    assert len(losses) == 4 and all(math.isfinite(x) for x in losses)


@pytest.mark.multirank
def test_an_oom_in_a_trainer_is_diagnosed_and_the_named_fix_runs_to_the_end(tmp_path):
    out = tmp_path / "oom"
    result = torchrun([SCRIPT, str(out), "{}"], timeout=120, check=False, env=rank_env(SHARDFIT_MEMORY_BUDGET="8MiB"))
    assert result.returncode != 0
    err = result.stderr
    assert err.count("OUT OF MEMORY") == 1, err
    assert "grew most in forward: activations" in err and "smallest fix in TrainingArguments: activation_checkpointing=True" in err, err
    assert "BudgetExceeded" not in err, err  # the diagnosis instead of a traceback
    assert sorted(p.name for p in (out / "shardfit-oom").glob("rank-*.json")) == ["rank-0.json", "rank-1.json"]
    codes = oom_exit_codes(err)  # every rank ended (none hung, none went on): the OOM code or the launcher's stop
    assert len(codes) == 2 and 3 in codes and set(codes) <= {3, -15}, err
    diagnosis = json.loads((out / "shardfit-oom.json").read_text())
    assert diagnosis["limit_bytes"] == BUDGET and diagnosis["phase"] == "forward"
    fixes = diagnosis["fixes_in_terms"]
    assert fixes and all(f["fits"] and f["peak_bytes"] <= BUDGET for f in fixes), fixes
    assert any(f["arguments"] == {"per_device_train_batch_size": 2, "gradient_accumulation_steps": 2} for f in fixes)
    # Apply the first fix exactly as written, tracked (so under the budget) for the whole run.
    fixed = tmp_path / "fixed"
    torchrun([SCRIPT, str(fixed), json.dumps(fixes[0]["arguments"]), "4"], timeout=120,
             env=rank_env(SHARDFIT_MEMORY_BUDGET="8MiB"))
    report = _report(fixed)
    assert report["steps_measured"] == 4 and report["limit_bytes"] == BUDGET
    assert 0 < report["measured_peak_bytes"] <= BUDGET and report["headroom_bytes"] > 0
    assert len(json.loads((fixed / "losses.json").read_text())["losses"]) == 4


def test_off_the_callback_installs_nothing(tmp_path, monkeypatch):
    import sys

    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack
    from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments

    from shardfit.integrations.transformers import ShardfitCallback

    monkeypatch.setenv("SHARDFIT_PROFILE", "0")
    sys.path.insert(0, str(Path(SCRIPT).parent))
    from hf_trainer_script import PRESET, Tokens

    model = LlamaForCausalLM(LlamaConfig(**json.loads(PRESET.read_text())))
    seen = {}

    class Probe(ShardfitCallback):
        def on_step_end(self, args, state, control, **kwargs):
            seen["modes"] = len(_get_current_dispatch_mode_stack())
            seen["hooks"] = len(model._forward_pre_hooks)
            seen["excepthook"] = sys.excepthook is sys.__excepthook__ or sys.excepthook.__module__ != "shardfit.integrations.session"
            return super().on_step_end(args, state, control, **kwargs)

    args = TrainingArguments(output_dir=str(tmp_path), max_steps=1, per_device_train_batch_size=2, use_cpu=True,
                             report_to="none", save_strategy="no", disable_tqdm=True, optim="adamw_torch")
    callback = Probe(steps=1)
    Trainer(model=model, args=args, train_dataset=Tokens(8), callbacks=[callback]).train()
    assert seen == {"modes": 0, "hooks": 0, "excepthook": True}
    assert callback.result is None and not (tmp_path / "shardfit-memory.json").exists()
