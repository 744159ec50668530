"""Strategy single through every format that makes sense for one device, each checked by the real
tool's own loader (TrainingArguments, accelerate's ClusterConfig, Lightning's Trainer, bash); the
runnable script trains for real on CPU; the formats that make no sense answer one clear line."""
import ast
import json
import math
import re
import subprocess
import sys

import pytest

from launch import run as run_command, test_env as launch_env
from shardfit.emit import FORMATS, emit
from shardfit.errors import ShardfitError
from shardfit.spec.plan import LoRA
from test_emit_configs import BIG, make


def test_single_is_a_format():
    assert "single" in FORMATS
    out = emit(make("single"), "single")
    assert list(out.files) == ["train_single.py"] and all(n.startswith("TODO(set me)") for n in out.notes)
    tree = ast.parse(out.main)  # valid Python
    imported = {alias.name for node in ast.walk(tree) if isinstance(node, (ast.Import, ast.ImportFrom))
                for alias in node.names} | {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
    assert "torch.distributed" not in imported and "init_process_group" not in out.main
    assert "DistributedDataParallel" not in out.main and "fully_shard" not in out.main
    # DDP on one GPU is the same training: written, with a note naming what it drops.
    ddp = emit(make("ddp"), "single")
    assert any("bucket copy" in note for note in ddp.notes)


def test_hf_training_arguments_for_one_device():
    from transformers import TrainingArguments
    from transformers.training_args import ParallelMode

    out = emit(make("single", ac="every-2"), "hf-trainer")
    fields = json.loads(out.main)
    assert not {"fsdp", "fsdp_config", "deepspeed", "ddp_find_unused_parameters"} & set(fields)
    args = TrainingArguments(**fields, use_cpu=True)  # use_cpu: this machine has no GPU
    assert args.parallel_mode != ParallelMode.DISTRIBUTED and args.world_size == 1
    assert args.per_device_train_batch_size == 2 and args.gradient_accumulation_steps == 4 and args.bf16
    assert not args.fsdp and args.deepspeed is None
    assert args.activation_checkpointing_kwargs["every_n_layers"] == 2
    assert any("python train.py" in note for note in out.notes)


def test_accelerate_config_is_one_process_without_distribution(tmp_path):
    from accelerate.commands.config.config_args import ClusterConfig
    from accelerate.commands.launch import launch_command_parser

    path = tmp_path / "accelerate.yaml"
    path.write_text(emit(make("single", model=BIG, precision="fp16"), "accelerate").main)
    config = ClusterConfig.from_yaml_file(str(path))
    assert config.distributed_type.value == "NO" and config.num_processes == 1 and config.num_machines == 1
    assert config.mixed_precision == "fp16" and config.gpu_ids == "all"
    assert not config.deepspeed_config and not config.fsdp_config
    known = {a.dest for a in launch_command_parser()._actions}
    assert {"num_processes", "mixed_precision", "gpu_ids"} <= known


def test_lightning_trainer_runs_a_single_device_strategy():
    L = pytest.importorskip("lightning")
    from lightning.pytorch.strategies import SingleDeviceStrategy

    text = emit(make("single", model=BIG, ac="full"), "lightning").main
    assert "devices=1" in text and "num_nodes=1" in text and 'strategy = "auto"' in text
    namespace: dict = {}
    exec(compile(text.replace('accelerator="gpu"', 'accelerator="cpu"'), "lightning_strategy.py", "exec"), namespace)
    trainer = namespace["trainer"]
    assert isinstance(trainer, L.Trainer) and isinstance(trainer.strategy, SingleDeviceStrategy)
    assert (trainer.num_nodes, trainer.num_devices) == (1, 1) and trainer.accumulate_grad_batches == 4


def test_launch_formats_run_one_plain_process(tmp_path):
    plan = make("single", model=BIG)
    torchrun = emit(plan, "torchrun").main
    slurm = emit(plan, "slurm").main
    for name, text in (("run.sh", torchrun), ("train.sbatch", slurm)):
        path = tmp_path / name
        path.write_text(text)
        subprocess.run(["bash", "-n", str(path)], check=True)
    assert "python -m shardfit train plan.yaml" in torchrun and "torchrun " not in torchrun
    assert "#SBATCH --gpus=1" in slurm and "srun python -m shardfit train plan.yaml" in slurm
    assert "rdzv" not in slurm and "torchrun" not in slurm


@pytest.mark.parametrize("fmt,match", [("deepspeed", "not DeepSpeed: use --format single"),
                                       ("deepspeed-launcher", "needs no launcher"),
                                       ("fsdp", "use --format single"), ("fsdp2", "use --format single")])
def test_formats_without_meaning_for_one_device_are_one_clear_line(fmt, match):
    with pytest.raises(ShardfitError, match=match) as err:
        emit(make("single"), fmt)
    assert "\n" not in str(err.value)


def test_the_single_script_refuses_multi_gpu_plans():
    with pytest.raises(ShardfitError, match="single-device script is for single plans"):
        emit(make("ddp", gpus=2), "single")
    with pytest.raises(ShardfitError, match="nf4"):
        emit(make("single", lora=LoRA(rank=4, base_dtype="nf4")), "single")


@pytest.mark.parametrize("precision,ac,lora", [("bf16", "full", None), ("fp32", "every-2", LoRA(rank=4, alpha=8))])
def test_the_single_script_trains_on_cpu(tmp_path, precision, ac, lora):
    from dataclasses import replace

    from shardfit.spec.plan import Schedule

    plan = replace(make("single", precision=precision, ac=ac, lora=lora, micro=2, accum=2),
                   schedule=Schedule(steps=3, log_every=1))
    plan = plan.with_changes(training={"seq_len": 32})
    script = tmp_path / "train_single.py"
    script.write_text(emit(plan, "single").main)
    result = run_command([sys.executable, str(script)], timeout=240, env=launch_env(STEPS="3"))
    losses = [float(x) for x in re.findall(r"step \d+ loss ([0-9.naif]+)", result.stdout)]
    assert len(losses) == 3 and all(math.isfinite(loss) and 0 < loss < 20 for loss in losses), result.stdout
