"""The Plan: round trips, strategy parsing, and every invalid combination's one-line error."""
import dataclasses
import json

import pytest

from shardfit.errors import ShardfitError
from shardfit.spec.gpus import CATALOG, get_gpu
from shardfit.spec.model_spec import ModelSpec, params_only_spec
from shardfit.spec.plan import (LoRA, Plan, Training, parse_activation_checkpointing, parse_strategy,
                                plan_from_dict, validate_plan)

SPEC = ModelSpec(name="toy", family="llama", source="toy", n_params=1000, hidden_size=8, num_layers=2,
                 num_heads=2, num_kv_heads=2, head_dim=4, intermediate_size=16, vocab_size=32,
                 block_class="LlamaDecoderLayer", block_params=300, largest_layer_params=256, non_block_params=400)


def test_round_trip_through_json_keeps_every_field():
    nvme = dataclasses.replace(parse_strategy("zero3+offload-nvme"), nvme_path="/local_nvme")
    plan = Plan(model=SPEC, strategy=nvme,
                training=Training(precision="fp16", lora=LoRA(rank=8, target_modules=("q_proj",))))
    text = json.dumps(plan.to_dict())
    again = plan_from_dict(json.loads(text))
    assert again == plan
    assert again.training.lora.target_modules == ("q_proj",)


@pytest.mark.parametrize("text,label", [
    ("ddp", "ddp"), ("fsdp", "fsdp:full_shard"), ("fsdp:shard_grad_op", "fsdp:shard_grad_op"),
    ("fsdp2", "fsdp2"), ("fsdp2:no_reshard", "fsdp2:no_reshard"), ("zero1", "zero1"),
    ("zero2+offload", "zero2+offload"), ("zero3+offload", "zero3+offload"), ("ZeRO-3", "zero3"),
    ("zero3+offload-opt", "zero3+offload-opt"), ("fsdp2+offload", "fsdp2+offload"),
])
def test_strategy_labels_round_trip(text, label):
    strategy = parse_strategy(text)
    assert strategy.label == label
    assert parse_strategy(strategy.label) == strategy


def test_nvme_strategy_has_no_made_up_path():
    strategy = parse_strategy("zero3+offload-nvme")
    assert strategy.nvme_path is None
    with pytest.raises(ShardfitError, match="nvme_path"):
        validate_plan(Plan(model=SPEC, strategy=strategy))


def test_zero3_offload_moves_both_states():
    strategy = parse_strategy("zero3+offload")
    assert (strategy.offload_optimizer, strategy.offload_params) == ("cpu", "cpu")
    assert parse_strategy("zero2+offload").offload_params is None


@pytest.mark.parametrize("value,every", [("none", 0), ("full", 1), ("every-2", 2), ("3", 3)])
def test_activation_checkpointing_forms(value, every):
    assert parse_activation_checkpointing(value) == every


BAD = [
    ({"strategy": {"kind": "zero3", "offload_optimizer": "nvme", "offload_params": "nvme"}}, "nvme_path"),
    ({"strategy": {"kind": "fsdp", "sharding": "hybrid_shard"}, "cluster": {"nodes": 1, "gpus_per_node": 3},
      "strategy_extra": None}, None),
    ({"strategy": {"kind": "ddp", "offload_optimizer": "cpu"}}, "DDP has no offload"),
    ({"strategy": {"kind": "zero2", "offload_optimizer": "nvme", "nvme_path": "/x"}}, "silently uses CPU"),
    ({"strategy": {"kind": "zero2", "offload_params": "cpu", "offload_optimizer": "cpu"}}, "needs zero3"),
    ({"strategy": {"kind": "fsdp2", "offload_optimizer": "cpu"}}, "offload_params"),
    ({"strategy": {"kind": "zero3"}, "training": {"precision": "bf16-pure"}}, "fp32 master"),
    ({"strategy": {"kind": "fsdp2"}, "training": {"optimizer": "adamw8bit"}}, "DTensor"),
    ({"training": {"precision": "bf16"}, "cluster": {"gpu": "V100-32GB"}}, "no bf16"),
    ({"training": {"micro_batch": 0}}, "micro_batch"),
    ({"training": {"micro_batch": "two"}}, "must be a number"),
    ({"training": {"precision": "fp8"}}, "precision"),
    ({"training": {"activation_checkpointing": "sometimes"}}, "every-N"),
    ({"cluster": {"gpu": "H900"}}, "unknown GPU"),
    ({"strategy": {"kind": "fsdp", "sharding": "hybrid_shard", "shard_group_size": 3},
      "cluster": {"nodes": 2, "gpus_per_node": 4}}, "does not divide"),
    ({"strategy": {"kind": "fsdp", "sharding": "hybrid_shard", "shard_group_size": 1},
      "cluster": {"nodes": 2, "gpus_per_node": 1}}, "NO_SHARD"),
    ({"strategy": {"kind": "zero9"}}, "strategy.kind"),
    ({"strategy": {"bucket": 1}}, "unknown field 'strategy.bucket'"),
    ({"typo_section": {}}, "unknown plan section"),
    ({"training": {"lora": {"rank": 0}}}, "lora.rank"),
    ({"strategy": {"reduce_bucket_size": -1}}, "must not be negative"),
    ({"training": {"seq_len": 10**13}}, "beyond any real run"),
    ({"schedule": {"nan_policy": "sometimes"}}, "schedule.nan_policy 'sometimes' is not known"),
    ({"strategy": {"kind": "zero2"}, "schedule": {"nan_policy": "skip"}}, "nan_policy skip is not supported with DeepSpeed"),
]


