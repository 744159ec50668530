"""Plans from an existing setup: the files `shardfit emit` writes read back into the plan they came
from, and hand-written typical files ("auto" values included); the same reader behind plan, fit and
the Trainer callback. No torch: these are the analytic path."""
from __future__ import annotations

import json

import pytest
import yaml
from launch import shardfit

from shardfit.doctor.setup import read_setup
from shardfit.emit import emit
from shardfit.errors import ShardfitError
from shardfit.integrations.setup_plan import plan_from_files
from shardfit.spec.models import model_spec_for
from shardfit.spec.planfile import dump_plan
from shardfit.spec.plan import plan_from_dict

TINY = model_spec_for("tiny-llama")
L8B = model_spec_for("llama-3.1-8b")


def _plan(strategy: dict, training: dict, gpus=2):
    return plan_from_dict({"model": "tiny-llama", "strategy": strategy, "cluster": {"gpus_per_node": gpus},
                           "training": {"seq_len": 256, **training}}, resolve_model=model_spec_for)


PLANS = {
    "zero3+offload": _plan({"kind": "zero3", "offload_optimizer": "cpu", "offload_params": "cpu"},
                           {"micro_batch": 4, "grad_accum": 2, "precision": "bf16"}),
    "zero2": _plan({"kind": "zero2"}, {"micro_batch": 2, "grad_accum": 4, "precision": "fp16"}),
    "fsdp:shard_grad_op": _plan({"kind": "fsdp", "sharding": "shard_grad_op"},
                                {"micro_batch": 2, "precision": "bf16", "activation_checkpointing": "full"}),
    "fsdp2": _plan({"kind": "fsdp2"}, {"micro_batch": 3, "precision": "bf16"}),
    "ddp": _plan({"kind": "ddp"}, {"micro_batch": 8, "grad_accum": 2, "precision": "fp32"}),
}


def _same_run(read, plan):
    t, r = plan.training, read.training
    assert read.strategy.label == plan.strategy.label
    assert (r.micro_batch, r.grad_accum, r.precision, r.seq_len) == (t.micro_batch, t.grad_accum, t.precision, t.seq_len)
    assert (r.activation_checkpointing != "none") == (t.activation_checkpointing != "none")
    assert read.cluster.world_size == plan.cluster.world_size


@pytest.mark.parametrize("label", sorted(PLANS))
def test_the_trainer_args_emit_writes_read_back_as_their_plan(tmp_path, label):
    plan = PLANS[label]
    path = tmp_path / "training_args.json"
    path.write_text(emit(plan, "hf-trainer").main)
    read = plan_from_files([str(path)], TINY, world_size=2, seq_len=256).plan
    _same_run(read, plan)


@pytest.mark.parametrize("label", ["zero3+offload", "zero2", "fsdp:shard_grad_op", "fsdp2", "ddp"])
def test_the_accelerate_config_and_deepspeed_json_emit_writes_read_back(tmp_path, label):
    plan = PLANS[label]
    path = tmp_path / "accelerate.yaml"
    path.write_text(emit(plan, "accelerate").main)
    paths = [str(path)]
    if plan.strategy.is_deepspeed:
        ds = tmp_path / "ds.json"
        ds.write_text(emit(plan, "deepspeed").main)
        paths.append(str(ds))
    # accelerate's YAML holds no micro-batch and no sequence: those come from the loop, here as arguments.
    read = plan_from_files(paths, TINY, seq_len=256, micro_batch=plan.training.micro_batch).plan
    assert read.strategy.label == plan.strategy.label and read.cluster.world_size == 2
    assert read.training.precision == plan.training.precision


# HF's own ds_config_zero3.json template (docs "DeepSpeed integration"): everything the Trainer knows is "auto".
HF_ZERO3_TEMPLATE = {
    "fp16": {"enabled": "auto", "loss_scale": 0, "initial_scale_power": 16},
    "bf16": {"enabled": "auto"},
    "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"}},
    "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "none"}, "offload_param": {"device": "none"},
                          "overlap_comm": True, "contiguous_gradients": True, "reduce_bucket_size": "auto",
                          "stage3_prefetch_bucket_size": "auto", "stage3_param_persistence_threshold": "auto",
                          "stage3_max_live_parameters": 1e9, "stage3_max_reuse_distance": 1e9,
                          "stage3_gather_16bit_weights_on_model_save": True},
    "gradient_accumulation_steps": "auto", "gradient_clipping": "auto", "train_batch_size": "auto",
    "train_micro_batch_size_per_gpu": "auto", "wall_clock_breakdown": False}


def test_a_deepspeed_template_of_autos_takes_the_trainer_args_values(tmp_path):
    ds = tmp_path / "ds_config_zero3.json"
    ds.write_text(json.dumps(HF_ZERO3_TEMPLATE))
    args = tmp_path / "args.json"
    args.write_text(json.dumps({"output_dir": "out", "per_device_train_batch_size": 2, "gradient_accumulation_steps": 8,
                                "bf16": True, "gradient_checkpointing": True, "deepspeed": str(ds)}))
    found = plan_from_files([str(args), str(ds)], L8B, world_size=16, nodes=2, seq_len=4096)
    p = found.plan
    assert p.strategy.label == "zero3" and p.cluster.nodes == 2 and p.cluster.gpus_per_node == 8
    assert (p.training.micro_batch, p.training.grad_accum, p.training.precision) == (2, 8, "bf16")
    assert p.training.activation_checkpointing == "full" and p.training.optimizer == "adamw"
    assert not [line for line in found.assumed if "micro-batch" in line or "precision" in line], found.assumed
    # The template alone: every "auto" is named with what was taken for it.
    alone = plan_from_files([str(ds)], L8B, world_size=8)
    assumed = " | ".join(alone.assumed)
    assert 'micro-batch "auto": 1' in assumed and 'precision "auto": bf16' in assumed and "sequence length" in assumed


