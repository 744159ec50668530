"""What `shardfit emit` writes, run by the tools themselves on 2 CPU processes: `accelerate launch
--config_file <emitted>` with an HF Trainer script on the emitted TrainingArguments, a Lightning
Trainer with the emitted strategy, and the emitted `run_deepspeed.sh` + hostfile under DeepSpeed's own
launcher. Loss finite and falling; the measured peak within the plan's prediction +5%. Also HF's own
DeepSpeed-config check on the emitted TrainingArguments + JSON pair.

Not runnable on a CPU, by the tools' own rules: the HF Trainer with FSDP ("Using fsdp only works in
distributed training" without a GPU; with use_cpu accelerate runs DDP instead, which the callback
names) or DeepSpeed (the Trainer is not distributed without a GPU), and Lightning's FSDPStrategy /
DeepSpeedStrategy on the CPU accelerator (refused; FSDP1 then needs a device)."""
from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest
from launch import deepspeed_launcher, free_port, run, test_env as rank_env, torchrun

from shardfit.emit import EmitOptions, emit, write_files
from shardfit.estimate.estimator import estimate
from shardfit.spec.models import model_spec_for
from shardfit.spec.plan import plan_from_dict
from shardfit.spec.planfile import dump_plan

HERE = Path(__file__).parent
ACCELERATE = str(Path(sys.executable).with_name("accelerate"))


def _plan(kind: str, gpus: int = 2, steps: int = 4):
    return plan_from_dict({"model": "tiny-llama", "strategy": {"kind": kind}, "cluster": {"gpus_per_node": gpus},
                           "training": {"micro_batch": 4, "seq_len": 64, "precision": "fp32"},
                           "schedule": {"steps": steps, "lr": 3e-3, "warmup_steps": 0}}, resolve_model=model_spec_for)


def _falls(losses):
    assert len(losses) >= 4 and all(math.isfinite(x) for x in losses), losses
    assert losses[-1] < losses[0], losses


@pytest.mark.multirank
@pytest.mark.parametrize("kind", ["ddp", "fsdp2"])
def test_accelerate_launch_runs_the_emitted_config_with_an_hf_trainer(tmp_path, kind):
    plan = _plan(kind)
    config = tmp_path / "accelerate.yaml"
    config.write_text(emit(plan, "accelerate").main)
    args = json.loads(emit(plan, "hf-trainer").main)
    args.pop("output_dir")
    args.update(logging_steps=1, use_cpu=True)  # no GPU here: the Trainer's CPU switch
    out = tmp_path / "run"
    run([ACCELERATE, "launch", "--config_file", str(config), "--main_process_port", str(free_port()),
         str(HERE / "hf_trainer_script.py"), str(out), json.dumps(args)], timeout=150,
        env=rank_env(SHARDFIT_TEST_SAMPLES="8"))
    _falls(json.loads((out / "losses.json").read_text())["losses"])
    report = json.loads((out / "shardfit-memory.json").read_text())
    assert report["world_size"] == 2
    if kind == "fsdp2":
        # accelerate on CPU drops FSDP and runs DDP: the callback sizes what runs, and says so.
        assert report["strategy"] == "ddp" and "TrainingArguments ask for fsdp2 but accelerate runs ddp" in report["assumed"][0]
        plan = _plan("ddp")
    predicted = estimate(plan, device="cpu").peak_bytes
    assert report["measured_peak_bytes"] <= 1.05 * predicted, (report["measured_peak_bytes"], predicted)


@pytest.mark.multirank
@pytest.mark.parametrize("kind", ["ddp", "fsdp2"])
def test_lightning_runs_the_emitted_strategy(tmp_path, kind):
    plan = _plan(kind)
    strategy = tmp_path / "lightning_strategy.py"
    strategy.write_text(emit(plan, "lightning").main)
    out = tmp_path / "run"
    torchrun([str(HERE / "lightning_script.py"), str(out), str(strategy)], timeout=150,
             env=rank_env(SHARDFIT_TEST_SAMPLES="8", SHARDFIT_TEST_LR="3e-3"))
    _falls(json.loads((out / "losses.json").read_text())["losses"])
    report = json.loads((out / "shardfit-memory.json").read_text())
    assert report["strategy"] == kind and report["world_size"] == 2
    # The plan's prediction plus Lightning's own loop term (its late zero_grad keeps one gradient copy
    # through the forward): without it the forward would be under-predicted by exactly that copy.
    predicted = estimate(plan, device="cpu")
    grads = predicted.phases["optimizer"]["grads"]
    assert report["predicted_peak_bytes"] <= predicted.peak_bytes + grads
    assert report["measured_peak_bytes"] <= 1.05 * report["predicted_peak_bytes"], report["comparison"]["peak"]


