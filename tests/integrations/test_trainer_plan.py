"""A Trainer's own setup (real TrainingArguments and model) becomes the Plan shardfit sizes, through
the reader `plan --from-trainer-args` uses; a fix is said as TrainingArguments fields."""
from __future__ import annotations

import dataclasses
import json

import pytest

from shardfit.integrations.fix_terms import trainer_arguments
from shardfit.integrations.session import oom_candidates
from shardfit.integrations.setup_plan import plan_from_files
from shardfit.spec.models import PRESETS_DIR

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def model():
    import torch

    config = transformers.LlamaConfig(**json.loads((PRESETS_DIR / "tiny-llama.json").read_text()))
    with torch.device("meta"):
        return transformers.LlamaForCausalLM(config)


def _args(tmp_path, **values):
    return transformers.TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to="none", **values)


ZERO3_AUTO = {"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"}, "offload_param": {"device": "cpu"}},
              "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto", "bf16": {"enabled": "auto"}}


@pytest.mark.parametrize("values, label, training", [
    ({"deepspeed": ZERO3_AUTO, "bf16": True, "per_device_train_batch_size": 2}, "zero3+offload", (2, 1, "bf16", "none", "adamw")),
    ({"fsdp": True, "fsdp_config": {"version": 1, "reshard_after_forward": "shard_grad_op"}}, "fsdp:shard_grad_op",
     (8, 1, "fp32", "none", "adamw")),
    ({"fsdp": True, "fsdp_config": {"reshard_after_forward": True, "cpu_offload": True}}, "fsdp2+offload",
     (8, 1, "fp32", "none", "adamw")),
    ({"gradient_checkpointing": True, "optim": "adamw_bnb_8bit", "per_device_train_batch_size": 3,
      "gradient_accumulation_steps": 5, "bf16": True}, "ddp", (3, 5, "bf16", "full", "adamw8bit")),
])
def test_the_trainers_setup_is_the_plan(tmp_path, model, values, label, training):
    from shardfit.integrations.transformers import trainer_plan

    plan, _ = trainer_plan(_args(tmp_path, **values), model, seq_len=128, world_size=4)
    t = plan.training
    assert plan.strategy.label == label and plan.cluster.world_size == 4 and t.seq_len == 128
    assert (t.micro_batch, t.grad_accum, t.precision, t.activation_checkpointing, t.optimizer) == training
    assert plan.model.n_params == 225_856
    # The same arguments as a JSON file read by `plan --from-trainer-args`: the same plan.
    path = tmp_path / "args.json"
    path.write_text(json.dumps(_args(tmp_path, **values).to_dict()))
    assert plan_from_files([str(path)], plan.model, world_size=4, seq_len=128).plan == plan


def test_every_fix_is_a_valid_trainingarguments_change(tmp_path, model):
    from shardfit.integrations.transformers import trainer_plan

    plan, _ = trainer_plan(_args(tmp_path, per_device_train_batch_size=4, optim="adamw_torch"), model, 64, 2)
    names = {f.name for f in dataclasses.fields(transformers.TrainingArguments)}
    seen = set()
    for label, changes in oom_candidates(plan):
        args = trainer_arguments(changes, plan.with_changes(**changes), tmp_path)
        assert args and set(args) <= names, (label, args)
        seen |= set(args)
        if "deepspeed" in args:  # a ZeRO fix is a DeepSpeed JSON written to pass on
            assert json.loads(open(args["deepspeed"]).read())["zero_optimization"]["stage"] in (1, 2, 3)
        # the fix, applied, is a TrainingArguments the Trainer accepts and reads back as the changed plan
        if "optim" in args:
            continue  # bitsandbytes is not installed here: the Trainer refuses adamw_bnb_8bit at build time
        fixed, _ = trainer_plan(_args(tmp_path, **{"per_device_train_batch_size": 4, "optim": "adamw_torch", **args}),
                                model, 64, 2)
        changed = plan.with_changes(**changes)
        assert fixed.strategy.label == changed.strategy.label, (label, args)
        assert fixed.training == changed.training, (label, args)
    assert {"per_device_train_batch_size", "gradient_accumulation_steps", "deepspeed", "optim"} <= seen
    assert {"activation_checkpointing", "gradient_checkpointing"} & seen


@pytest.mark.parametrize("make, label", [
    (lambda ls: ls.DeepSpeedStrategy(stage=3, offload_optimizer=True, offload_parameters=True), "zero3+offload"),
    (lambda ls: ls.DeepSpeedStrategy(stage=2), "zero2"),
    (lambda ls: ls.FSDPStrategy(sharding_strategy="SHARD_GRAD_OP", cpu_offload=True), "fsdp:shard_grad_op+offload"),
    (lambda ls: ls.FSDPStrategy(), "fsdp:full_shard"),
    (lambda ls: ls.ModelParallelStrategy(), "fsdp2"),
    (lambda ls: ls.DDPStrategy(), "ddp"),
])
def test_lightning_strategies_are_read_as_shardfit_strategies(make, label):
    """The strategy objects Lightning users build (GPU-only ones included: built, not run)."""
    from types import SimpleNamespace

    ls = pytest.importorskip("lightning.pytorch.strategies")
    from shardfit.integrations.lightning import lightning_strategy

    strategy, _ = lightning_strategy(SimpleNamespace(strategy=make(ls), world_size=2))
    assert strategy.label == label


def test_a_model_without_a_config_is_counted_from_its_tensors():
    import torch

    from shardfit.integrations.model_spec import spec_of_model

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.up, self.down = torch.nn.Linear(16, 64), torch.nn.Linear(64, 16)

    model = torch.nn.Sequential(torch.nn.Embedding(100, 16), Block(), Block(), torch.nn.Linear(16, 100))
    wrapped = type("Wrapper", (torch.nn.Module,), {})()
    wrapped.module = model  # a DDP-like wrapper: the user's module is under .module
    spec = spec_of_model(wrapped)
    assert spec.n_params == sum(p.numel() for p in model.parameters())
    assert spec.name == "Sequential" and spec.family == "module"


def test_a_models_config_gives_the_same_spec_as_plan(model):
    from shardfit.integrations.model_spec import spec_of_model
    from shardfit.spec.models import load_model_spec

    assert spec_of_model(model).n_params == load_model_spec("tiny-llama").n_params
