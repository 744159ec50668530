"""Bad arguments never crash: every command with bad flags and files, a few real subprocesses, and
doctor on mutated DeepSpeed / Accelerate / TrainingArguments configs. The contract and the shared
runner are in fuzz_helpers.py."""
from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

import pytest
import yaml
from hypothesis import given, strategies as st

from fuzz_helpers import BAD_WORDS, BASE_PLAN, FUZZ, VALUES, assert_clean, assert_one_line_error, cli
from fuzz_helpers import no_launch  # noqa: F401 - autouse fixture: no command here starts torchrun


# ---- every command with bad arguments ------------------------------------------------------------
def _files(tmp: Path) -> dict:
    (tmp / "evil.yaml").write_text("!!python/object/apply:os.system ['true']\n")
    (tmp / "neg.yaml").write_text("model: tiny-llama\ntraining: {micro_batch: -3}\n")
    (tmp / "trunc.json").write_text('{"model": ')
    (tmp / "list.yaml").write_text("- model\n")
    (tmp / "ok.yaml").write_text(yaml.safe_dump(BASE_PLAN))
    (tmp / "empty.yaml").write_text("")
    (tmp / "dir").mkdir()
    return {k: tmp / k for k in ("evil.yaml", "neg.yaml", "trunc.json", "list.yaml", "ok.yaml", "empty.yaml", "dir")}


