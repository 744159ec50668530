"""Bad plans never crash: the Plan loader (plan_from_dict, YAML/JSON plan files) fuzzed, and plan
files through the CLI. The contract and the shared runner are in fuzz_helpers.py."""
from __future__ import annotations

import json
import tempfile
from pathlib import Path

import pytest
import yaml
from hypothesis import given, settings, strategies as st

from fuzz_helpers import BASE_PLAN, FUZZ, VALUES, assert_clean, assert_one_line_error, cli
from fuzz_helpers import no_launch  # noqa: F401 - autouse fixture: no command here starts torchrun
from shardfit.errors import ShardfitError
from shardfit.spec.models import load_model_spec
from shardfit.spec.plan import Cluster, Data, Plan, Schedule, Strategy, Training, plan_from_dict
from shardfit.spec.planfile import load_plan

SECTIONS = {"strategy": Strategy, "training": Training, "cluster": Cluster, "schedule": Schedule, "data": Data}
FIELDS = [(section, f) for section, cls in SECTIONS.items() for f in cls.__dataclass_fields__] + [
    ("training", "lora"), ("strategy", "no_such_field"), (None, "no_such_section")]
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
