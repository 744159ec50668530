"""The tracker in one process, no engine: exact category bytes, phases, budget OOM, tracking off."""
from __future__ import annotations

import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")

import shardfit  # noqa: E402
from shardfit.errors import ShardfitError  # noqa: E402
from shardfit.modeling import build_model  # noqa: E402

SEQ, BATCH = 32, 2


def _model(ac: bool = False):
    model = build_model("tiny-llama", device="cpu", seed=0)
    if ac:
        if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5 (the old name warns)
            model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model


def _steps(model, optimizer, steps=2, seq=SEQ):
    for step in range(steps):
        ids = torch.randint(0, model.config.vocab_size, (BATCH, seq), generator=torch.Generator().manual_seed(step))
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)


def _sizes(model):
    n = sum(p.numel() for p in model.parameters())
    buffers = sum(b.numel() * b.element_size() for b in model.buffers())
    return n, buffers


def test_categories_are_exact_for_adamw_fp32():
    model = _model()
    optimizer = torch.optim.AdamW(model.parameters(), foreach=False)
    with shardfit.profile(model, optimizer) as prof:
        _steps(model, optimizer)
    report = prof.report()
    n, buffers = _sizes(model)
    n_tensors = len(list(model.parameters()))
    assert list(report.phases) == ["load", "forward", "backward", "optimizer"]
    for phase in ("load", "forward", "backward", "optimizer"):
        assert report.phases[phase]["params"] == 4 * n + buffers
    # AdamW: exp_avg + exp_avg_sq in fp32, plus one fp32 `step` scalar per parameter tensor.
    assert report.phases["forward"]["optimizer"] == 8 * n + 4 * n_tensors
    assert report.phases["optimizer"]["grads"] == 4 * n
    assert report.load_end["optimizer"] == 0 and report.phases["load"]["optimizer"] == 8 * n + 4 * n_tensors
    assert report.phases["load"]["activations"] == 0
    assert report.phases["forward"]["activations"] > 0
    assert len(report.steps) == 2 and report.peak_phase in ("forward", "backward", "optimizer")
    # the second step holds the optimizer states through forward: its forward peak is higher
    assert report.steps[1]["forward"] > report.steps[0]["forward"]


def test_activation_checkpointing_shrinks_forward_activations_and_recompute_counts_as_activations():
    results = {}
    for ac in (False, True):
        model = _model(ac)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        with shardfit.profile(model, optimizer) as prof:
            _steps(model, optimizer, seq=48)
        results[ac] = prof.report().phases
    assert results[True]["forward"]["activations"] < 0.6 * results[False]["forward"]["activations"]
    assert results[True]["backward"]["activations"] > results[True]["forward"]["activations"] * 0.5
    # parameters and states do not depend on checkpointing
    assert results[True]["forward"]["params"] == results[False]["forward"]["params"]


def test_manual_phases_and_discovery_mode():
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    with shardfit.profile() as prof:  # discovers the model at its forward, the optimizer at step
        _steps(model, optimizer)
        with prof.phase("checkpoint"):
            state = {k: v.clone() for k, v in model.state_dict().items()}
    report = prof.report()
    n, buffers = _sizes(model)
    assert report.phases["forward"]["optimizer"] == 4 * n  # SGD momentum buffers
    assert report.phases["checkpoint"]["temporaries"] >= 4 * n  # the cloned copy
    del state
    with pytest.raises(ShardfitError, match="unknown phase"):
        with shardfit.profile(model) as prof:
            prof.phase("warmup")


