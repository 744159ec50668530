"""`shardfit export CHECKPOINT --out DIR` writes the same tokenizer files next to the weights as
`shardfit train --export` (copy_tokenizer_note), for the tokenizer in the checkpoint's plan.yaml.
The consolidation itself is replaced by a stub here: test_train_cli.py runs it for real."""
import pytest
import yaml

import shardfit.commands.export as export_command
from shardfit.cli import main


@pytest.fixture
def checkpoint(tmp_path, monkeypatch):
    """A step folder as resolve_resume sees one, and an export that writes one weights file."""
    step = tmp_path / "run" / "checkpoints" / "step-4"
    step.mkdir(parents=True)
    (step / "manifest.json").write_text("{}")

    def fake_export(source, out, max_shard_bytes):
        out.mkdir(parents=True, exist_ok=True)
        (out / "model.safetensors").write_bytes(b"\0" * 16)
        return [out / "model.safetensors"]

    monkeypatch.setattr(export_command, "export_checkpoint", fake_export)  # the name the command calls
    return step


def export(capsys, step, out):
    rc = main(["export", str(step), "--out", str(out)])
    captured = capsys.readouterr()
    return rc, captured.out, [line for line in captured.err.splitlines() if line.strip()]


def write_plan(step, tokenizer):
    (step / "plan.yaml").write_text(yaml.safe_dump({"model": "tiny-llama", "data": {"path": None,
                                                                                    "tokenizer": tokenizer}}))


@pytest.mark.parametrize("recorded", [None, "bytes"])
def test_byte_level_run_gets_the_tokenizer_note(checkpoint, tmp_path, capsys, recorded):
    write_plan(checkpoint, recorded)
    rc, out, err = export(capsys, checkpoint, tmp_path / "hf")
    assert rc == 0 and "exported" in out and err == []
    assert (tmp_path / "hf" / "TOKENIZER.txt").read_text().startswith("byte-level: ids 0-255 are UTF-8 bytes")


def test_hf_tokenizer_files_are_copied(checkpoint, tmp_path, capsys):
    tokenizer = tmp_path / "tok"
    tokenizer.mkdir()
    (tokenizer / "tokenizer.json").write_text("{}")
    (tokenizer / "tokenizer_config.json").write_text("{}")
    (tokenizer / "README.md").write_text("not a tokenizer file")
    write_plan(checkpoint, str(tokenizer))
    rc, _, err = export(capsys, checkpoint, tmp_path / "hf")
    assert rc == 0 and err == []
    assert sorted(p.name for p in (tmp_path / "hf").iterdir()) == ["model.safetensors", "tokenizer.json",
                                                                   "tokenizer_config.json"]


def test_a_tokenizer_folder_that_is_gone_is_one_warning(checkpoint, tmp_path, capsys):
    write_plan(checkpoint, str(tmp_path / "moved-away"))
    rc, out, err = export(capsys, checkpoint, tmp_path / "hf")
    assert rc == 0 and "exported" in out
    assert len(err) == 1 and err[0].startswith("warning: tokenizer folder") and "moved-away" in err[0]
    assert sorted(p.name for p in (tmp_path / "hf").iterdir()) == ["model.safetensors"]


def test_no_plan_file_is_one_warning(checkpoint, tmp_path, capsys):
    rc, _, err = export(capsys, checkpoint, tmp_path / "hf")
    assert rc == 0 and len(err) == 1 and "no plan.yaml" in err[0]
    assert not (tmp_path / "hf" / "TOKENIZER.txt").exists()