def test_a_hand_written_accelerate_fsdp2_config(tmp_path):
    config = {"compute_environment": "LOCAL_MACHINE", "distributed_type": "FSDP", "mixed_precision": "bf16",
              "num_machines": 1, "num_processes": 4,
              "fsdp_config": {"fsdp_version": 2, "fsdp_auto_wrap_policy": "TRANSFORMER_BASED_WRAP",
                              "fsdp_reshard_after_forward": False, "fsdp_offload_params": False,
                              "fsdp_activation_checkpointing": True, "fsdp_state_dict_type": "SHARDED_STATE_DICT"}}
    path = tmp_path / "default_config.yaml"
    path.write_text(yaml.safe_dump(config))
    p = plan_from_files([str(path)], L8B, seq_len=2048, micro_batch=2).plan
    assert p.strategy.label == "fsdp2:no_reshard" and p.cluster.world_size == 4
    assert p.training.activation_checkpointing == "full" and p.training.precision == "bf16"


def test_doctor_and_plan_read_the_same_facts(tmp_path):
    path = tmp_path / "training_args.json"
    path.write_text(emit(PLANS["zero2"], "hf-trainer").main)
    setup, kinds = read_setup([str(path)])
    plan = plan_from_files([str(path)], TINY, world_size=2, seq_len=256).plan
    assert kinds == [(str(path), "hf-trainer")]
    assert (setup.engine, setup.zero_stage, setup.micro_batch, setup.grad_accum, setup.precision) == (
        "deepspeed", 2, plan.training.micro_batch, plan.training.grad_accum, plan.training.precision)


def test_plan_from_trainer_args_prints_the_plans_own_numbers(tmp_path):
    plan = PLANS["zero3+offload"]
    dump_plan(plan, str(tmp_path / "plan.yaml"))
    (tmp_path / "args.json").write_text(emit(plan, "hf-trainer").main)
    (tmp_path / "ds.json").write_text(emit(plan, "deepspeed").main)
    direct = json.loads(shardfit("plan", str(tmp_path / "plan.yaml"), "--json").stdout)
    read = shardfit("plan", "tiny-llama", "--from-trainer-args", str(tmp_path / "args.json"), "--seq", "256",
                    "--gpus", "2", "--json")
    assert "read: " in read.stderr and "(hf-trainer)" in read.stderr
    from_args = json.loads(read.stdout)
    by_ds = json.loads(shardfit("plan", "tiny-llama", "--deepspeed", str(tmp_path / "ds.json"), "--seq", "256",
                                "--gpus", "2", "--json").stdout)
    for doc in (from_args, by_ds):
        assert [row["strategy"] for row in doc["strategies"]] == ["zero3+offload"]
        assert doc["strategies"][0]["peak_bytes"] == direct["strategies"][0]["peak_bytes"]


def test_a_file_given_to_the_wrong_flag_is_one_line(tmp_path):
    (tmp_path / "ds.json").write_text(json.dumps(HF_ZERO3_TEMPLATE))
    result = shardfit("plan", "tiny-llama", "--from-trainer-args", str(tmp_path / "ds.json"), check=False)
    assert result.returncode == 2 and "reads as deepspeed" in result.stderr and "Traceback" not in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1
    with pytest.raises(ShardfitError, match="no setup file"):
        plan_from_files([], TINY)


def test_fit_from_a_setup_says_how_the_setup_does_and_keeps_its_global_batch(tmp_path):
    ds = tmp_path / "ds.json"
    ds.write_text(json.dumps(HF_ZERO3_TEMPLATE))
    args = tmp_path / "args.json"
    args.write_text(json.dumps({"output_dir": "out", "per_device_train_batch_size": 8, "gradient_accumulation_steps": 2,
                                "bf16": True, "deepspeed": str(ds)}))
    result = shardfit("fit", "llama-3.1-8b", "--from-trainer-args", str(args), "--gpus", "8", "--seq", "4096",
                      "--gpu", "A100-40GB", "--top", "1", check=False)
    out = result.stdout
    assert out.startswith("your setup: zero3, micro-batch 8 x accumulation 2, AC none, bf16:"), out
    assert "does NOT fit" in out.splitlines()[0] and "global batch 128 = " in out, out
    assert result.returncode == 0 and "best: " in out


def test_a_relative_deepspeed_path_is_found_next_to_the_trainer_args(tmp_path, monkeypatch):
    (tmp_path / "ds.json").write_text(json.dumps(HF_ZERO3_TEMPLATE))
    (tmp_path / "args.json").write_text(json.dumps({"output_dir": "out", "per_device_train_batch_size": 2,
                                                    "deepspeed": "ds.json"}))
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    assert plan_from_files([str(tmp_path / "args.json")], TINY, world_size=2).plan.strategy.label == "zero3"
