"""Model specs: the analytic counts equal the real transformers model, every reference path works,
and every bad reference is one ShardfitError line."""
import json
import subprocess
import sys
import textwrap

import pytest
import torch
import transformers
from transformers import CONFIG_MAPPING

from shardfit.cli import main
from shardfit.errors import ShardfitError
from shardfit.modeling import block_classes, build_model
from shardfit.spec.models import (PRESETS_DIR, list_presets, load_hf_config, load_model_spec, preset_names,
                                  spec_from_hf_config)

REAL = ["llama-2-7b", "llama-2-13b", "llama-2-70b", "llama-3.1-8b", "llama-3.1-70b", "llama-3.1-405b",
        "mistral-7b", "mixtral-8x7b", "qwen2.5-7b", "qwen2.5-72b", "gemma-2-9b", "gpt2", "gpt2-medium",
        "gpt2-large", "gpt2-xl", "bert-large", "llama-1b"]
TINY = ["tiny-llama", "tiny-mistral", "tiny-mixtral", "tiny-qwen2", "tiny-gemma2", "tiny-gpt2", "tiny-bert"]
# Published totals (model cards / HF safetensors metadata): the presets must be the real shapes.
PUBLISHED = {"llama-2-7b": 6_738_415_616, "llama-2-13b": 13_015_864_320, "llama-2-70b": 68_976_648_192,
             "llama-3.1-8b": 8_030_261_248, "llama-3.1-70b": 70_553_706_496, "mistral-7b": 7_241_732_096,
             "mixtral-8x7b": 46_702_792_704, "qwen2.5-7b": 7_615_616_512, "gemma-2-9b": 9_241_705_984,
             "gpt2": 124_439_808, "gpt2-xl": 1_557_611_200}


def meta_model(cfg: dict):
    """The transformers model this config builds, on the meta device (no memory)."""
    config = CONFIG_MAPPING[cfg["model_type"]](**cfg)
    arch = "BertForMaskedLM" if cfg["model_type"] == "bert" else cfg["architectures"][0]
    with torch.device("meta"):
        return getattr(transformers, arch)(config)


def measured(model, block_class: str) -> dict:
    blocks = [m for m in model.modules() if type(m).__name__ == block_class]
    return {
        "n_params": sum(p.numel() for p in model.parameters()),  # parameters() skips tied duplicates
        "num_layers": len(blocks),
        "block_params": sum(p.numel() for p in blocks[0].parameters()),
        # DeepSpeed's model_to_params(): the most parameters one module owns itself
        "largest_layer_params": max(sum(p.numel() for p in m.parameters(recurse=False)) for m in model.modules()),
    }


def check_against_model(cfg: dict, name: str):
    spec = spec_from_hf_config(cfg, name=name, source=name)
    real = measured(meta_model(cfg), spec.block_class)
    assert {key: getattr(spec, key) for key in real} == real
    assert spec.non_block_params == spec.n_params - spec.num_layers * spec.block_params
    return spec


@pytest.mark.parametrize("name", REAL + TINY)
def test_preset_counts_equal_the_transformers_model(name):
    spec = check_against_model(load_hf_config(name), name)
    if name in PUBLISHED:
        assert spec.n_params == PUBLISHED[name]
    if name.startswith("tiny-"):
        assert 100_000 <= spec.n_params <= 2_000_000 and spec.vocab_size >= 260


def test_every_preset_file_is_listed_and_tested():
    assert sorted(REAL + TINY) == preset_names()
    specs = list_presets()
    assert [s.name for s in specs][-len(TINY):] == sorted(TINY, key=lambda n: load_model_spec(n).family)
    for spec in specs:
        assert spec.has_shape and spec.block_class and spec.largest_layer_params > 0
        assert spec.source == spec.name


# Config variants the presets do not exercise: biases, tying flipped, GPT-2 n_inner, BERT untied.
VARIANTS = [
    ("tiny-llama", {"attention_bias": True, "mlp_bias": True, "tie_word_embeddings": True}),
    ("tiny-llama", {"head_dim": 32}),
    ("tiny-qwen2", {"tie_word_embeddings": True}),
    ("tiny-gemma2", {"tie_word_embeddings": False, "attention_bias": True}),
    ("tiny-mistral", {"head_dim": 8, "num_key_value_heads": 4}),
    ("tiny-mixtral", {"num_local_experts": 3, "num_experts_per_tok": 1, "tie_word_embeddings": True}),
    ("tiny-gpt2", {"n_inner": 100, "tie_word_embeddings": False}),
    ("tiny-bert", {"tie_word_embeddings": False, "type_vocab_size": 3}),
]


