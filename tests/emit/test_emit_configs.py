"""Every emitted config goes through the real tool's own parser: DeepSpeedConfig, accelerate's
ClusterConfig loader and launch argument parser, transformers.TrainingArguments."""
import ast
import json
import subprocess
from dataclasses import replace

import pytest

from shardfit.emit import FORMATS, EmitOptions, emit
from shardfit.errors import ShardfitError
from shardfit.spec.models import load_model_spec
from shardfit.spec.plan import Cluster, LoRA, Plan, Training, parse_strategy

TINY = load_model_spec("tiny-llama")
BIG = load_model_spec("llama-3.1-8b")


def make(strategy, model=TINY, nodes=1, gpus=1, precision="bf16", ac="none", micro=2, accum=4, optimizer="adamw",
         lora=None, **strategy_changes):
    s = replace(parse_strategy(strategy), **strategy_changes)
    return Plan(model=model, strategy=s,
                training=Training(micro_batch=micro, grad_accum=accum, precision=precision, activation_checkpointing=ac,
                                  optimizer=optimizer, lora=lora),
                cluster=Cluster(nodes=nodes, gpus_per_node=gpus, gpu="H100-80GB" if precision != "fp16" else "V100-32GB"))


DS_CASES = [("zero1", "bf16"), ("zero2", "fp16"), ("zero3", "bf16"), ("zero2+offload", "bf16"),
            ("zero3+offload", "fp32"), ("zero3+offload-opt", "bf16"), ("zero3+offload-nvme", "bf16")]


@pytest.mark.parametrize("strategy,precision", DS_CASES)
def test_deepspeed_json_is_accepted_by_deepspeedconfig(strategy, precision):
    from deepspeed.runtime.config import DeepSpeedConfig

    nvme = {"nvme_path": "/local_nvme"} if "nvme" in strategy else {}
    plan = make(strategy, precision=precision, reduce_bucket_size=12345678, **nvme)
    out = emit(plan, "deepspeed")
    config = json.loads(out.files["ds_config.json"])
    parsed = DeepSpeedConfig(config)  # one process: world size 1, so train_batch_size must be micro x accum
    assert parsed.zero_optimization_stage == int(strategy[4])
    assert parsed.train_batch_size == 8 and parsed.gradient_accumulation_steps == 4
    assert parsed.zero_config.reduce_bucket_size == 12345678
    assert parsed.bfloat16_config.enabled == (precision == "bf16")
    assert parsed.float16_config.enabled == (precision == "fp16")
    if precision == "fp16":
        assert parsed.float16_config.loss_scale == 0  # 0 = dynamic loss scaling
    offload = parsed.zero_config.offload_optimizer
    assert (offload is not None and offload.device != "none") == ("offload" in strategy)
    if "nvme" in strategy:
        assert str(parsed.zero_config.offload_param.nvme_path) == "/local_nvme"


def test_deepspeed_config_rejects_what_deepspeed_rejects():
    """The check has teeth: a batch that doesn't multiply out fails inside DeepSpeed itself."""
    from deepspeed.runtime.config import DeepSpeedConfig

    config = json.loads(emit(make("zero2"), "deepspeed").main)
    config["train_batch_size"] += 1
    with pytest.raises(AssertionError, match="train_batch_size"):
        DeepSpeedConfig(config)


def test_deepspeed_client_optimizer_is_left_to_the_script():
    out = emit(make("zero2", optimizer="adamw8bit"), "deepspeed")
    config = json.loads(out.main)
    assert "optimizer" not in config and config["zero_allow_untested_optimizer"] is True
    assert any("deepspeed.initialize(optimizer=" in n for n in out.notes)


@pytest.mark.parametrize("strategy,nodes,gpus", [("zero3+offload", 2, 4), ("zero2", 1, 8), ("fsdp", 1, 8),
                                                 ("fsdp2", 2, 4), ("fsdp:hybrid_shard", 2, 4), ("ddp", 1, 2),
                                                 ("ddp", 1, 1)])