@pytest.mark.parametrize("changes,message", [case for case in BAD if case[1]])
def test_invalid_plans_give_one_clear_line(changes, message):
    data = {"model": SPEC.to_dict(), **changes}
    with pytest.raises(ShardfitError) as info:
        plan_from_dict(data)
    text = str(info.value)
    assert message in text
    assert "\n" not in text


def test_fp16_without_loss_scaling_is_a_warning_not_an_error():
    plan = plan_from_dict({"model": SPEC.to_dict(), "training": {"precision": "fp16", "loss_scaling": False}})
    warnings = validate_plan(plan)
    assert any("loss scaling" in warning for warning in warnings)


def test_missing_model_and_wrong_types():
    with pytest.raises(ShardfitError, match="no 'model'"):
        plan_from_dict({"training": {}})
    with pytest.raises(ShardfitError, match="mapping"):
        plan_from_dict(["not", "a", "plan"])
    with pytest.raises(ShardfitError, match="true or false"):
        plan_from_dict({"model": SPEC.to_dict(), "strategy": {"overlap_comm": "yes"}})


def test_with_changes_replaces_inside_sections():
    plan = Plan(model=SPEC)
    changed = plan.with_changes(training={"micro_batch": 4}, strategy=parse_strategy("zero2"))
    assert changed.training.micro_batch == 4 and changed.strategy.kind == "zero2"
    assert plan.training.micro_batch == 1  # frozen: the original is untouched


def test_gpu_catalog_and_custom_sizes():
    for name in ("H100-80GB", "H100-PCIe", "H200", "A100-40GB", "A100-80GB", "A10G", "L4", "L40S",
                 "RTX-3090", "RTX-4090", "V100-16GB", "V100-32GB", "T4", "MI300X", "B200"):
        assert name.lower() in CATALOG
    assert get_gpu("h100").name == "H100-80GB"
    assert get_gpu("custom:24").memory_bytes == 24 * 1024**3
    assert get_gpu("48GiB").memory_gib == 48
    with pytest.raises(ShardfitError, match="unknown GPU"):
        get_gpu("potato")
    with pytest.raises(ShardfitError, match="positive"):
        get_gpu("custom:-1")


def test_params_only_spec_checks_inputs():
    spec = params_only_spec(7.5e9, 5e8)
    assert spec.n_params == 7_500_000_000 and not spec.has_shape
    with pytest.raises(ShardfitError):
        params_only_spec(-1)
    with pytest.raises(ShardfitError):
        params_only_spec(10, 100)


def test_single_parses_alone_and_refuses_options_and_offload_in_one_line():
    strategy = parse_strategy("Single")
    assert strategy.kind == "single" and strategy.label == "single" and parse_strategy(strategy.label) == strategy
    assert not strategy.shards_params and not strategy.is_deepspeed
    for text in ("single:no_shard", "single+offload", "single+offload-nvme"):
        with pytest.raises(ShardfitError, match="single .*has no options and no offload") as err:
            parse_strategy(text)
        assert "\n" not in str(err.value)


def test_single_needs_a_world_of_one():
    from shardfit.spec.plan import Cluster

    ok = Plan(model=SPEC, strategy=parse_strategy("single"), cluster=Cluster(nodes=1, gpus_per_node=1))
    assert validate_plan(ok) == []
    for nodes, gpus in ((1, 2), (2, 1), (1, 8)):
        plan = dataclasses.replace(ok, cluster=Cluster(nodes=nodes, gpus_per_node=gpus))
        with pytest.raises(ShardfitError, match="single runs on one device") as err:
            validate_plan(plan)
        message = str(err.value)
        assert "\n" not in message and "--gpus 1" in message and "data-parallel strategy" in message
        assert f"has {nodes * gpus} GPUs" in message
    with pytest.raises(ShardfitError, match="single has no offload"):
        plan_from_dict({"model": dataclasses.asdict(SPEC), "strategy": {"kind": "single", "offload_params": "cpu"},
                        "cluster": {"gpus_per_node": 1}})


def test_the_deepspeed_buffer_keys_are_the_ones_the_builder_writes():
    # doctor and `plan --deepspeed` read a user's JSON with BUFFER_KEYS: each key must be what
    # zero_optimization() writes for the same Strategy field.
    from shardfit.spec.deepspeed_config import BUFFER_KEYS, zero_optimization

    for kind, fields in (("zero2", ("reduce_bucket_size", "allgather_bucket_size")),
                         ("zero3", ("reduce_bucket_size", "prefetch_bucket_size", "max_live_parameters"))):
        s = parse_strategy(kind)
        zero = zero_optimization(s)
        assert {key: zero[key] for field, key in BUFFER_KEYS if field in fields} == \
            {key: getattr(s, field) for field, key in BUFFER_KEYS if field in fields}
