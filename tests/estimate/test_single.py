"""Strategy single in the estimator: DDP's accounting minus everything DDP's reducer adds."""
import pytest

from shardfit.estimate.estimator import estimate, shard_degree
from shardfit.spec.models import load_model_spec
from shardfit.spec.plan import Cluster, Plan, Training, parse_strategy

LLAMA7B = load_model_spec("llama-2-7b")
ONE_GPU = Cluster(nodes=1, gpus_per_node=1)


def _plan(strategy, precision="bf16", ac="none", accum=1, model=LLAMA7B, **changes):
    from dataclasses import replace

    return Plan(model=model, strategy=replace(parse_strategy(strategy), **changes), cluster=ONE_GPU,
                training=Training(precision=precision, activation_checkpointing=ac, grad_accum=accum, seq_len=2048))


@pytest.mark.parametrize("precision,ac,accum", [("bf16", "none", 1), ("fp32", "full", 1), ("bf16", "every-2", 4),
                                                ("fp16", "none", 2)])
def test_single_is_ddp_on_one_gpu_without_the_bucket_copy(precision, ac, accum):
    single = estimate(_plan("single", precision, ac, accum))
    ddp = estimate(_plan("ddp", precision, ac, accum))
    bucket = 4 * LLAMA7B.n_params  # fp32 gradients (autocast keeps fp32 params), one flat copy
    for phase in single.phases:
        for category in ("params", "grads", "optimizer", "activations"):
            assert single.phases[phase][category] == ddp.phases[phase][category], (phase, category)
        assert ddp.phases[phase]["temporaries"] - single.phases[phase]["temporaries"] == pytest.approx(bucket, abs=8)
    assert ddp.peak_bytes - single.peak_bytes == pytest.approx(bucket, abs=8)
    if accum == 1:
        assert single.phases["load"]["grads"] == 0  # set_to_none: no grads between steps
    assert single.phases["optimizer"]["grads"] == 4 * LLAMA7B.n_params  # one copy: the .grad tensors
    assert single.overhead["nccl"] == 0 and single.overhead["cuda_context"] == ddp.overhead["cuda_context"]


def test_gradient_as_bucket_view_keeps_ddp_grads_alive_and_single_is_still_lower():
    view = estimate(_plan("ddp", ddp_gradient_as_bucket_view=True))
    single = estimate(_plan("single"))
    assert view.phases["load"]["grads"] == 4 * LLAMA7B.n_params  # the buckets are the grads, for the whole run
    assert single.phases["load"]["grads"] == 0
    assert single.peak_bytes <= view.peak_bytes


def test_single_uses_ddp_autocast_regime_and_step_scratch():
    single = estimate(_plan("single"), explain=True)
    ddp = estimate(_plan("ddp"), explain=True)
    assert any("regime 'autocast'" in a for a in single.assumptions)
    assert single.term("activations.block").bytes == ddp.term("activations.block").bytes
    assert single.term("temporaries.optimizer_step").bytes == ddp.term("temporaries.optimizer_step").bytes
    assert not any(t.name == "temporaries.ddp_buckets" for t in single.terms)
    assert any("strategy single" in a for a in ddp.assumptions)  # ddp on one GPU points at single
    assert shard_degree(_plan("single")) == 1
    pure = estimate(_plan("single", "bf16-pure"), explain=True)
    assert any("regime 'half'" in a for a in pure.assumptions)


def test_plan_output_names_the_bucket_bytes(capsys):
    from shardfit.cli import main

    assert main(["plan", "llama-2-7b", "--gpus", "1", "--strategy", "single,ddp", "--json"]) == 0
    import json

    rows = {row["strategy"]: row for row in json.loads(capsys.readouterr().out)["strategies"]}
    assert rows["ddp"]["peak_bytes"] - rows["single"]["peak_bytes"] == 4 * LLAMA7B.n_params
    assert main(["plan", "llama-2-7b", "--gpus", "1"]) == 0  # every strategy: single is listed on one GPU
    assert "\nsingle " in capsys.readouterr().out
    assert main(["plan", "llama-2-7b", "--gpus", "8"]) == 0  # ...and not on eight, not even as skipped
    out = capsys.readouterr().out
    assert "\nsingle " not in out and "single:" not in out and "ddp " in out