def test_budget_raises_torch_oom_in_forward_and_in_backward_and_is_diagnosed():
    model = _model()
    optimizer = torch.optim.AdamW(model.parameters(), foreach=False)
    with shardfit.profile(model, optimizer) as prof:
        _steps(model, optimizer, steps=2, seq=64)
    phases = prof.report().phases
    totals = {p: sum(v for k, v in phases[p].items() if k != "host") for p in phases}
    # halfway between load and the forward peak: dies in forward, of activations
    budget = (totals["load"] + totals["forward"]) // 2
    with pytest.raises(torch.OutOfMemoryError, match="budget"):
        with shardfit.profile(model, optimizer, budget_bytes=budget, explain_oom=False) as prof:
            _steps(model, optimizer, steps=1, seq=64)
    assert prof.oom["phase"] == "forward"
    from shardfit.measure.oom import diagnose, format_diagnosis

    diagnosis = diagnose(prof.report())
    assert diagnosis.phase == "forward" and diagnosis.growing == "activations"
    assert "activations" in diagnosis.cause and "sequence length" in diagnosis.cause
    assert "in forward" in format_diagnosis(diagnosis)
    # the error type survives the autograd engine: a budget between forward and backward peaks
    if totals["backward"] > totals["forward"]:
        budget = (totals["forward"] + totals["backward"]) // 2
        with pytest.raises(torch.OutOfMemoryError):
            with shardfit.profile(model, optimizer, budget_bytes=budget, explain_oom=False) as prof:
                _steps(model, optimizer, steps=1, seq=64)
        assert prof.oom["phase"] == "backward"


def test_oom_diagnosis_names_a_change_that_fits():
    pytest.importorskip("shardfit.estimate.estimator")
    from shardfit.measure.oom import diagnose
    from shardfit.spec.models import model_spec_for
    from shardfit.spec.plan import plan_from_dict

    plan = plan_from_dict({"model": "tiny-llama", "strategy": {"kind": "ddp"}, "cluster": {"gpus_per_node": 1},
                           "training": {"micro_batch": BATCH, "seq_len": 256, "precision": "fp32"}},
                          resolve_model=model_spec_for)
    model = _model()
    optimizer = torch.optim.AdamW(model.parameters(), foreach=False)
    with shardfit.profile(model, optimizer) as prof:
        _steps(model, optimizer, steps=1, seq=256)
    phases = prof.report().phases
    load = sum(v for k, v in phases["load"].items() if k != "host")
    budget = load + (phases["forward"]["activations"] * 3) // 4
    with pytest.raises(torch.OutOfMemoryError):
        with shardfit.profile(model, optimizer, plan=plan, budget_bytes=budget, explain_oom=False) as prof:
            _steps(model, optimizer, steps=1, seq=256)
    diagnosis = diagnose(prof.report(), plan)
    assert diagnosis.phase == "forward"
    assert any(fix.fits for fix in diagnosis.fixes), diagnosis
    assert any("checkpointing" in fix.change or "micro-batch" in fix.change for fix in diagnosis.fixes if fix.fits)


def test_tracking_off_installs_nothing_and_tracking_on_restores_everything():
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

    model = _model()
    resize = torch.UntypedStorage.resize_
    with shardfit.profile(model, enabled=False) as prof:
        assert not _get_current_dispatch_mode_stack()
        assert torch.UntypedStorage.resize_ is resize
        assert not model._forward_pre_hooks
        prof.phase("forward")
    assert prof.report() is None
    from torch.nn.modules import module as module_mod

    before = len(module_mod._global_forward_pre_hooks)
    with shardfit.profile(model):
        assert _get_current_dispatch_mode_stack()
        assert torch.UntypedStorage.resize_ is not resize
    assert not _get_current_dispatch_mode_stack()
    assert torch.UntypedStorage.resize_ is resize
    assert len(module_mod._global_forward_pre_hooks) == before


def test_budget_must_be_positive():
    with pytest.raises(ShardfitError, match="budget"):
        shardfit.profile(budget_bytes=0)


def test_reporting_modules_do_not_import_torch():
    code = ("import sys; import shardfit.measure.report, shardfit.measure.oom, shardfit.measure.compare; "
            "assert 'torch' not in sys.modules, 'torch imported'")
    subprocess.run([sys.executable, "-c", code], check=True)
