"""Every emitted training script is clean Python: it compiles, has no constant branch (`if False:`),
no unused import, and `ruff check` (default rules) passes on it where ruff is installed (dev extra)."""
import ast
import shutil
import subprocess
import sys
from dataclasses import replace

import pytest

from shardfit.emit import emit
from shardfit.spec.models import load_model_spec
from shardfit.spec.plan import Cluster, LoRA, Plan, Training, parse_strategy

TINY = load_model_spec("tiny-llama")
CASES = [("fsdp2", "fsdp2", {}), ("fsdp2", "fsdp2", {"precision": "fp16", "loss": "chunked", "loss_chunks": 4}),
         ("fsdp2+offload", "fsdp2", {"activation_checkpointing": "selective"}),
         ("fsdp", "fsdp", {"lora": LoRA(rank=4, alpha=8)}), ("fsdp", "fsdp", {"precision": "fp16"}),
         ("fsdp2", "fsdp2", {"precision": "bf16-pure", "optimizer": "adamw8bit"}),
         ("zero3", "fsdp2", {}), ("single", "single", {"activation_checkpointing": "full"}),
         ("ddp", "ddp", {}), ("ddp", "ddp", {"precision": "fp16", "lora": LoRA(rank=4, alpha=8), "loss": "chunked"})]


def _scripts():
    for strategy, fmt, training in CASES:
        plan = Plan(model=TINY, strategy=parse_strategy(strategy),
                    training=replace(Training(micro_batch=2, grad_accum=4, seq_len=64,
                                              activation_checkpointing="every-2"), **training),
                    cluster=Cluster(nodes=1, gpus_per_node=2 if fmt != "single" else 1, gpu="H100-80GB"))
        yield f"{strategy}-{fmt}-{'-'.join(training) or 'plain'}", emit(plan, fmt).main


def _ruff():
    if subprocess.run([sys.executable, "-m", "ruff", "--version"], capture_output=True).returncode == 0:
        return [sys.executable, "-m", "ruff"]
    return [shutil.which("ruff")] if shutil.which("ruff") else None


def _unused_imports(tree):
    imported = {}
    for node in ast.walk(tree):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            for alias in node.names:
                imported[(alias.asname or alias.name).split(".")[0]] = node.lineno
    used = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)}
    return sorted(name for name in imported if name not in used)


@pytest.mark.parametrize("name,text", list(_scripts()), ids=lambda v: v if isinstance(v, str) and len(v) < 80 else "")
def test_emitted_script_is_clean(name, text):
    tree = ast.parse(compile(text, name, "exec", ast.PyCF_ONLY_AST))
    constant_ifs = [n.lineno for n in ast.walk(tree) if isinstance(n, (ast.If, ast.IfExp))
                    and isinstance(n.test, ast.Constant)]
    assert not constant_ifs, f"{name}: constant branches at lines {constant_ifs}"
    assert not _unused_imports(tree), f"{name}: unused imports {_unused_imports(tree)}"


def test_ruff_passes_on_every_emitted_script(tmp_path):
    ruff = _ruff()
    if ruff is None:
        pytest.skip("ruff is not installed (pip install -e '.[dev]' brings it)")
    paths = []
    for name, text in _scripts():
        path = tmp_path / f"{name.replace('+', '_')}.py"
        path.write_text(text)
        paths.append(str(path))
    done = subprocess.run([*ruff, "check", "--isolated", "--no-cache", *paths], capture_output=True, text=True)
    assert done.returncode == 0, done.stdout[-4000:]


def test_cli_weights_option_reaches_the_fsdp2_script(tmp_path, capsys):
    from shardfit.cli import main
    from shardfit.spec.planfile import dump_plan

    plan = Plan(model=TINY, strategy=parse_strategy("fsdp2"), cluster=Cluster(gpus_per_node=2))
    path = dump_plan(plan, tmp_path / "plan.yaml")
    assert main(["emit", str(path), "--format", "fsdp2", "--weights", "/models/tiny"]) == 0
    text = capsys.readouterr().out
    assert 'WEIGHTS = os.environ.get("WEIGHTS", \'/models/tiny\')' in text
    assert main(["emit", str(path), "--format", "fsdp2"]) == 0
    assert 'WEIGHTS = os.environ.get("WEIGHTS", \'\')' in capsys.readouterr().out


def test_cli_data_options_reach_the_scripts(tmp_path, capsys):
    from shardfit.cli import main
    from shardfit.spec.planfile import dump_plan

    plan = Plan(model=TINY, strategy=parse_strategy("ddp"), cluster=Cluster(gpus_per_node=2))
    path = dump_plan(plan, tmp_path / "plan.yaml")
    assert main(["emit", str(path), "--format", "ddp", "--data", "docs.jsonl", "--tokenizer", "/tok", "--pack"]) == 0
    text = capsys.readouterr().out
    assert "DATA = os.environ.get(\"DATA\", 'docs.jsonl')" in text and "'/tok')" in text
    assert 'PACK = os.environ.get("PACK", "1") == "1"' in text
    assert main(["emit", str(path), "--format", "ddp"]) == 0
    text = capsys.readouterr().out
    assert "DATA = os.environ.get(\"DATA\", '')" in text and 'os.environ.get("PACK", "0")' in text