@pytest.mark.parametrize("base,changes", VARIANTS, ids=[f"{b}-{'-'.join(c)}" for b, c in VARIANTS])
def test_config_variants_equal_the_transformers_model(base, changes):
    cfg = {**load_hf_config(base), **changes}
    spec = check_against_model(cfg, base)
    assert spec.tie_embeddings == cfg.get("tie_word_embeddings", spec.tie_embeddings)


def test_shapes_and_flags_from_config():
    mixtral = load_model_spec("mixtral-8x7b")
    assert (mixtral.num_experts, mixtral.experts_per_token, mixtral.mlp) == (8, 2, "swiglu")
    gemma = load_model_spec("gemma-2-9b")
    assert (gemma.head_dim, gemma.tie_embeddings, gemma.num_kv_heads) == (256, True, 8)
    gpt2 = load_model_spec("gpt2")
    assert (gpt2.mlp, gpt2.norm, gpt2.dropout, gpt2.max_position, gpt2.intermediate_size) == ("gelu", "layernorm", 0.1, 1024, 3072)
    bert = load_model_spec("bert-large")
    assert (bert.causal_lm, bert.block_class, bert.largest_layer_params) == (False, "BertLayer", 30522 * 1024 + 30522)
    assert load_model_spec("Llama-2-7B") == load_model_spec("llama-2-7b")  # preset names ignore case
    llama = load_model_spec("llama-3.1-405b")
    assert llama.largest_layer_params == 128256 * 16384 and llama.max_position == 131072


def test_local_config_file_and_model_directory(tmp_path):
    cfg = load_hf_config("tiny-llama")
    model_dir = tmp_path / "my-llama"
    model_dir.mkdir()
    (model_dir / "config.json").write_text(json.dumps(cfg))
    (tmp_path / "other.json").write_text(json.dumps({**cfg, "num_hidden_layers": 6}))
    from_dir = load_model_spec(str(model_dir))
    from_file = load_model_spec(str(model_dir / "config.json"))
    preset = load_model_spec("tiny-llama")
    assert from_dir.name == from_file.name == "my-llama"
    assert from_dir.source == str(model_dir / "config.json")
    assert from_dir.n_params == from_file.n_params == preset.n_params
    six = load_model_spec(str(tmp_path / "other.json"))
    assert (six.name, six.num_layers) == ("other", 6)
    assert six.n_params == preset.n_params + 2 * preset.block_params


FACTORY = '''
import torch.nn as nn

class Block(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.ff = nn.Linear(d, 4 * d)
        self.out = nn.Linear(4 * d, d, bias=False)

class Net(nn.Module):
    def __init__(self, vocab=100, d=16, n=3):
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList(Block(d) for _ in range(n))
        self.head = nn.Linear(d, vocab, bias=False)
        self.head.weight = self.embed.weight  # tied: counted once

def make_net():
    return Net()

def not_a_module():
    return 42

def broken():
    raise RuntimeError("boom")
'''


@pytest.fixture
def factory_module(tmp_path, monkeypatch):
    (tmp_path / "sf_test_factory.py").write_text(textwrap.dedent(FACTORY))
    monkeypatch.syspath_prepend(str(tmp_path))
    yield "sf_test_factory"
    sys.modules.pop("sf_test_factory", None)


def test_factory_reference(factory_module):
    spec = load_model_spec(f"{factory_module}:make_net")
    block = 2 * 16 + (16 * 64 + 64) + 64 * 16
    assert spec.family == "module" and spec.source == f"{factory_module}:make_net"
    assert (spec.block_class, spec.num_layers, spec.block_params) == ("Block", 3, block)
    assert spec.n_params == 100 * 16 + 3 * block
    assert spec.non_block_params == 100 * 16 and spec.largest_layer_params == 100 * 16
    model = build_model(f"{factory_module}:make_net", device="cpu", seed=0)
    assert [c.__name__ for c in block_classes(model, spec)] == ["Block"]
    assert next(model.parameters()).device.type == "cpu"


