"""emit for the tp x cp x pp plans fit returns: accelerate's ParallelismConfig (built from what emit
writes, by accelerate itself), torchrun / SLURM around your own script, one clear line elsewhere."""
from __future__ import annotations

import pytest
import yaml

from shardfit.emit import EmitOptions, emit
from shardfit.errors import ShardfitError
from shardfit.fit import FitRequest, fit
from shardfit.spec.models import load_model_spec
from shardfit.spec.parallelism import Parallelism, resolve
from shardfit.spec.plan import Plan, Strategy


def _tp_plan(tp=2, cp=1, pp=1, nodes=8):
    return Plan(model=load_model_spec("llama-3.1-70b")).with_changes(
        strategy=Strategy(kind="fsdp2"), cluster={"nodes": nodes, "gpus_per_node": 8},
        training={"micro_batch": 1, "grad_accum": 8, "seq_len": 65536, "activation_checkpointing": "full"},
        parallelism=Parallelism(tp=tp, sequence_parallel=tp > 1, cp=cp, pp=pp))


def _accelerate_objects(plan, tmp_path):
    from accelerate.commands.config.config_args import ClusterConfig
    from accelerate.commands.launch import launch_command_parser
    from accelerate.parallelism_config import ParallelismConfig

    path = tmp_path / "accelerate.yaml"
    path.write_text(emit(plan, "accelerate").main)
    config = ClusterConfig.from_yaml_file(str(path))
    known = {a.dest for a in launch_command_parser()._actions}
    assert set(config.parallelism_config) <= known  # real `accelerate launch` arguments
    sizes = {key.removeprefix("parallelism_config_"): value for key, value in config.parallelism_config.items()}
    return config, ParallelismConfig(**sizes)


@pytest.mark.parametrize("tp,cp", [(2, 1), (8, 1), (4, 4), (1, 8)])
def test_accelerate_parallelism_config_constructs_from_what_emit_writes(tmp_path, tp, cp):
    plan = _tp_plan(tp=tp, cp=cp)
    config, par = _accelerate_objects(plan, tmp_path)
    layout = resolve(plan)
    assert par.total_size == config.num_processes == plan.cluster.world_size
    assert (par.tp_size, par.cp_size, par.dp_shard_size, par.dp_replicate_size) == (tp, cp, layout.dp_shard,
                                                                                      layout.dp_replicate)
    assert config.fsdp_config["fsdp_version"] == 2


def test_fits_own_2d_pick_goes_through_accelerate(tmp_path):
    result = fit(FitRequest.build(load_model_spec("llama-3.1-405b"), gpu="H100-80GB", gpus_per_node=8, nodes=128,
                                  seq_len=8192, global_batch=2048))
    plan = result.best.plan
    if plan.parallelism.pp > 1:
        with pytest.raises(ShardfitError, match="no pipeline dimension"):
            emit(plan, "accelerate")
        return
    assert plan.parallelism.model_parallel > 1
    _, par = _accelerate_objects(plan, tmp_path)
    assert par.tp_size * par.cp_size * par.dp_shard_size * par.dp_replicate_size == 1024


def test_pipeline_and_data_parallel_formats_refuse_in_one_line():
    with pytest.raises(ShardfitError, match="no pipeline dimension") as info:
        emit(_tp_plan(tp=8, pp=2), "accelerate")
    assert "`--pp 2`" in str(info.value)
    moe = Plan(model=load_model_spec("mixtral-8x7b")).with_changes(
        strategy=Strategy(kind="fsdp2"), cluster={"nodes": 8, "gpus_per_node": 8},
        training={"micro_batch": 1, "seq_len": 4096}, parallelism=Parallelism(tp=2, ep=4))
    with pytest.raises(ShardfitError, match="no expert-parallel dimension and this plan has ep=4"):
        emit(moe, "accelerate")  # accelerate would run it without EP: refused, not written silently
    with pytest.raises(ShardfitError, match="without pp / cp / ep"):
        emit(moe, "fsdp2")
    for fmt in ("fsdp", "deepspeed", "hf-trainer", "lightning"):
        with pytest.raises(ShardfitError, match="data-parallel setup"):
            emit(_tp_plan(), fmt)


