"""Per-op selective activation checkpointing (shardfit/sac.py): the estimate against a real forward
under the same policy, the engines' and the emitted scripts' SAC training for real, the presets'
shipped terms against a fresh trace, and fit's rung between none and full."""
import json
import re

import pytest

from shardfit.estimate import estimate
from shardfit.estimate.selective import selective_kept
from shardfit.fit import FitRequest, fit
from shardfit.spec.models import load_model_spec, model_spec_for
from shardfit.spec.plan import Cluster, Plan, Schedule, Training, is_selective_ac, parse_activation_checkpointing, parse_strategy

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from shardfit.engines.base import apply_activation_checkpointing  # noqa: E402
from shardfit.measure.traced import run_tracked_step  # noqa: E402
from shardfit.modeling import block_classes, build_model  # noqa: E402
from shardfit.spec.tiny import tiny_config  # noqa: E402


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    patch = pytest.MonkeyPatch()
    patch.setenv("SHARDFIT_CACHE_DIR", str(tmp_path_factory.mktemp("cache")))
    refs = {"tiny-llama": "tiny-llama", "tiny-mixtral": "tiny-mixtral", "tiny-gpt2": "tiny-gpt2"}
    for model_type in ("qwen3", "olmo2", "deepseek_v3", "qwen3_moe"):
        folder = tmp_path_factory.mktemp(model_type)
        (folder / "config.json").write_text(json.dumps(tiny_config(model_type)))
        refs[model_type] = str(folder)
    yield refs
    patch.undo()


def forward_activations(ref, ac, precision, b=2, s=64) -> int:
    """Bytes alive from forward to backward in a real CPU step (MemTracker's activations)."""
    torch.manual_seed(0)
    model = build_model(ref, dtype="bf16" if precision == "bf16-pure" else "fp32")
    spec = load_model_spec(ref)
    if ac != "none":
        apply_activation_checkpointing(model, tuple(block_classes(model, spec)), parse_activation_checkpointing(ac),
                                       selective=is_selective_ac(ac))
    ids = torch.randint(0, spec.vocab_size, (b, s))
    return run_tracked_step(model, ids, None)["after_forward"]["activations"]


def estimated(ref, ac, precision, b=2, s=64) -> int:
    plan = Plan(model=load_model_spec(ref), strategy=parse_strategy("ddp"), cluster=Cluster(gpus_per_node=1),
                training=Training(micro_batch=b, seq_len=s, precision=precision, activation_checkpointing=ac))
    est = estimate(plan, device="cpu", explain=True)
    return est.term("activations.blocks").bytes + est.term("activations.head").bytes


@pytest.mark.parametrize("precision", ["fp32", "bf16-pure"])
@pytest.mark.parametrize("name", ["tiny-llama", "tiny-mixtral", "tiny-gpt2", "qwen3", "olmo2", "deepseek_v3", "qwen3_moe"])
def test_selective_estimate_equals_a_real_forward(models, name, precision):
    measured = forward_activations(models[name], "selective", precision)
    assert estimated(models[name], "selective", precision) == pytest.approx(measured, rel=0.01)
    # ...and sits between no checkpointing and full checkpointing.
    assert forward_activations(models[name], "full", precision) <= measured < forward_activations(models[name], "none", precision)


def test_selective_keeps_matmul_and_attention_outputs_only():
    # tiny-llama: q, v, gate, down (every other of q k v o gate up down) + SDPA output and logsumexp.
    spec = model_spec_for("tiny-llama")
    q, kv, h, inter, heads = spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim, spec.hidden_size, \
        spec.intermediate_size, spec.num_heads
    assert selective_kept(spec, "fp32", "sdpa", None) == (4 * (q + kv + inter + h) + 4 * q + 4 * heads, 0)
    # GPT-2's Conv1D runs addmm (a matmul with its bias): the policy keeps every other one, c_attn and
    # c_fc; its CPU attention under dropout is the math path, whose matmuls are bmm: not kept.
    gpt2 = model_spec_for("tiny-gpt2")
    assert selective_kept(gpt2, "fp32", "sdpa", None) == (4 * (3 * gpt2.hidden_size + gpt2.intermediate_size), 0)


