"""Plan files: load a Plan from YAML/JSON, write one back atomically. Errors are one line."""
from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

from shardfit.errors import ShardfitError
from shardfit.spec.plan import Plan, plan_from_dict


def _resolver(ref: str):
    from shardfit.spec.models import load_model_spec
    return load_model_spec(ref)


def read_plan_data(path) -> dict:
    """The raw mapping inside a plan file (YAML or JSON by extension; YAML also reads JSON)."""
    file = Path(path)
    try:
        text = file.read_text()
    except FileNotFoundError:
        raise ShardfitError(f"plan file {file} does not exist: check the path") from None
    except IsADirectoryError:
        raise ShardfitError(f"{file} is a directory, not a plan file (.yaml or .json)") from None
    except OSError as exc:
        raise ShardfitError(f"cannot read plan file {file}: {exc.strerror}") from None
    if file.suffix.lower() == ".json":
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ShardfitError(f"{file}: not valid JSON ({exc.msg} at line {exc.lineno}, column {exc.colno})") from None
    else:
        import yaml
        try:
            data = yaml.safe_load(text)
        except yaml.YAMLError as exc:
            mark = getattr(exc, "problem_mark", None)
            where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
            problem = getattr(exc, "problem", None) or "syntax error"
            raise ShardfitError(f"{file}: not valid YAML ({problem}{where})") from None
    if data is None:
        raise ShardfitError(f"{file} is empty: a plan needs at least 'model: <preset or config>'")
    if not isinstance(data, dict):
        raise ShardfitError(f"{file}: a plan must be a mapping with a 'model' key, got {type(data).__name__}")
    return data


def load_plan(path, resolve_model=None) -> Plan:
    """Read, build and validate a Plan. `model` may be a preset name, a config path or a mapping."""
    data = read_plan_data(path)
    try:
        return plan_from_dict(data, resolve_model=resolve_model or _resolver)
    except ShardfitError as exc:
        raise ShardfitError(f"{path}: {exc}") from None


def plan_to_data(plan: Plan) -> dict:
    data = plan.to_dict()
    lora = data["training"].get("lora")
    if lora is not None:
        lora["target_modules"] = list(lora["target_modules"])
    return data


def dump_plan(plan: Plan, path) -> Path:
    """Write the plan as YAML (.yaml/.yml) or JSON (.json), atomically: temp file + rename."""
    file = Path(path)
    data = plan_to_data(plan)
    if file.suffix.lower() == ".json":
        text = json.dumps(data, indent=2) + "\n"
    else:
        import yaml
        text = yaml.safe_dump(data, sort_keys=False)
    directory = file.parent if str(file.parent) else Path(".")
    if not directory.is_dir():
        raise ShardfitError(f"cannot write {file}: folder {directory} does not exist")
    fd, tmp_name = tempfile.mkstemp(prefix=f".{file.name}.", suffix=".tmp", dir=directory)
    try:
        with os.fdopen(fd, "w") as handle:
            handle.write(text)
        os.replace(tmp_name, file)
    except BaseException:
        try:
            os.unlink(tmp_name)
        except OSError:
            pass
        raise
    return file