BAD_ARGS = [
    # (argv, output path that must not exist afterwards or None)
    (["nope"], None),
    (["models", "no-such-model"], None),
    (["models", "--bogus"], None),
    (["plan", "no-such-model"], None),
    (["plan", "tiny-llama", "--gpus", "0"], None),
    (["plan", "tiny-llama", "--gpus", "-3"], None),
    (["plan", "tiny-llama", "--gpus", "eight"], None),
    (["plan", "tiny-llama", "--seq", "-1", "--strategy", "ddp"], None),
    (["plan", "tiny-llama", "--gpu", "H900"], None),
    (["plan", "tiny-llama", "--gpu", "custom:-1"], None),
    (["plan", "tiny-llama", "--gpu", "custom:nan"], None),
    (["plan", "tiny-llama", "--strategy", "zero9"], None),
    (["plan", "tiny-llama", "--strategy", "ddp+offload"], None),
    (["plan", "tiny-llama", "--offload", "nvme"], None),
    (["plan", "tiny-llama", "--micro-batch", "99999999999999", "--strategy", "ddp"], None),
    (["plan", "tiny-llama", "--ac", "every-0", "--strategy", "ddp"], None),
    (["plan", "--params", "-5"], None),
    (["plan", "--params", "nan"], None),
    (["plan", "--params", "inf"], None),
    (["plan", "--params", "1e9", "--largest-layer", "nan"], None),
    (["plan", "tiny-llama", "--strategy="], None),
    (["plan", "tiny-llama", "--gpu=1e400"], None),
    (["plan", "a" * 300], None),
    (["plan", "{evil.yaml}"], None),
    (["plan", "{neg.yaml}"], None),
    (["plan", "{trunc.json}"], None),
    (["plan", "{dir}"], None),
    (["fit", "tiny-llama", "--gpus", "0", "-o", "{out}/fit.yaml"], "fit.yaml"),
    (["fit", "tiny-llama", "--margin", "1.5", "-o", "{out}/fit.yaml"], "fit.yaml"),
    (["fit", "tiny-llama", "--margin", "nan", "-o", "{out}/fit.yaml"], "fit.yaml"),
    (["fit", "tiny-llama", "--seq", "-2", "-o", "{out}/fit.yaml"], "fit.yaml"),
    (["fit", "tiny-llama", "--global-batch", "-4", "-o", "{out}/fit.yaml"], "fit.yaml"),
    (["fit", "tiny-llama", "--gpu", "custom:0", "-o", "{out}/fit.yaml"], "fit.yaml"),
    (["fit", "tiny-llama", "--lora-r", "-1", "-o", "{out}/fit.yaml"], "fit.yaml"),
    (["fit", "tiny-llama", "--engine", "tpu", "-o", "{out}/fit.yaml"], "fit.yaml"),
    (["fit", "tiny-llama", "-o", "{out}/missing-dir/fit.yaml"], "missing-dir/fit.yaml"),
    (["fit", "no-such-model", "-o", "{out}/fit.yaml"], "fit.yaml"),
    (["emit", "{evil.yaml}", "-f", "deepspeed", "-o", "{out}/ds.json"], "ds.json"),
    (["emit", "{neg.yaml}", "-f", "deepspeed", "-o", "{out}/ds.json"], "ds.json"),
    (["emit", "{ok.yaml}", "-f", "no-such-format", "-o", "{out}/x.json"], "x.json"),
    (["emit", "{ok.yaml}", "-f", "deepspeed", "-o", "{out}/ds.json"], "ds.json"),  # ddp plan: not DeepSpeed
    (["emit", "{ok.yaml}", "-f", "torchrun", "--master-port", "-1", "-o", "{out}/run.sh"], "run.sh"),
    (["emit", "{ok.yaml}", "-f", "torchrun", "--master-port", "70000", "-o", "{out}/run.sh"], "run.sh"),
    (["emit", "{empty.yaml}", "-f", "torchrun"], None),
    (["emit", "{list.yaml}", "-f", "torchrun"], None),
    (["emit", "/nonexistent/plan.yaml", "-f", "torchrun"], None),
    (["doctor", "/nonexistent.json"], None),
    (["doctor", "{trunc.json}"], None),
    (["doctor", "{dir}"], None),
    (["doctor", "{ok.yaml}", "--gpus", "-1"], None),
    (["doctor", "{ok.yaml}", "--gpu", "H900"], None),
    (["doctor", "{ok.yaml}", "--model", "no-such-model"], None),
    (["profile", "{evil.yaml}"], None),
    (["profile", "{neg.yaml}"], None),
    (["profile", "--nproc", "0"], None),
    (["profile", "--steps", "0"], None),
    (["profile", "--steps", "-1"], None),
    (["profile", "--budget", "-5"], None),
    (["profile", "--budget", "nan"], None),
    (["profile", "--timeout", "-1"], None),
    (["profile", "--micro-batch", "0"], None),
    (["profile", "--strategy", "zero9"], None),
    (["profile", "--model", "no-such-model"], None),
    (["profile", "--script", "/nonexistent.py"], None),
    (["profile", "--chart", "{out}/missing-dir/c.png"], "missing-dir/c.png"),
    (["profile", "--bucket=1e400"], None),
    (["bench", "{evil.yaml}", "--out", "{out}/bench"], "bench"),
    (["bench", "--steps", "1", "--out", "{out}/bench"], "bench"),
    (["bench", "--strategies", "zero9", "--out", "{out}/bench"], "bench"),
    (["bench", "--strategies", "ddp,ddp", "--out", "{out}/bench"], "bench"),
    (["bench", "--nproc", "0", "--out", "{out}/bench"], "bench"),
    (["bench", "--timeout", "-1", "--out", "{out}/bench"], "bench"),
    (["bench", "--budget-bytes", "-3", "--out", "{out}/bench"], "bench"),
    (["bench", "--budget-bytes", "zero9=100", "--out", "{out}/bench"], "bench"),
    (["bench", "--budget-bytes=1e400", "--out", "{out}/bench"], "bench"),
    (["train", "{evil.yaml}", "--out", "{out}/run"], "run"),
    (["train", "{neg.yaml}", "--out", "{out}/run"], "run"),
    (["train", "{dir}", "--out", "{out}/run"], "run"),
    (["train", "--strategy", "zero9", "--out", "{out}/run"], "run"),
    (["train", "--micro-batch", "0", "--out", "{out}/run"], "run"),
    (["train", "--steps", "0", "--out", "{out}/run"], "run"),
    (["train", "--steps", "-1", "--out", "{out}/run"], "run"),
    (["train", "--lr", "nan", "--out", "{out}/run"], "run"),
    (["train", "--lr", "-1", "--out", "{out}/run"], "run"),
    (["train", "--seq", "0", "--out", "{out}/run"], "run"),
    (["train", "--ac", "every-x", "--out", "{out}/run"], "run"),
    (["train", "--precision", "fp8", "--out", "{out}/run"], "run"),
    (["train", "--model", "no-such-model", "--out", "{out}/run"], "run"),
    (["train", "--model=", "--out", "{out}/run"], "run"),
    (["train", "--lora-rank", "-2", "--out", "{out}/run"], "run"),
    (["train", "--keep", "-1", "--out", "{out}/run"], "run"),
    (["train", "--save-every", "-1", "--out", "{out}/run"], "run"),
    (["train", "--nproc", "0", "--out", "{out}/run"], "run"),
    (["train", "--nnodes", "2", "--out", "{out}/run"], "run"),  # multi-node without an endpoint
    (["train", "--data", "/nonexistent.txt", "--out", "{out}/run"], "run"),
    (["train", "--tokenizer", "/nonexistent-tok", "--out", "{out}/run"], "run"),
    (["train", "--resume", "/nonexistent", "--out", "{out}/run"], "run"),
    (["train", "--resume", "{dir}", "--out", "{out}/run"], "run"),
    (["train", "--strategy", "zero2", "--nan-policy", "skip", "--out", "{out}/run"], "run"),
    (["train", "--memory-budget", "-1", "--out", "{out}/run"], "run"),
    (["train", "--memory-budget", "nan", "--out", "{out}/run"], "run"),
    (["train", "--collective-timeout", "0", "--out", "{out}/run"], "run"),
    (["train", "--max-restarts", "-1", "--out", "{out}/run"], "run"),
    (["train", "--resume", "latest-valid", "--out", "{out}/run"], "run"),
    (["export", "/nonexistent", "--out", "{out}/hf"], "hf"),
    (["export", "{dir}", "--out", "{out}/hf"], "hf"),
    (["export", "{dir}", "--out", "{out}/hf", "--max-shard-gb", "-1"], "hf"),
    (["export", "{dir}"], None),
    (["convert", "/nonexistent", "--out", "{out}/conv"], "conv"),
    (["convert", "{dir}", "--out", "{out}/conv"], "conv"),
]


