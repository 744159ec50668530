"""Engine pieces that need no process group: the DeepSpeed config, the LR schedule, and the
refusals that must happen before any rank starts a collective."""
from __future__ import annotations

import pytest

from shardfit.errors import ShardfitError
from shardfit.spec.models import load_model_spec
from shardfit.spec.plan import plan_from_dict


def _plan(**sections):
    return plan_from_dict({"model": "tiny-llama", **sections}, resolve_model=load_model_spec)


def test_deepspeed_config_follows_the_plan():
    from shardfit.engines.deepspeed import ds_config

    plan = _plan(strategy={"kind": "zero3", "offload_optimizer": "cpu", "offload_params": "cpu",
                           "reduce_bucket_size": 1234, "prefetch_bucket_size": 99},
                 training={"micro_batch": 3, "grad_accum": 4, "precision": "bf16"}, schedule={"grad_clip": 0.5})
    config = ds_config(plan, world_size=8, cuda=False)
    zero = config["zero_optimization"]
    assert (zero["stage"], zero["reduce_bucket_size"], zero["stage3_prefetch_bucket_size"]) == (3, 1234, 99)
    assert zero["offload_optimizer"] == {"device": "cpu", "pin_memory": False} == zero["offload_param"]
    assert config["train_batch_size"] == 3 * 4 * 8 and config["gradient_accumulation_steps"] == 4
    assert config["bf16"]["enabled"] and not config["fp16"]["enabled"] and config["gradient_clipping"] == 0.5
    assert config["optimizer"]["type"] == "AdamW"  # offload needs DeepSpeed's CPU Adam
    plain = ds_config(_plan(strategy={"kind": "zero1"}, training={"precision": "fp16"}), 2, True)
    assert "optimizer" not in plain and plain["fp16"]["loss_scale"] == 0  # dynamic scale, torch AdamW
    assert plain["zero_optimization"]["allgather_bucket_size"] == 500_000_000


def test_lr_schedule_warms_up_then_decays_to_the_floor():
    from shardfit.engines.base import lr_lambda

    factor = lr_lambda(_plan(schedule={"steps": 20, "warmup_steps": 4, "min_lr_ratio": 0.1}))
    values = [factor(step) for step in range(21)]
    assert values[:4] == [0.2, 0.4, 0.6, 0.8] and values[4] == 1.0
    assert all(a >= b for a, b in zip(values[4:], values[5:])) and values[20] == pytest.approx(0.1)


def _ctx():
    import torch

    from shardfit.engines.base import DistContext

    return DistContext(rank=0, world_size=2, local_rank=0, device=torch.device("cpu"), backend="gloo")


def test_refusals_come_before_any_collective():
    from shardfit.engines import ddp, deepspeed, fsdp

    with pytest.raises(ShardfitError, match="FSDP1 CPU offload needs CUDA"):
        fsdp.setup(_plan(strategy={"kind": "fsdp", "offload_params": "cpu"}), None, _ctx())
    with pytest.raises(ShardfitError, match="nan_policy skip is not supported with DeepSpeed"):
        deepspeed.setup(_plan(strategy={"kind": "zero2"}, schedule={"nan_policy": "skip"}), None, _ctx())
    with pytest.raises(ShardfitError, match="optimizer 'sgd'"):
        deepspeed.setup(_plan(strategy={"kind": "zero2"}, training={"optimizer": "sgd"}), None, _ctx())
    plan = _plan().with_changes(strategy={"offload_params": "cpu"})  # past validation on purpose
    with pytest.raises(ShardfitError, match="DDP has no offload"):
        ddp.setup(plan, None, _ctx())


def test_hybrid_group_must_divide_the_world():
    from shardfit.engines.base import hybrid_group

    plan = _plan(strategy={"kind": "fsdp2"})
    assert hybrid_group(plan, _ctx()) is None
    assert hybrid_group(plan.with_changes(strategy={"shard_group_size": 1}), _ctx()) == 1
    with pytest.raises(ShardfitError, match="does not divide the world size 2"):
        hybrid_group(plan.with_changes(strategy={"shard_group_size": 3}), _ctx())


def test_activation_checkpointing_every_n_blocks():
    from shardfit.engines.base import prepare_model
    from shardfit.modeling import build_model

    plan = _plan(training={"activation_checkpointing": "every-2"})
    model, blocks = prepare_model(plan, build_model("tiny-llama", seed=0))
    flags = [m.gradient_checkpointing for m in model.modules() if isinstance(m, blocks)]
    assert flags == [True, False, True, False]


def test_lora_targets_must_exist():
    from shardfit.engines.base import prepare_model
    from shardfit.modeling import build_model

    plan = _plan(training={"lora": {"rank": 2, "base_dtype": "fp32", "target_modules": ["c_attn"]}})
    with pytest.raises(ShardfitError, match="LoRA target module"):
        prepare_model(plan, build_model("tiny-llama", seed=0))
    plan = _plan(training={"lora": {"rank": 2, "base_dtype": "fp32"}})
    model, _ = prepare_model(plan, build_model("tiny-llama", seed=0))
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    assert 0 < trainable < sum(p.numel() for p in model.parameters()) // 10


@pytest.mark.parametrize("training", [{"activation_checkpointing": "full"},
                                      {"activation_checkpointing": "full", "lora": {"rank": 2, "base_dtype": "fp32"}}])
def test_checkpointing_uses_the_installed_transformers_current_api(training):
    """transformers 5 renamed gradient_checkpointing_* to activation_checkpointing_*; the old names
    warn (FutureWarning) on every run that calls them. A checkpointed run (LoRA too) warns nothing."""
    import warnings

    from shardfit.engines.base import prepare_model
    from shardfit.modeling import build_model

    model = build_model("tiny-llama", seed=0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model, blocks = prepare_model(_plan(training=training), model)
    deprecated = [str(w.message) for w in caught if "checkpointing" in str(w.message) and "deprecated" in str(w.message)]
    assert not deprecated, deprecated
    assert all(m.gradient_checkpointing for m in model.modules() if isinstance(m, blocks))