@pytest.mark.parametrize("kind", ["zero2", "zero3"])
def test_hf_accepts_the_emitted_trainingarguments_and_deepspeed_json_together(tmp_path, kind):
    transformers = pytest.importorskip("transformers")
    args = json.loads(emit(_plan(kind, gpus=1), "hf-trainer").main)
    args["output_dir"] = str(tmp_path)
    training_args = transformers.TrainingArguments(**args)
    checked = training_args.hf_deepspeed_config  # HF's own comparison of the JSON with the arguments
    assert checked.mismatches == [], checked.mismatches


@pytest.mark.multirank
@pytest.mark.deepspeed
@pytest.mark.slow
def test_deepspeed_launcher_runs_the_emitted_script_and_hostfile(tmp_path):
    pytest.importorskip("deepspeed")
    # Small buckets: DeepSpeed's 5e8-element defaults would allocate ~1 GB per rank for a 0.2M model.
    plan = plan_from_dict({"model": "tiny-llama", "cluster": {"gpus_per_node": 2},
                           "strategy": {"kind": "zero2", "reduce_bucket_size": 4096, "allgather_bucket_size": 4096},
                           "training": {"micro_batch": 4, "seq_len": 64, "precision": "fp32"},
                           "schedule": {"steps": 6, "lr": 3e-3, "warmup_steps": 0, "log_every": 1}},
                          resolve_model=model_spec_for)
    dump_plan(plan, tmp_path / "plan.yaml")
    # The emitted entry as it is: `deepspeed --hostfile hostfile ... --module shardfit train plan.yaml`.
    write_files(emit(plan, "deepspeed-launcher", EmitOptions(master_port=free_port())).files, tmp_path, single=False)
    # A budget far above the run makes shardfit train's tracker count every rank's tensors (on a CPU
    # nothing else does): its peak is what the metrics report.
    done = deepspeed_launcher(tmp_path / "run_deepspeed.sh", timeout=240,
                              env=rank_env(SHARDFIT_MEMORY_BUDGET="8GiB"))
    assert "--hostfile hostfile" in (tmp_path / "run_deepspeed.sh").read_text()
    assert "deepspeed.launcher.launch" in done.stdout + done.stderr  # the runner's own local launch
    records = [json.loads(line) for line in (tmp_path / "shardfit-run" / "metrics.jsonl").read_text().splitlines()]
    _falls([r["loss"] for r in records])
    assert all(r["tokens"] == 4 * 64 * 2 for r in records)  # a micro-batch from each of the 2 ranks
    measured = max(r["peak_mem_bytes"] for r in records)
    predicted = estimate(plan, device="cpu").peak_bytes
    assert 0 < measured <= 1.05 * predicted, (measured, predicted)


@pytest.mark.multirank
@pytest.mark.deepspeed
@pytest.mark.slow
def test_deepspeed_launcher_runs_a_loop_on_the_emitted_ds_config(tmp_path):
    """`--entry` with the emitted ds_config.json: DeepSpeed builds the optimizer the JSON names (its
    FusedAdam, a compiled op the ranks must load, not rebuild)."""
    pytest.importorskip("deepspeed")
    plan = plan_from_dict({"model": "tiny-llama", "cluster": {"gpus_per_node": 2},
                           "strategy": {"kind": "zero2", "reduce_bucket_size": 4096, "allgather_bucket_size": 4096},
                           "training": {"micro_batch": 4, "seq_len": 64, "precision": "fp32"},
                           "schedule": {"steps": 6, "lr": 3e-3, "warmup_steps": 0}}, resolve_model=model_spec_for)
    write_files(emit(plan, "deepspeed").files, tmp_path, single=False)
    entry = f"{HERE / 'ds_config_script.py'} ds_config.json {tmp_path / 'out'} 6"
    write_files(emit(plan, "deepspeed-launcher", EmitOptions(entry=entry, master_port=free_port())).files, tmp_path,
                single=False)
    deepspeed_launcher(tmp_path / "run_deepspeed.sh", timeout=240)
    result = json.loads((tmp_path / "out" / "result.json").read_text())
    _falls(result["losses"])  # the first step runs at lr 0: WarmupCosineLR's own start
    assert (result["stage"], result["world"], result["optimizer"]) == (2, 2, "FusedAdam")
    measured = max(result["peak_by_rank"])
    predicted = estimate(plan, device="cpu").peak_bytes
    assert 0 < measured <= 1.05 * predicted, (measured, predicted)