@pytest.mark.parametrize("argv,output", BAD_ARGS, ids=[" ".join(a[:4]) for a, _ in BAD_ARGS])
def test_bad_arguments_one_line_no_output(argv, output, tmp_path):
    files = _files(tmp_path)
    names = {k: str(v) for k, v in files.items()}
    names["out"] = str(tmp_path / "outputs")
    (tmp_path / "outputs").mkdir()
    for key, value in names.items():
        argv = [a.replace("{" + key + "}", value) for a in argv]
    rc, _, err = cli(*argv)
    line = assert_one_line_error(rc, err, argv)
    assert len(line) < 600, f"an error line should be readable, got {len(line)} characters"
    if output:
        assert not (tmp_path / "outputs" / output).exists(), f"partial output {output} left by {argv}"


COMMAND_FLAGS = {
    "plan": ["--gpus", "--nodes", "--seq", "--micro-batch", "--grad-accum", "--params", "--largest-layer", "--gpu",
             "--strategy", "--precision", "--optimizer", "--ac", "--attention", "--lora-r", "--lora-targets",
             "--lora-base", "--lora-base-dtype", "--offload", "--shard-group-size", "--accounting", "--device", "--checkpoint"],
    "fit": ["--gpu", "--gpus", "--nodes", "--seq", "--global-batch", "--lora-r", "--lora-targets", "--lora-base", "--margin", "--precision",
            "--optimizer", "--engine", "--host-memory-gib", "--top", "--steps"],
    "train": ["--model", "--strategy", "--precision", "--steps", "--micro-batch", "--seq", "--grad-accum", "--ac", "--lr",
              "--seed", "--lora-r", "--lora-rank", "--lora-targets", "--lora-base", "--shard-group-size", "--log-every", "--eval-every", "--save-every", "--keep",
              "--nan-policy", "--nproc", "--nnodes", "--node-rank", "--memory-budget", "--collective-timeout",
              "--max-restarts", "--resume"],
    "profile": ["--model", "--strategy", "--precision", "--micro-batch", "--seq", "--grad-accum", "--ac", "--bucket",
                "--steps", "--budget", "--nproc", "--timeout"],
    "bench": ["--strategies", "--steps", "--warmup", "--nproc", "--timeout", "--budget-bytes"],
}
FLAG_VALUES = st.one_of(st.sampled_from(BAD_WORDS + ["0", "-1", "2", "1e30", "-0.5", "ddp", "zero3+offload", "fp16"]),
                        st.integers(-(2**40), 2**40).map(str), st.floats(allow_nan=True).map(repr),
                        st.text(alphabet=st.characters(blacklist_categories=("Cs",)), max_size=8))