def test_build_model_is_deterministic_and_configured():
    first = build_model("tiny-llama", seed=7)
    second = build_model(load_model_spec("tiny-llama"), seed=7)
    assert all(torch.equal(a, b) for a, b in zip(first.parameters(), second.parameters()))
    assert first.config.use_cache is False and first.training
    assert [c.__name__ for c in block_classes(first)] == ["LlamaDecoderLayer"]
    bert = build_model("tiny-bert", device="meta", dtype="bf16", attn_implementation="eager")
    assert type(bert).__name__ == "BertForMaskedLM" and next(bert.parameters()).dtype == torch.bfloat16
    assert bert.config._attn_implementation == "eager"
    # Gemma-2 has no SDPA kernel in transformers 5: it falls back to eager instead of failing.
    assert build_model("tiny-gemma2", device="meta").config._attn_implementation == "eager"


def _write(tmp_path, name, text):
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def bad_refs(tmp_path, factory):
    llama = load_hf_config("tiny-llama")
    (tmp_path / "empty-dir").mkdir()
    return {
        "llama-2-7": "did you mean llama-2-7b",
        "no-such-model": "unknown model 'no-such-model'",
        "": "empty",
        str(tmp_path / "missing" / "config.json"): "no such file",
        "meta-llama/Llama-2-7b-hf": "no such file",
        str(tmp_path / "empty-dir"): "has no config.json",
        _write(tmp_path, "bad.json", "{not json"): "not valid JSON",
        _write(tmp_path, "list.json", "[1, 2]"): "must be a JSON object",
        _write(tmp_path, "notype.json", json.dumps({"hidden_size": 8})): "no 'model_type'",
        _write(tmp_path, "unknown.json", json.dumps({"model_type": "no-such-model"})): "model_type 'no-such-model' is not known",
        _write(tmp_path, "nohidden.json", json.dumps({k: v for k, v in llama.items() if k != "hidden_size"})): "lacks 'hidden_size'",
        _write(tmp_path, "neg.json", json.dumps({**llama, "num_hidden_layers": -2})): "positive integer",
        _write(tmp_path, "heads.json", json.dumps({**llama, "num_attention_heads": 5})): "not divisible",
        "no_such_pkg_xyz:make": "cannot import module",
        f"{factory}:missing_fn": "has no callable 'missing_fn'",
        f"{factory}:not_a_module": "must return a torch.nn.Module",
        f"{factory}:broken": "failed: RuntimeError: boom",
    }


def test_bad_references_are_one_line_errors(tmp_path, factory_module):
    for ref, fragment in bad_refs(tmp_path, factory_module).items():
        with pytest.raises(ShardfitError) as info:
            load_model_spec(ref)
        message = str(info.value)
        assert fragment in message and "\n" not in message, (ref, message)


def test_models_command(capsys):
    assert main(["models"]) == 0
    table = capsys.readouterr().out.splitlines()
    assert table[0].split()[:3] == ["name", "family", "params"]
    row = next(line.split() for line in table if line.startswith("llama-2-7b "))
    assert row[1:7] == ["llama", "6.74B", "32", "4096", "32/32", "32000"]
    assert len(table) == 1 + len(preset_names())
    assert main(["models", "gpt2", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data[0]["n_params"] == 124_439_808 and data[0]["block_class"] == "GPT2Block"
    assert main(["models", "nope-7b"]) == 2
    assert "unknown model 'nope-7b'" in capsys.readouterr().err


def test_analytic_path_does_not_import_torch():
    code = ("import sys, shardfit.spec.models as m, shardfit.commands.models as c; m.list_presets(); "
            "sys.exit(int('torch' in sys.modules or 'transformers' in sys.modules))")
    assert subprocess.run([sys.executable, "-c", code], timeout=60).returncode == 0


def test_preset_files_load_with_transformers_autoconfig():
    for path in sorted(PRESETS_DIR.glob("*.json")):
        config = transformers.AutoConfig.for_model(**json.loads(path.read_text()))
        assert config.model_type == json.loads(path.read_text())["model_type"]