SHIPPED = ["tiny-llama", "tiny-qwen2", "tiny-mixtral", "tiny-gemma2", "tiny-gpt2", "tiny-bert", "llama-3.1-8b"]


@pytest.mark.parametrize("name", SHIPPED)
def test_shipped_preset_terms_equal_a_fresh_trace(name, tmp_path, monkeypatch):
    from shardfit.estimate.selective import _selective_kept, _shipped_selective

    monkeypatch.setenv("SHARDFIT_CACHE_DIR", str(tmp_path))
    shipped = _shipped_selective()[name]
    spec = model_spec_for(name)
    monkeypatch.setattr("shardfit.estimate.selective._shipped_selective", lambda: {})
    _selective_kept.cache_clear()
    try:
        for key, value in shipped.items():
            regime, attention = key.split("|")
            assert list(selective_kept(spec, regime, attention, None)) == pytest.approx(value), key
    finally:
        _selective_kept.cache_clear()


def test_preset_plan_with_selective_imports_no_torch(tmp_path):
    import subprocess
    import sys

    code = ("import sys; from shardfit.cli import main\n"
            "try: main(['plan', 'llama-3.1-8b', '--gpus', '8', '--ac', 'selective'])\nexcept SystemExit as e: assert not e.code\n"
            "assert 'torch' not in sys.modules")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                            env={**__import__("os").environ, "SHARDFIT_CACHE_DIR": str(tmp_path)})
    assert result.returncode == 0, result.stderr


def test_fit_takes_selective_between_none_and_full():
    # Llama-3.1-8B at 8k on 8 x H100: without checkpointing it does not fit; selective does and
    # recomputes less than per-layer or full checkpointing, so fit stops there.
    spec = model_spec_for("llama-3.1-8b")
    base = Plan(model=spec, strategy=parse_strategy("fsdp2"), training=Training(micro_batch=1, seq_len=8192),
                cluster=Cluster(gpus_per_node=8, gpu="H100-80GB"))
    peaks = {ac: estimate(base.with_changes(training={"activation_checkpointing": ac})).peak_bytes
             for ac in ("none", "selective", "every-2", "full")}
    assert peaks["full"] < peaks["every-2"] < peaks["none"] and peaks["full"] < peaks["selective"] < peaks["none"]
    # With the loss pinned: the chunked loss (the rung before checkpointing, +1% time) otherwise fits
    # without any checkpointing (tests/fit/test_fit_kernels.py).
    result = fit(FitRequest.build(model=spec, gpus_per_node=8, seq_len=8192, global_batch=8, loss="standard",
                                  layouts=False))  # data parallel: the checkpointing levers under test
    assert result.best.plan.training.activation_checkpointing == "selective"
    chunked = fit(FitRequest.build(model=spec, gpus_per_node=8, seq_len=8192, global_batch=8,
                                  layouts=False)).best.plan.training
    assert (chunked.activation_checkpointing, chunked.loss) == ("none", "chunked")


@pytest.mark.multirank
def test_emitted_fsdp2_script_trains_under_selective_checkpointing(tmp_path):
    from launch import test_env, torchrun
    from shardfit.emit import emit

    plan = Plan(model=model_spec_for("tiny-llama"), strategy=parse_strategy("fsdp2"),
                training=Training(micro_batch=2, grad_accum=2, seq_len=32, precision="fp32",
                                  activation_checkpointing="selective"),
                cluster=Cluster(gpus_per_node=2, gpu="custom:1"), schedule=Schedule(steps=3, log_every=1))
    text = emit(plan, "fsdp2").main
    assert "create_selective_checkpoint_contexts" in text and "checkpoint_wrapper_fn=selective_checkpoint_wrapper" in text
    compile(text, "train_fsdp2.py", "exec")
    script = tmp_path / "train_fsdp2.py"
    script.write_text(text)
    result = torchrun([str(script)], nproc=2, timeout=240, env=test_env(STEPS="3"), cwd=tmp_path)
    losses = [float(x) for x in re.findall(r"step \d+ loss ([0-9.]+)", result.stdout)]
    assert len(losses) == 3 and all(0 < loss < 20 for loss in losses)


