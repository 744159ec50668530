"""The kernel knobs of a Plan (spec/kernels.py): parsed, validated with one line, serialised, and counted
by the estimator (the loss's terms under the chunked loss; the step's scratch per implementation)."""
from __future__ import annotations

import json

import pytest

from launch import shardfit
from shardfit.errors import ShardfitError
from shardfit.estimate.estimator import estimate
from shardfit.spec.kernels import parse_loss
from shardfit.spec.models import load_model_spec
from shardfit.spec.plan import plan_from_dict

GIB = 1024**3


def _plan(model="llama-3.1-8b", **training):
    return plan_from_dict({"model": model, "training": training}, resolve_model=load_model_spec)


def test_parse_loss():
    assert parse_loss("standard") == ("standard", 8)
    assert parse_loss("chunked") == ("chunked", 8)
    assert parse_loss(" Chunked:16 ") == ("chunked", 16)
    for bad in ("fused", "chunked:0", "chunked:x", "standard:4"):
        with pytest.raises(ShardfitError, match="--loss"):
            parse_loss(bad)


@pytest.mark.parametrize("training,match", [
    ({"loss": "liger"}, "training.loss 'liger' is not known"),
    ({"loss": "chunked", "loss_chunks": 0}, "loss_chunks must be at least 1"),
    ({"optimizer_impl": "turbo"}, "optimizer_impl 'turbo' is not known"),
    ({"optimizer": "adamw8bit", "optimizer_impl": "fused"}, "has its own kernel"),
])
def test_bad_values_are_one_line_errors(training, match):
    with pytest.raises(ShardfitError, match=match) as info:
        _plan(**training)
    assert "\n" not in str(info.value)


def test_models_the_chunked_loss_does_not_reproduce_are_refused():
    for model in ("bert-large", "gemma-2-9b"):
        with pytest.raises(ShardfitError, match="use loss standard"):
            _plan(model, loss="chunked")
    with pytest.raises(ShardfitError, match="DeepSpeedCPUAdam"):
        plan_from_dict({"model": "llama-3.1-8b", "strategy": {"kind": "zero2", "offload_optimizer": "cpu"},
                        "training": {"optimizer_impl": "fused"}}, resolve_model=load_model_spec)


def test_round_trip_through_yaml_and_json(tmp_path):
    from shardfit.spec.planfile import dump_plan, load_plan

    plan = _plan(loss="chunked", loss_chunks=16, optimizer_impl="fused")
    for name in ("plan.yaml", "plan.json"):
        dump_plan(plan, tmp_path / name)
        again = load_plan(tmp_path / name)
        assert again == plan and again.training.loss_chunks == 16 and again.training.optimizer_impl == "fused"


def test_chunked_loss_terms_at_32k_tokens():
    # Llama-3.1-8B, one 32k sequence, FSDP2 on 8 GPUs: the standard loss's fp32 b*s*V buffers vs one chunk's.
    standard = _plan(seq_len=32768, activation_checkpointing="full")
    standard = standard.with_changes(strategy={"kind": "fsdp2"})
    chunked = standard.with_changes(training={"loss": "chunked"})
    terms = {name: {t.name: t.bytes for t in estimate(p, explain=True).terms} for name, p in
             (("standard", standard), ("chunked", chunked))}
    tokens, vocab, hidden = 32768, 128256, 4096
    assert terms["standard"]["temporaries.loss_backward"] == 8 * tokens * vocab  # nll + log_softmax grads, fp32
    rows = tokens // 8
    assert terms["chunked"]["temporaries.logits_and_upcast"] == rows * vocab * 6 + 12 * rows  # bf16 + fp32 copy
    assert terms["chunked"]["temporaries.loss_backward"] == rows * vocab * 6 + 4 * rows + tokens * hidden * 2 + 24 * tokens
    saved = terms["standard"]["activations.head"] - terms["chunked"]["activations.head"]
    assert saved == tokens * 4 * vocab + 8 * tokens - 4 * tokens - 8  # fp32 log_softmax + labels -> logsumexp + count
    assert estimate(chunked).device_peak_bytes < estimate(standard).device_peak_bytes - 30 * GIB


def test_optimizer_impl_comes_from_the_plan_and_the_flag_wins():
    plan = _plan().with_changes(strategy={"kind": "ddp"})
    step = {impl: estimate(plan.with_changes(training={"optimizer_impl": impl})).phases["optimizer"]["temporaries"]
            for impl in ("foreach", "single", "fused")}
    assert step["fused"] < step["single"] < step["foreach"]
    assert estimate(plan.with_changes(training={"optimizer_impl": "fused"}), optimizer_impl="foreach") \
        .phases["optimizer"]["temporaries"] == step["foreach"]


def test_cli_flags_set_the_plan_and_bad_ones_exit_2(tmp_path):
    out = shardfit("plan", "llama-3.1-8b", "--strategy", "fsdp2", "--loss", "chunked:4", "--optimizer-impl", "fused",
                   "--json")
    doc = json.loads(out.stdout)
    assert doc["plan"]["training"]["loss"] == "chunked" and doc["plan"]["training"]["loss_chunks"] == 4
    assert doc["plan"]["training"]["optimizer_impl"] == "fused"
    for command in (["plan", "llama-3.1-8b", "--loss", "fused"], ["fit", "llama-3.1-8b", "--optimizer-impl", "turbo"],
                    ["train", "--model", "tiny-llama", "--loss", "chunked:0", "--nproc", "1", "--strategy", "single"]):
        bad = shardfit(*command, check=False)
        assert bad.returncode == 2 and len(bad.stderr.strip().splitlines()) == 1, (command, bad.stderr)