def test_launch_lines_need_your_script_and_carry_the_world(tmp_path):
    with pytest.raises(ShardfitError, match="--entry"):
        emit(_tp_plan(cp=2), "torchrun")  # context parallel: `shardfit train` does not run it
    options = EmitOptions(entry="train.py")
    run = emit(_tp_plan(cp=2), "torchrun", options)
    assert "--nnodes 8 --nproc-per-node 8" in run.main and run.main.rstrip().endswith("train.py")
    assert any(n.startswith("layout dp_replicate=1 dp_shard=16 tp=2+sp cp=2") for n in run.notes)
    slurm = emit(_tp_plan(cp=2), "slurm", options).main
    assert "--nodes=8" in slurm.replace(" ", "") or "#SBATCH --nodes=8" in slurm
    assert "train.py" in slurm


def test_launch_lines_run_shardfit_train_for_a_plan_it_trains():
    """FSDP2 x TP, with or without sequence parallel, with the gathered-logits head or the vocab-parallel
    loss, is what `shardfit train` runs (its 4-rank test: tests/train/test_train_tensor_parallel.py): no
    --entry needed; inside a pipeline stage too."""
    for parallelism in (Parallelism(tp=2, loss_parallel=False), Parallelism(tp=2)):
        run = emit(_tp_plan().with_changes(parallelism=parallelism), "torchrun")
        assert "-m shardfit train" in run.main and "--nproc-per-node 8" in run.main
    staged = _tp_plan().with_changes(parallelism=Parallelism(tp=2, pp=2),
                                     training={"micro_batch": 1, "grad_accum": 8, "seq_len": 4096,
                                               "activation_checkpointing": "none", "precision": "bf16"})
    assert "-m shardfit train" in emit(staged, "torchrun").main  # the pipeline engine's stages run it too
    sequence = staged.with_changes(parallelism=Parallelism(tp=2, pp=2, sequence_parallel=True))
    assert "-m shardfit train" in emit(sequence, "torchrun").main


def test_data_parallel_plans_emit_as_before():
    plan = _tp_plan(tp=1).with_changes(parallelism=Parallelism())
    config = yaml.safe_load(emit(plan, "accelerate").main)
    assert "parallelism_config" not in config


def _tiny_fsdp2_plan(tp: int, ranks: int, loss_parallel: bool = False) -> Plan:
    from shardfit.spec.plan import Cluster, Schedule, Training

    return Plan(model=load_model_spec("tiny-llama"), strategy=Strategy(kind="fsdp2"),
                training=Training(micro_batch=2, grad_accum=2, seq_len=32, precision="fp32", activation_checkpointing="full"),
                cluster=Cluster(nodes=1, gpus_per_node=ranks, gpu="custom:1"),
                schedule=Schedule(steps=4, log_every=1, save_every=2),
                parallelism=Parallelism(tp=tp, loss_parallel=loss_parallel) if tp > 1 else Parallelism())


def _step_losses(stdout: str) -> dict[int, float]:
    import re

    return {int(step): float(loss) for step, loss in re.findall(r"step (\d+) loss ([0-9.]+)", stdout)}


