"""Bad input never crashes: the Plan loader and every CLI command, fuzzed.

Contract checked everywhere: a rejected input exits non-zero with exactly ONE line on stderr
(`shardfit: error: ...`), never a traceback and never `internal error` (that line means an
exception escaped the validation: a bug), and never leaves a partial output file behind.
Nothing here launches training: the launchers are replaced by a sentinel that stops the command
at the point where validation is over, so an input that reaches it was *accepted*.
"""
from __future__ import annotations

import contextlib
import io
import json
import os
import tempfile
from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, given, settings, strategies as st

from shardfit.cli import main
from shardfit.errors import ShardfitError
from shardfit.spec.models import load_model_spec
from shardfit.spec.plan import Cluster, Data, LoRA, Plan, Schedule, Strategy, Training, plan_from_dict
from shardfit.spec.planfile import load_plan

FUZZ = settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)


class WouldLaunch(BaseException):
    """Raised instead of starting torchrun: BaseException so the CLI's last-resort handler lets it by."""


@pytest.fixture(autouse=True)
def no_launch(monkeypatch):
    import shardfit.bench.run as bench_run
    import shardfit.commands.profile as profile_cmd
    import shardfit.train.launch as train_launch

    def stop(*args, **kwargs):
        raise WouldLaunch()

    import shardfit.train.supervise as supervise

    # NOTE: the torchrun start itself: everything `shardfit train` checks before it still runs.
    monkeypatch.setattr(train_launch.subprocess, "call", stop)
    monkeypatch.setattr(supervise, "relaunch", stop)
    monkeypatch.setattr(profile_cmd, "_launch", stop)
    monkeypatch.setattr(bench_run, "bench", stop)
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)


def cli(*argv: str) -> tuple[int | str, str, str]:
    """Run the CLI in-process; rc is 'launch' when the input passed validation and would train."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            rc = main([str(a) for a in argv])
        except WouldLaunch:
            rc = "launch"
    return rc, out.getvalue(), err.getvalue()


def assert_one_line_error(rc, err: str, argv=()) -> str:
    lines = [line for line in err.splitlines() if line.strip()]
    assert rc not in (0, "launch"), f"accepted bad input {list(argv)}: rc={rc}"
    assert "Traceback" not in err, f"traceback for {list(argv)}:\n{err}"
    assert len(lines) == 1, f"{list(argv)}: expected one line on stderr, got {len(lines)}:\n{err}"
    assert lines[0].startswith("shardfit: error: "), f"{list(argv)}: {lines[0]}"
    assert "internal error" not in lines[0], f"{list(argv)}: {lines[0]}"
    return lines[0]


def assert_clean(rc, err: str, argv=()) -> None:
    """Accepted or rejected, but never a crash."""
    if rc in (0, "launch"):
        assert "Traceback" not in err and "internal error" not in err, f"{list(argv)}:\n{err}"
    elif rc == 1 and not err.strip():
        pass  # an explicit negative answer ("nothing fits"), printed on stdout
    else:
        assert_one_line_error(rc, err, argv)


# ---- the Plan loader -----------------------------------------------------------------------------
BASE_PLAN = {
    "model": "tiny-llama",
    "strategy": {"kind": "ddp"},
    "training": {"micro_batch": 2, "seq_len": 64, "grad_accum": 1, "precision": "fp32"},
    "cluster": {"nodes": 1, "gpus_per_node": 2, "gpu": "H100-80GB"},
    "schedule": {"steps": 4, "lr": 1e-3},
    "data": {},
}
SECTIONS = {"strategy": Strategy, "training": Training, "cluster": Cluster, "schedule": Schedule, "data": Data}
FIELDS = [(section, f) for section, cls in SECTIONS.items() for f in cls.__dataclass_fields__] + [
    ("training", "lora"), ("strategy", "no_such_field"), (None, "no_such_section")]
BAD_WORDS = ["", "zero9", "fsdp3", "H900", "custom:-4", "custom:abc", "nvme", "every-0", "every-x", "bf17",
             "!!python/object:os.system", "-1", "1e400", "nan", "inf", "\x00", "é" * 3, "a" * 300]
VALUES = st.one_of(
    st.integers(min_value=-(2**70), max_value=2**70),
    st.sampled_from([0, -1, 1, 2**31, 2**63, 10**30]),
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from(BAD_WORDS),
    st.text(max_size=12),
    st.booleans(),
    st.none(),
    st.lists(st.integers(-3, 3), max_size=3),
    st.dictionaries(st.text(max_size=5), st.integers(-3, 3), max_size=2),
)
MODELS = st.one_of(
    st.sampled_from(["tiny-llama", "tiny-gpt2", "llama-2-7b", "no-such-model", "", "os:getcwd", "/nonexistent/config.json",
                     "../../etc/passwd"]),
    st.builds(lambda f, v: {**load_model_spec("tiny-llama").to_dict(), f: v},
              st.sampled_from(["n_params", "hidden_size", "num_layers", "num_heads", "vocab_size", "family",
                               "dropout", "block_params", "bogus"]), VALUES),
    VALUES,
)


@st.composite
def mutated_plans(draw):
    data = json.loads(json.dumps(BASE_PLAN))
    for _ in range(draw(st.integers(1, 3))):
        section, name = draw(st.sampled_from(FIELDS))
        value = draw(VALUES)
        if section is None:
            data[name] = value
        elif draw(st.integers(0, 9)) == 0:
            data[section] = value  # the whole section of the wrong type
        else:
            data.setdefault(section, {})
            if isinstance(data[section], dict):
                data[section][name] = value
    if draw(st.integers(0, 4)) == 0:
        data["model"] = draw(MODELS)
    return data


def _one_line(exc: ShardfitError) -> None:
    text = str(exc)
    assert text and "\n" not in text, f"multi-line error: {text!r}"


@FUZZ
@given(mutated_plans())
def test_plan_from_dict_accepts_or_rejects_in_one_line(data):
    try:
        plan = plan_from_dict(data, resolve_model=load_model_spec)
    except ShardfitError as exc:
        _one_line(exc)
        return
    assert isinstance(plan, Plan)
    t, c = plan.training, plan.cluster
    assert t.micro_batch >= 1 and t.seq_len >= 1 and t.grad_accum >= 1 and c.world_size >= 1


@settings(FUZZ, max_examples=10)
@given(mutated_plans(), st.sampled_from([".yaml", ".json"]))
def test_plan_files_through_the_cli(data, suffix):
    """A plan that loads must also estimate and emit without a crash; one that doesn't gives one line."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / f"plan{suffix}"
        try:
            text = json.dumps(data) if suffix == ".json" else yaml.safe_dump(data)
        except (ValueError, yaml.YAMLError):
            return
        path.write_text(text)
        for argv in (("plan", path, "--strategy", "ddp"), ("emit", path, "-f", "torchrun", "-o", Path(tmp) / "out.sh")):
            rc, _, err = cli(*argv)
            assert_clean(rc, err, argv)
            if rc != 0:
                assert not (Path(tmp) / "out.sh").exists(), f"partial output after a failure of {argv}"