def test_tools_without_a_per_op_setting_say_so():
    from shardfit.emit import emit

    plan = Plan(model=model_spec_for("tiny-llama"), strategy=parse_strategy("fsdp2"),
                training=Training(activation_checkpointing="selective"), cluster=Cluster(gpus_per_node=2))
    for fmt in ("accelerate", "hf-trainer"):
        assert any("no per-op selective checkpointing setting" in note for note in emit(plan, fmt).notes)
    assert not any("per-op" in note for note in emit(plan, "fsdp2").notes)


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-gpt2", "qwen3"])
def test_traced_block_ops_are_the_policy_calls_of_a_real_run(models, name, monkeypatch):
    # The step-time model charges SAC's per-op dispatch for the ops the trace counts per block
    # (fake tensors, prim queries left out); a real forward under the policy calls it that often.
    from shardfit import sac
    from shardfit.estimate.selective import selective_block_ops

    calls = []
    keeps = sac.keeps
    monkeypatch.setattr(sac, "keeps", lambda func, counts, recompute=False: calls.append(recompute) or
                        keeps(func, counts, recompute))
    torch.manual_seed(0)
    spec = load_model_spec(models[name])
    model = build_model(models[name], dtype="fp32")
    apply_activation_checkpointing(model, tuple(block_classes(model, spec)), 1, selective=True)
    ids = torch.randint(0, spec.vocab_size, (2, 64))
    model(input_ids=ids, labels=ids)
    per_block = calls.count(False) / spec.num_layers
    assert selective_block_ops(spec, "fp32", "sdpa") == pytest.approx(per_block, rel=0.1)


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-gpt2"])
def test_shipped_block_ops_equal_a_fresh_trace(name, tmp_path, monkeypatch):
    from shardfit.estimate.selective import _selective_block_ops, _shipped_block_ops, selective_block_ops

    monkeypatch.setenv("SHARDFIT_CACHE_DIR", str(tmp_path))
    shipped = _shipped_block_ops()[name]
    spec = model_spec_for(name)
    monkeypatch.setattr("shardfit.estimate.selective._shipped_block_ops", lambda: {})
    _selective_block_ops.cache_clear()
    try:
        for key in ("fp32|sdpa", "half|eager"):
            assert selective_block_ops(spec, *key.split("|")) == shipped[key], key
    finally:
        _selective_block_ops.cache_clear()


@pytest.mark.parametrize("name, tp", [("tiny-llama", 2), ("tiny-qwen2", 2), ("llama-3.1-8b", 8)])
def test_a_tensor_parallel_rank_keeps_its_sliced_matmuls(name, tp, tmp_path, monkeypatch):
    """A hand-written family's tp rank (model_parallel.local_model) keeps the outputs of its sliced
    matmuls: the shipped terms equal a fresh trace of the config that rank runs, and are not the
    whole model's."""
    from shardfit.estimate.model_parallel import local_model
    from shardfit.estimate.selective import _selective_kept, _shipped_selective_tp
    from shardfit.spec.parallelism import Layout

    monkeypatch.setenv("SHARDFIT_CACHE_DIR", str(tmp_path))
    spec = model_spec_for(name)
    layout = Layout(world=tp, dp_replicate=1, dp_shard=1, tp=tp, cp=1, pp=1, ep=1, virtual=1, microbatches=1,
                    schedule="1f1b", sequence_parallel=False, loss_parallel=True)
    rank = local_model(spec, layout, spec.num_layers, True, True)
    shipped = _shipped_selective_tp()[str(tp)][name]
    _selective_kept.cache_clear()
    try:
        for key in ("fp32|sdpa", "half|sdpa"):
            regime, attention = key.split("|")
            assert list(selective_kept(rank, regime, attention, None)) == pytest.approx(shipped[key]), key
            assert selective_kept(rank, regime, attention, None)[0] < selective_kept(spec, regime, attention, None)[0]
        monkeypatch.setattr("shardfit.estimate.selective._shipped_selective_tp", lambda: {})
        _selective_kept.cache_clear()
        assert list(selective_kept(rank, "fp32", "sdpa", None)) == pytest.approx(shipped["fp32|sdpa"])
    finally:
        _selective_kept.cache_clear()