def test_accelerate_yaml_loads_with_accelerates_loader(tmp_path, strategy, nodes, gpus):
    from accelerate.commands.config.config_args import ClusterConfig
    from accelerate.commands.launch import launch_command_parser

    plan = make(strategy, model=BIG, nodes=nodes, gpus=gpus, ac="full", shard_group_size=gpus if "hybrid" in strategy or (strategy == "fsdp2" and nodes > 1) else None)
    path = tmp_path / "accelerate.yaml"
    path.write_text(emit(plan, "accelerate").main)
    config = ClusterConfig.from_yaml_file(str(path))
    assert config.num_processes == nodes * gpus and config.num_machines == nodes
    assert config.mixed_precision == "bf16"
    # Every plugin key must be a real `accelerate launch` argument (the loader alone doesn't check them).
    known = {a.dest for a in launch_command_parser()._actions}
    for key in list(config.deepspeed_config) + list(config.fsdp_config) + list(config.parallelism_config):
        assert key in known, key
    if parse_strategy(strategy).is_deepspeed:
        assert config.distributed_type.value == "DEEPSPEED" and config.deepspeed_config["zero_stage"] == int(strategy[4])
    elif strategy.startswith("fsdp"):
        assert config.distributed_type.value == "FSDP"
        assert config.fsdp_config["fsdp_auto_wrap_policy"] == "TRANSFORMER_BASED_WRAP"
        assert config.fsdp_config["fsdp_transformer_layer_cls_to_wrap"] == "LlamaDecoderLayer"
        assert config.fsdp_config["fsdp_version"] == (2 if strategy == "fsdp2" else 1)
        if strategy == "fsdp2" and nodes > 1:
            assert config.parallelism_config["parallelism_config_dp_replicate_size"] == nodes
    else:
        assert config.distributed_type.value == ("MULTI_GPU" if gpus > 1 else "NO")


@pytest.mark.parametrize("strategy,ac", [("ddp", "every-2"), ("zero2", "full"), ("zero3+offload", "none"),
                                         ("fsdp", "full"), ("fsdp2:no_reshard", "every-2"), ("fsdp2+offload", "full")])
def test_hf_training_arguments_construct(strategy, ac):
    from transformers import TrainingArguments

    plan = make(strategy, ac=ac)
    fields = json.loads(emit(plan, "hf-trainer").main)
    # use_cpu only because this machine has no GPU; it is not part of the emitted fields.
    args = TrainingArguments(**fields, use_cpu=True)
    assert args.per_device_train_batch_size == 2 and args.gradient_accumulation_steps == 4 and args.bf16
    if parse_strategy(strategy).is_deepspeed:
        assert args.hf_deepspeed_config.config["zero_optimization"]["stage"] == int(strategy[4])
    if strategy.startswith("fsdp"):
        assert args.fsdp_config["transformer_layer_cls_to_wrap"] == ["LlamaDecoderLayer"]
        assert args.fsdp_config["state_dict_type"] == "SHARDED_STATE_DICT"
        assert args.fsdp_config["version"] == (1 if strategy == "fsdp" else 2)
    every = {"none": 0, "full": 1, "every-2": 2}[ac]
    uses_fsdp_ac = strategy.startswith("fsdp") and every == 1
    assert bool(fields.get("activation_checkpointing")) == (every > 0 and not uses_fsdp_ac)
    if every > 1:
        assert fields["activation_checkpointing_kwargs"]["every_n_layers"] == every


def test_lightning_arguments_are_python():
    for strategy in ("zero3+offload", "fsdp", "fsdp:hybrid_shard", "fsdp2", "ddp"):
        plan = make(strategy, model=BIG, nodes=2, gpus=4, ac="full")
        text = emit(plan, "lightning").main
        tree = ast.parse(text)
        calls = {node.func.id for node in ast.walk(tree) if isinstance(node, ast.Call) and isinstance(node.func, ast.Name)}
        assert "num_nodes=2" in text and "devices=4" in text and 'precision="bf16-mixed"' in text
        if parse_strategy(strategy).is_deepspeed:
            assert "DeepSpeedStrategy" in calls
            assert "'stage': 3" in text
        if strategy.startswith("fsdp:"):
            assert "FSDPStrategy" in calls and "auto_wrap_policy={LlamaDecoderLayer}" in text
            assert "from transformers.models.llama.modeling_llama import LlamaDecoderLayer" in text
        if "hybrid" in strategy:
            assert "device_mesh=(2, 4)" in text


def test_launch_scripts_are_valid_bash(tmp_path):
    plan = make("zero3", model=BIG, nodes=4, gpus=8)
    for fmt in ("torchrun", "deepspeed-launcher", "slurm"):
        out = emit(plan, fmt, EmitOptions())
        for name, text in out.files.items():
            if name == "hostfile":
                assert text.splitlines() == [f"node-{i} slots=8" for i in range(4)]
                continue
            path = tmp_path / name
            path.write_text(text)
            subprocess.run(["bash", "-n", str(path)], check=True)
    slurm = emit(plan, "slurm").main
    assert "#SBATCH --nodes=4" in slurm and "#SBATCH --gpus-per-node=8" in slurm
    assert '--nnodes "$SLURM_NNODES" --nproc-per-node 8' in slurm and "--rdzv-backend c10d" in slurm
    torchrun = emit(plan, "torchrun").main
    assert "torchrun --nnodes 4 --nproc-per-node 8 --rdzv-backend c10d" in torchrun
    single = emit(make("zero3", model=BIG, gpus=8), "torchrun").main
    assert "torchrun --standalone --nproc-per-node 8 -m shardfit train plan.yaml" in single
    launcher = emit(plan, "deepspeed-launcher", EmitOptions(hosts=("a", "b", "c", "d")))
    assert launcher.files["hostfile"] == "a slots=8\nb slots=8\nc slots=8\nd slots=8\n"
    assert "--num_nodes 4 --num_gpus 8 --master_addr a" in launcher.main and "--no_local_rank" in launcher.main