MALFORMED = [
    "model: [tiny-llama\n", "model: {a: 1\n", "\t- x: 1\n:", "- 1\n- 2\n", "42\n",
    "'just a string'\n", "", "   \n", "model: tiny-llama\ntraining: 5\n", "model: tiny-llama\n\x00\n", "%YAML 9.9\n---\n",
    "&a [*a]\n", "model: &x tiny-llama\ntraining: *x\n", "? [a, b]\n: 1\n", "model: !!binary aGVsbG8=\n",
    "!!python/object/apply:os.system ['echo pwned']\n", "model: !!python/name:os.system\n",
    "!!python/object/new:subprocess.Popen [['true']]\n",
]


# Inputs the fuzzers found crashing (each was an `internal error` before it was fixed).
FOUND = [
    {"training": {"lora": 0}},
    {"training": {"lora": "rank=8"}},
    {"strategy": {"reduce_bucket_size": "1e400"}},
    {"strategy": {"ddp_bucket_cap_mb": float("nan")}},
    {"model": {**load_model_spec("tiny-llama").to_dict(), "hidden_size": ""}},
    {"model": {**load_model_spec("tiny-llama").to_dict(), "num_layers": -4}},
    {"model": "a" * 300},
    {"cluster": {"gpu": "1e400"}},
]


@pytest.mark.parametrize("change", FOUND, ids=[json.dumps(c, default=str)[:40] for c in FOUND])
def test_found_crashes_are_one_line_errors(change, tmp_path):
    data = json.loads(json.dumps(BASE_PLAN))
    for section, value in change.items():
        data[section] = {**data[section], **value} if isinstance(value, dict) and section != "model" else value
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(data))
    rc, _, err = cli("plan", path, "--strategy", "ddp")
    assert_one_line_error(rc, err, ("plan", change))


@pytest.mark.parametrize("text", MALFORMED)
def test_malformed_yaml_is_one_line(text, tmp_path):
    path = tmp_path / "plan.yaml"
    path.write_text(text)
    with pytest.raises(ShardfitError) as info:
        load_plan(path)
    _one_line(info.value)
    assert "plan.yaml" in str(info.value)


@FUZZ
@given(st.one_of(st.text(max_size=60), st.binary(max_size=60).map(lambda b: b.decode("latin-1"))),
       st.sampled_from([".yaml", ".json", ".yml"]))
def test_random_text_plan_files(text, suffix):
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / f"p{suffix}"
        path.write_text(text, errors="surrogateescape")
        try:
            load_plan(path)
        except ShardfitError as exc:
            _one_line(exc)


def test_python_tags_never_execute(tmp_path):
    """A plan file can't run code: PyYAML's python/* tags are refused by safe_load, in one line."""
    marker = tmp_path / "pwned"
    path = tmp_path / "evil.yaml"
    path.write_text(f"!!python/object/apply:os.system ['touch {marker}']\n")
    for command in ("plan", "emit", "train", "profile", "bench", "doctor"):
        argv = (command, path) + (("-f", "torchrun") if command == "emit" else ())
        rc, _, err = cli(*argv)
        line = assert_one_line_error(rc, err, argv)
        assert "evil.yaml" in line and "python" in line, line
    assert not marker.exists()


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
             "--lora-base-dtype", "--offload", "--shard-group-size", "--accounting", "--device", "--checkpoint"],
    "fit": ["--gpu", "--gpus", "--nodes", "--seq", "--global-batch", "--lora-r", "--lora-base", "--margin", "--precision",
            "--optimizer", "--engine", "--host-memory-gib", "--top", "--steps"],
    "train": ["--model", "--strategy", "--precision", "--steps", "--micro-batch", "--seq", "--grad-accum", "--ac", "--lr",
              "--seed", "--lora-rank", "--shard-group-size", "--log-every", "--eval-every", "--save-every", "--keep",
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
