"""The fit / emit / doctor commands: real CLI subprocesses, one-line errors with exit 2, no partial
files, no torch import."""
import json
import subprocess
import sys

from launch import shardfit
from shardfit.spec.models import load_model_spec
from shardfit.spec.plan import Cluster, Plan, Training, parse_strategy
from shardfit.spec.planfile import dump_plan, load_plan


def one_line_error(result):
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("shardfit: error: "), result.stderr
    return lines[0]


def test_fit_writes_a_plan_that_emit_turns_into_configs(tmp_path):
    plan_path = tmp_path / "plan.yaml"
    result = shardfit("fit", "llama-3.1-8b", "--gpu", "H100-80GB", "--gpus", "8", "--seq", "4096",
                      "--global-batch", "512", "--engine", "deepspeed", "-o", str(plan_path))
    assert "best: zero" in result.stdout and "why not the others:" in result.stdout
    plan = load_plan(plan_path)
    assert plan.strategy.is_deepspeed and plan.global_batch == 512
    out = tmp_path / "out"
    shardfit("emit", str(plan_path), "--format", "deepspeed", "-o", str(out) + "/")
    config = json.loads((out / "ds_config.json").read_text())
    assert config["train_batch_size"] == 512 and config["zero_optimization"]["stage"] == int(plan.strategy.kind[-1])
    launch = shardfit("emit", str(plan_path), "--format", "deepspeed-launcher", "-o", str(out))
    assert (out / "hostfile").read_text() == "localhost slots=8\n" and "wrote" in launch.stderr
    printed = shardfit("emit", str(plan_path), "--format", "slurm").stdout
    assert printed.startswith("#!/bin/bash") and f"train {plan_path}" in printed
    as_json = json.loads(shardfit("fit", "llama-3.1-8b", "--gpus", "8", "--json").stdout)
    assert as_json["fits"] and as_json["plan"]["strategy"]["kind"] == as_json["best"]["strategy"].split("+")[0].split(":")[0]


def test_fit_when_nothing_fits_exits_1_and_writes_nothing(tmp_path):
    target = tmp_path / "plan.yaml"
    result = shardfit("fit", "llama-3.1-405b", "--gpu", "RTX-4090", "--gpus", "1", "--seq", "8192",
                      "-o", str(target), check=False)
    assert result.returncode == 1 and "NOTHING FITS" in result.stdout and "shorter sequence" in result.stdout
    assert not target.exists()


def test_bad_input_is_one_line_exit_2_and_no_output_file(tmp_path):
    target = tmp_path / "plan.yaml"
    err = one_line_error(shardfit("fit", "tiny-llama", "--gpus", "8", "--global-batch", "100", "-o", str(target),
                                  check=False))
    assert "--global-batch 100 is not a multiple of the 8 GPUs" in err and not target.exists()
    assert "unknown GPU" in one_line_error(shardfit("fit", "tiny-llama", "--gpu", "H1000", check=False))
    assert "--engine" in one_line_error(shardfit("fit", "tiny-llama", "--engine", "megatron", check=False))
    plan_path = tmp_path / "fsdp.yaml"
    dump_plan(Plan(model=load_model_spec("tiny-llama"), strategy=parse_strategy("fsdp2"),
                   training=Training(), cluster=Cluster(gpus_per_node=2)), plan_path)
    out = tmp_path / "ds.json"
    assert "not DeepSpeed" in one_line_error(shardfit("emit", str(plan_path), "--format", "deepspeed", "-o", str(out),
                                                      check=False))
    assert "unknown format 'xml'" in one_line_error(shardfit("emit", str(plan_path), "--format", "xml", "-o", str(out),
                                                             check=False))
    assert "does not exist" in one_line_error(shardfit("emit", str(tmp_path / "nope.yaml"), "--format", "deepspeed",
                                                       check=False))
    assert not out.exists() and not [p for p in tmp_path.iterdir() if p.name.startswith(".")]
    assert "no such file" in one_line_error(shardfit("doctor", str(tmp_path / "nope.json"), check=False))


def test_doctor_exit_status_and_json(tmp_path):
    bad = tmp_path / "ds.json"
    bad.write_text(json.dumps({"train_batch_size": 100, "train_micro_batch_size_per_gpu": 2,
                               "gradient_accumulation_steps": 4, "zero_optimization": {"stage": 2}}))
    result = shardfit("doctor", str(bad), "--gpus", "8", check=False)
    assert result.returncode == 1 and "ERROR   batch-mismatch" in result.stdout and "fix:" in result.stdout
    data = json.loads(shardfit("doctor", str(bad), "--gpus", "8", "--json", check=False).stdout)
    assert data["files"] == [{"path": str(bad), "kind": "deepspeed"}]
    assert [f["rule"] for f in data["findings"]] == ["batch-mismatch"]
    good = tmp_path / "good.json"
    good.write_text(json.dumps({"train_batch_size": 64, "train_micro_batch_size_per_gpu": 2,
                                "gradient_accumulation_steps": 4, "bf16": {"enabled": True},
                                "zero_optimization": {"stage": 2}}))
    assert shardfit("doctor", str(good), "--gpus", "8").stdout.strip().endswith("no findings")


def test_the_analytic_commands_never_import_torch(tmp_path):
    plan_path = tmp_path / "plan.yaml"
    dump_plan(Plan(model=load_model_spec("tiny-llama"), strategy=parse_strategy("fsdp2")), plan_path)
    code = f"""
import io, contextlib, sys
from shardfit.cli import main
with contextlib.redirect_stdout(io.StringIO()):
    main(["fit", "llama-3.1-8b", "--gpus", "8"])
    main(["emit", {str(plan_path)!r}, "--format", "fsdp2"])
    main(["emit", {str(plan_path)!r}, "--format", "hf-trainer"])
    main(["doctor", {str(plan_path)!r}, "--gpu", "H100-80GB", "--model", "llama-3.1-8b"])
print(sorted(m for m in ("torch", "deepspeed", "transformers", "accelerate") if m in sys.modules))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "[]"


def test_verify_refuses_a_plan_this_machine_cannot_hold(tmp_path):
    target = tmp_path / "plan.yaml"
    err = one_line_error(shardfit("fit", "llama-3.1-8b", "--gpus", "8", "--verify", "-o", str(target), check=False))
    assert "--verify would need" in err and "verify on the target GPUs" in err and not target.exists()


def test_an_nvme_plan_is_written_only_with_a_real_mount(tmp_path):
    target = tmp_path / "nvme.yaml"
    args = ("fit", "llama-3.1-405b", "--gpus", "8", "--seq", "8192", "--host-memory-gib", "1000", "-o", str(target))
    err = one_line_error(shardfit(*args, check=False))
    assert "--nvme-path" in err and not target.exists()
    shardfit(*args, "--nvme-path", "/mnt/nvme0")
    plan = load_plan(target)
    assert plan.strategy.offload_params == "nvme" and plan.strategy.nvme_path == "/mnt/nvme0"