@pytest.mark.multirank
@pytest.mark.slow
def test_emitted_fsdp2_tp_script_trains_on_4_cpu_ranks_and_resumes_on_another_mesh(tmp_path):
    # A 2 x 2 (dp, tp) mesh on gloo: the script fit's FSDP2 x TP plans emit as, run for real, short. Its
    # step-2 DCP checkpoint then resumes in the script of a dp=2 x tp=1 plan on 2 ranks: DCP reshards the
    # (dp, tp) DTensors of weights and AdamW moments onto the 1-D mesh (get_state_dict / set_state_dict).
    # The dp ranks read the same data in both runs, so steps 3 and 4 must repeat run 1's losses.
    import re
    import shutil

    from launch import test_env, torchrun

    out = emit(_tiny_fsdp2_plan(tp=2, ranks=4), "fsdp2")
    assert any("tp=2" in n for n in out.notes)
    script = tmp_path / "train_fsdp2.py"
    script.write_text(out.main)
    assert "TP = 2" in out.main and "parallelize_module" in out.main
    result = torchrun([str(script)], nproc=4, timeout=240, env=test_env(STEPS="4", CHECKSUM="1"), cwd=tmp_path)
    losses = _step_losses(result.stdout)
    assert sorted(losses) == [0, 1, 2, 3] and all(0 < loss < 20 for loss in losses.values())
    assert losses[3] < losses[0]
    checksums = {int(r): float(v) for r, v in re.findall(r"rank (\d) checksum (-?[0-9.]+)", result.stdout)}
    assert set(checksums) == {0, 1, 2, 3}
    assert (tmp_path / "out" / "checkpoints" / "step-2" / ".metadata").is_file()  # DCP, of the 2-D mesh
    assert list((tmp_path / "out" / "export").glob("*.safetensors"))  # and the gathered export

    # The plan's default vocab-parallel loss (torch's loss_parallel on the sharded logits): the same losses.
    vocab = tmp_path / "vocab"
    vocab.mkdir()
    (vocab / "train_fsdp2.py").write_text(emit(_tiny_fsdp2_plan(tp=2, ranks=4, loss_parallel=True), "fsdp2").main)
    assert "LOSS_PARALLEL = True" in (vocab / "train_fsdp2.py").read_text()
    sharded = torchrun([str(vocab / "train_fsdp2.py")], nproc=4, timeout=240, cwd=vocab,
                       env=test_env(STEPS="4", SAVE_EVERY="0", EXPORT_DIR=""))
    assert _step_losses(sharded.stdout) == {step: pytest.approx(loss, abs=2e-4) for step, loss in losses.items()}

    resume = tmp_path / "resume"
    shutil.copytree(tmp_path / "out" / "checkpoints" / "step-2", resume / "checkpoints" / "step-2")
    other = emit(_tiny_fsdp2_plan(tp=1, ranks=2), "fsdp2").main
    assert "TP = 1" in other
    (resume / "train_fsdp2.py").write_text(other)
    again = torchrun([str(resume / "train_fsdp2.py")], nproc=2, timeout=180, cwd=resume,
                     env=test_env(STEPS="4", CKPT_DIR=str(resume / "checkpoints"), EXPORT_DIR=""))
    assert f"resumed from {resume / 'checkpoints' / 'step-2'} at step 2" in again.stdout
    resumed = _step_losses(again.stdout)
    assert sorted(resumed) == [2, 3]  # the printed losses have 4 decimals
    assert resumed == {step: pytest.approx(losses[step], abs=2e-4) for step in (2, 3)}, (losses, resumed)


@pytest.mark.multirank
@pytest.mark.slow
def test_emitted_tp_script_runs_a_plan_with_per_head_norms(tmp_path):
    """Qwen3's TP plan keeps its per-head q_norm / k_norm whole with their gradients all-reduced over tp
    (`replicated_with_grad_allreduce`): the emitted script installs transformers' own class for it (the
    engine's losses with the same hooks equal plain torch: tests/engines/test_tensor_parallel.py) and
    trains on a dp 2 x tp 2 mesh."""
    import json

    from launch import test_env, torchrun
    from shardfit.spec.plan import Cluster, Schedule, Training
    from shardfit.spec.tiny import tiny_config

    (tmp_path / "qwen3").mkdir()
    (tmp_path / "qwen3" / "config.json").write_text(json.dumps(tiny_config("qwen3")))
    plan = Plan(model=load_model_spec(str(tmp_path / "qwen3")), strategy=Strategy(kind="fsdp2"),
                training=Training(micro_batch=2, grad_accum=1, seq_len=32, precision="fp32"),
                cluster=Cluster(nodes=1, gpus_per_node=4, gpu="custom:1"), schedule=Schedule(steps=3, log_every=1),
                parallelism=Parallelism(tp=2, loss_parallel=False))
    script = emit(plan, "fsdp2").main
    assert "replicated_with_grad_allreduce" in script
    (tmp_path / "train.py").write_text(script)
    result = torchrun([str(tmp_path / "train.py")], nproc=4, timeout=180, cwd=tmp_path,
                      env=test_env(STEPS="3", CKPT_DIR=str(tmp_path / "ckpt"), EXPORT_DIR=""))
    losses = _step_losses(result.stdout)
    assert sorted(losses) == [0, 1, 2] and losses[2] < losses[0], result.stdout