@FUZZ
@given(st.sampled_from(sorted(COMMAND_FLAGS)), st.data())
def test_random_flags_never_crash(command, data):
    flags = data.draw(st.lists(st.sampled_from(COMMAND_FLAGS[command]), min_size=1, max_size=3, unique=True))
    argv = [command] + (["tiny-llama"] if command in ("plan", "fit") else [])
    for flag in flags:
        value = data.draw(FLAG_VALUES)
        argv += [f"{flag}={value}"]  # `=` so a value starting with '-' stays a value
    with tempfile.TemporaryDirectory() as tmp:
        if command in ("train", "bench"):
            argv += ["--out", f"{tmp}/out"]
        rc, _, err = cli(*argv)
        assert_clean(rc, err, argv)
        if command in ("train", "bench") and rc not in (0, "launch"):
            assert not Path(f"{tmp}/out").exists(), f"partial output after {argv}"


# ---- a handful of real subprocesses: the installed entry point behaves the same ------------------
@pytest.mark.parametrize("argv", [["plan", "--params", "-1"], ["train", "--strategy", "zero9"],
                                  ["emit", "/nonexistent.yaml", "-f", "deepspeed"]])
def test_subprocess_one_line(argv):
    import launch

    result = launch.shardfit(*argv, check=False, timeout=60, env=launch.test_env(SHARDFIT_DEBUG=""))
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert result.returncode == 2 and len(lines) == 1 and lines[0].startswith("shardfit: error: "), result.stderr
    assert "Traceback" not in result.stderr


def test_no_debug_env_leaks():
    assert not os.environ.get("SHARDFIT_DEBUG"), "SHARDFIT_DEBUG=1 would turn errors into tracebacks here"


# ---- doctor reads other tools' configs: mutated DeepSpeed / Accelerate / TrainingArguments files ---
DS_CONFIG = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2, "train_batch_size": 64,
             "bf16": {"enabled": True}, "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"},
                                                              "reduce_bucket_size": 5e8}}
ACCELERATE = {"distributed_type": "FSDP", "num_processes": 8, "mixed_precision": "bf16",
              "fsdp_config": {"fsdp_sharding_strategy": "FULL_SHARD", "fsdp_offload_params": False}}
HF_ARGS = {"per_device_train_batch_size": 4, "gradient_accumulation_steps": 8, "bf16": True, "deepspeed": "ds.json",
           "gradient_checkpointing": True}
DOCTOR_FILES = [("ds_config.json", DS_CONFIG), ("accelerate.yaml", ACCELERATE), ("training_args.json", HF_ARGS)]


@st.composite
def mutated_config(draw):
    name, base = draw(st.sampled_from(DOCTOR_FILES))
    data = json.loads(json.dumps(base))
    for _ in range(draw(st.integers(1, 3))):
        target = data
        if draw(st.booleans()):
            nested = [k for k, v in data.items() if isinstance(v, dict)]
            if nested:
                target = data[draw(st.sampled_from(nested))]
        key = draw(st.one_of(st.sampled_from(sorted(target) or ["x"]), st.text(max_size=6)))
        target[key] = draw(VALUES)
    return name, data


@FUZZ
@given(mutated_config(), st.sampled_from([(), ("--gpu", "A100-80GB", "--model", "llama-2-7b", "--gpus", "8")]))
def test_doctor_on_mutated_configs(config, extra):
    name, data = config
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / name
        try:
            path.write_text(yaml.safe_dump(data) if name.endswith(".yaml") else json.dumps(data))
        except (ValueError, yaml.YAMLError):
            return
        rc, _, err = cli("doctor", path, *extra)
        if rc in (0, 1):  # a report (1: error-severity findings): never a crash
            assert "internal error" not in err and "Traceback" not in err, err
        else:
            assert_one_line_error(rc, err, ("doctor", name, data))


def test_doctor_control_characters_stay_one_line(tmp_path):
    path = tmp_path / "training_args.json"
    path.write_text(json.dumps({**HF_ARGS, "deepspeed": "bad\rname\nhere.json"}))
    rc, _, err = cli("doctor", path)
    assert_one_line_error(rc, err, ("doctor", "control characters"))
