"""Plan files: load a Plan from YAML/JSON, write one back atomically. Errors are one line."""
from __future__ import annotations

import json
from pathlib import Path

from shardfit.errors import ShardfitError
from shardfit.spec.models import load_model_spec
from shardfit.spec.spec_cache import write_text_atomically
from shardfit.spec.plan import Plan, plan_from_dict


def _resolver(ref: str):
    return load_model_spec(ref)


class DuplicateKey(Exception):
    """The same key twice in one mapping: YAML and JSON would silently keep the last one."""

    def __init__(self, key, line: int, first_line: int):
        super().__init__(key, line, first_line)
        self.key, self.line, self.first_line = key, line, first_line

    def message(self, file) -> str:
        shown = str(self.key) if len(str(self.key)) <= 60 else str(self.key)[:57] + "..."
        first = "earlier on the same line" if self.first_line == self.line else f"at line {self.first_line}"
        return f"{file} line {self.line}: duplicate key '{shown}' (also {first}): keep one"


def _unique_key_loader():
    """yaml.SafeLoader (no python/* tags) that refuses a key repeated in one mapping, at any depth.
    Keys brought in by a merge (`<<: *base`) may be overridden: only the mapping's own keys count."""
    import yaml

    class UniqueKeyLoader(yaml.SafeLoader):
        def construct_mapping(self, node, deep=False):
            if isinstance(node, yaml.MappingNode):
                seen: dict = {}
                for key_node, _ in node.value:
                    if key_node.tag == "tag:yaml.org,2002:merge" or not isinstance(key_node, yaml.ScalarNode):
                        continue  # merges may override; complex keys are left to SafeLoader's own checks
                    key = self.construct_object(key_node, deep=True)
                    line = key_node.start_mark.line + 1
                    if key in seen:
                        raise DuplicateKey(key, line, seen[key])
                    seen[key] = line
            return super().construct_mapping(node, deep=deep)

    return UniqueKeyLoader


def yaml_load_unique(text: str):
    """yaml.safe_load, except that a duplicate key raises DuplicateKey (with its line numbers)."""
    import yaml
    return yaml.load(text, Loader=_unique_key_loader())  # noqa: S506 - a SafeLoader subclass


def json_load_unique(text: str):
    """json.loads, except that a duplicate key raises DuplicateKey (with its line numbers)."""
    from json.decoder import WHITESPACE, JSONObject, scanstring
    from json.scanner import py_make_scanner

    def key_lines(s: str, pos: int, strict: bool, scan_once) -> list[int]:
        """The line of each key of the (already parsed, so valid) object whose body starts at pos."""
        lines = []
        pos = WHITESPACE.match(s, pos).end()
        while s[pos] == '"':
            lines.append(s.count("\n", 0, pos) + 1)
            _, pos = scanstring(s, pos + 1, strict)
            pos = WHITESPACE.match(s, WHITESPACE.match(s, pos).end() + 1).end()  # past the ':'
            _, pos = scan_once(s, pos)
            pos = WHITESPACE.match(s, pos).end()
            if s[pos] != ",":
                break
            pos = WHITESPACE.match(s, pos + 1).end()
        return lines

    def parse_object(s_and_end, strict, scan_once, object_hook, object_pairs_hook, memo=None):
        pairs, end = JSONObject(s_and_end, strict, scan_once, None, list, memo)
        seen: dict = {}
        for index, (key, _) in enumerate(pairs):
            if key in seen:
                lines = key_lines(s_and_end[0], s_and_end[1], strict, scan_once)
                raise DuplicateKey(key, lines[index], lines[seen[key]])
            seen[key] = index
        return dict(pairs), end

    # The pure-Python scanner: the C one parses objects without calling parse_object.
    decoder = json.JSONDecoder()
    decoder.parse_object = parse_object
    decoder.scan_once = py_make_scanner(decoder)
    return decoder.decode(text)


def read_plan_data(path) -> dict:
    """The raw mapping inside a plan file (YAML or JSON by extension; YAML also reads JSON). A key
    written twice in one mapping is an error (both formats would silently keep the last one)."""
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
            data = json_load_unique(text)
        except DuplicateKey as exc:
            raise ShardfitError(exc.message(file)) from None
        except json.JSONDecodeError as exc:
            raise ShardfitError(f"{file}: not valid JSON ({exc.msg} at line {exc.lineno}, column {exc.colno})") from None
        except RecursionError:
            raise ShardfitError(f"{file}: not valid JSON (nested too deeply)") from None
    else:
        import yaml
        try:
            data = yaml_load_unique(text)
        except DuplicateKey as exc:
            raise ShardfitError(exc.message(file)) from None
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
    """The plan as plain YAML/JSON data: tuples (LoRA targets, a derived spec's block kinds and
    tensor shapes) become lists, which yaml.safe_dump can write."""
    return _plain(plan.to_dict())


def _plain(value):
    if isinstance(value, dict):
        return {key: _plain(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(item) for item in value]
    return value


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
    write_text_atomically(file, text)
    return file