def test_wrong_format_for_the_strategy_is_one_clear_error():
    with pytest.raises(ShardfitError, match="not DeepSpeed"):
        emit(make("fsdp2"), "deepspeed")
    with pytest.raises(ShardfitError, match="unknown format 'xml'"):
        emit(make("ddp"), "xml")
    with pytest.raises(ShardfitError, match="hosts"):
        emit(make("ddp", nodes=2, gpus=2), "deepspeed-launcher", EmitOptions(hosts=("a",)))
    assert set(FORMATS) == {"deepspeed", "accelerate", "fsdp", "fsdp2", "ddp", "single", "lightning", "hf-trainer",
                            "torchrun", "deepspeed-launcher", "slurm", "torchtitan"}


def test_ddp_script_is_for_ddp_plans_only():
    assert "DistributedDataParallel" in emit(make("ddp"), "ddp").main
    with pytest.raises(ShardfitError, match="--format fsdp2"):
        emit(make("fsdp2"), "ddp")
    with pytest.raises(ShardfitError, match="--format single"):
        emit(make("single", gpus=1), "ddp")


def test_fsdp_scripts_never_emit_fsdp1_hybrid_with_shard_group_of_one():
    plan = make("fsdp2", nodes=2, gpus=1, shard_group_size=1)
    with pytest.raises(ShardfitError, match="shard group of 1"):
        emit(plan, "fsdp")
    text = emit(plan, "fsdp2").main  # FSDP2 handles the (2, 1) mesh correctly
    assert "SHARD_GROUP = 1" in text
    with pytest.raises(ShardfitError, match="causal language models"):
        emit(make("fsdp2", model=load_model_spec("tiny-bert")), "fsdp2")
    lora_plan = make("fsdp2", lora=LoRA(rank=4, base_dtype="nf4"))
    with pytest.raises(ShardfitError, match="nf4"):
        emit(lora_plan, "fsdp2")


@pytest.mark.parametrize("label", ["zero1", "zero2", "zero3", "zero2+offload", "zero3+offload", "zero3+offload-opt"])
def test_engines_run_the_zero_section_emit_writes(label):
    # One builder: what train/bench/profile hand DeepSpeed is what `emit --format deepspeed` gives users
    # (on a GPU; a CPU run only turns pinned host buffers off).
    from shardfit.emit.deepspeed import deepspeed_config
    from shardfit.engines.deepspeed import ds_config

    strategy = replace(parse_strategy(label), max_reuse_distance=12345, prefetch_bucket_size=777)
    plan = Plan(model=load_model_spec("tiny-llama"), strategy=strategy)
    emitted = deepspeed_config(plan)["zero_optimization"]
    assert ds_config(plan, plan.cluster.world_size, cuda=True)["zero_optimization"] == emitted
    on_cpu = ds_config(plan, 2, cuda=False)["zero_optimization"]
    for key in ("offload_optimizer", "offload_param"):
        if key in emitted:
            assert on_cpu[key] == {**emitted[key], "pin_memory": False}
    if strategy.kind == "zero3":
        assert emitted["stage3_max_reuse_distance"] == 12345


@pytest.mark.parametrize("warmup", [0, 5])
def test_the_emitted_scheduler_is_one_deepspeed_builds(warmup):
    """DeepSpeed's config parser passes `warmup_num_steps: 0`, its WarmupCosineLR refuses it at
    deepspeed.initialize: the scheduler is built here from the emitted params."""
    import torch
    from deepspeed.runtime.lr_schedules import WarmupCosineLR

    plan = replace(make("zero2"), schedule=replace(make("zero2").schedule, warmup_steps=warmup, steps=20, lr=1e-3))
    scheduler_config = json.loads(emit(plan, "deepspeed").main)["scheduler"]
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1e-3)
    scheduler = WarmupCosineLR(optimizer, **scheduler_config["params"])
    scheduler.step()  # after the first step: full rate without warm-up, a fraction of it with
    assert (scheduler.get_last_lr()[0] == pytest.approx(1e-3)) == (warmup == 0)
