"""Specs derived from transformers itself: every registered LM model type builds and counts exactly,
the hand-written families equal their derived specs, and the cache makes the second plan torch-free."""
import json
import os
import subprocess
import sys

import pytest

from shardfit.errors import ShardfitError
from shardfit.estimate import states
from shardfit.spec import spec_cache
from shardfit.spec.models import analytic_spec, derived_spec, load_hf_config, load_model_spec

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from transformers import CONFIG_MAPPING  # noqa: E402
from transformers.models.auto import modeling_auto  # noqa: E402

from shardfit.spec.derive import build_hf_model, derive_spec, find_blocks  # noqa: E402
from shardfit.spec.tiny import tiny_config  # noqa: E402

LM_TYPES = sorted(set(modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES) | set(modeling_auto.MODEL_FOR_MASKED_LM_MAPPING_NAMES))
# Model types whose LM class cannot be built from transformers' own default config nor from a
# shrunk copy of it (transformers 5.24), or that have no repeated layers; docs/models.md lists them.
CANNOT_BUILD = {
    "albert": "shares one layer across depth: no repeated blocks to wrap",
    "cohere_compass_text": "default config names a layer type its attention table lacks",
    "dbrx": "default attention sub-config lacks rope_theta",
    "dots1": "default config leaves a size unset (None)",
    "dots3_note": "per-layer sizes only (per_layer_config)",
    "dots3_note_text": "per-layer sizes only (per_layer_config)",
    "esm": "default config leaves vocab_size unset",
    "gemma3n": "the multimodal class needs its vision/audio towers (timm)",
    "gemma4": "per-layer sizes only (per_layer_config)",
    "gemma4_assistant": "default config fails its own validation",
    "gemma4_text": "per-layer sizes only (per_layer_config)",
    "gemma4_unified": "per-layer sizes only (per_layer_config)",
    "gemma4_unified_assistant": "per-layer sizes only (per_layer_config)",
    "gemma4_unified_text": "per-layer sizes only (per_layer_config)",
    "hunyuan_v1_dense": "default config leaves rope settings unset",
    "hunyuan_v1_moe": "default config leaves rope settings unset",
    "lfm2_moe": "default config leaves a per-layer list unset",
    "ministral": "default config leaves rope settings unset",
    "musicgen": "an audio decoder without its own dropout setting",
    "musicgen_melody": "an audio decoder without its own dropout setting",
    "nemotron": "default config leaves head_dim unset",
    "reformer": "the LM head requires is_decoder=True",
}


def derive_any(model_type):
    """Derive from a shrunk copy of the type's default config, else from the default config itself."""
    errors = []
    for make in (lambda: tiny_config(model_type),
                 lambda: {**CONFIG_MAPPING[model_type]().to_dict(), "model_type": model_type}):
        try:
            cfg = make()
        except Exception as exc:  # noqa: BLE001 - transformers' own default refuses itself
            errors.append(f"default config: {type(exc).__name__}: {exc}")
            continue
        try:
            spec, facts = derive_spec(cfg, model_type, model_type)
            return cfg, spec, facts
        except ShardfitError as exc:
            errors.append(str(exc))
    raise ShardfitError(" | ".join(errors))


@pytest.mark.parametrize("model_type", LM_TYPES)
def test_every_lm_model_type_derives_exactly(model_type):
    if model_type in CANNOT_BUILD:
        with pytest.raises(ShardfitError):
            derive_any(model_type)
        return
    cfg, spec, facts = derive_any(model_type)
    model = build_hf_model(cfg)
    assert spec.n_params == sum(p.numel() for p in model.parameters())  # parameters() skips tied copies
    blocks = find_blocks(model)
    assert spec.num_layers == len(blocks) >= 1
    assert sum(n for _, n, _ in spec.block_kinds) == spec.num_layers
    seen: set = set()
    in_blocks = sum(p.numel() for b in blocks for p in b.parameters() if id(p) not in seen and not seen.add(id(p)))
    assert spec.non_block_params == spec.n_params - in_blocks >= 0
    assert spec.block_params == max(params for _, _, params in spec.block_kinds)
    assert sum(__import__("math").prod(shape) * n for shape, n in spec.tensor_shapes) == spec.n_params
    # FSDP1's units in optimizer order: every parameter once; the root's are the non-block ones.
    assert sum(sum(sizes) * repeat for _, sizes, repeat in spec.param_order) == spec.n_params
    assert sum(sum(sizes) for unit, sizes, _ in spec.param_order if unit == "root") == spec.non_block_params
    assert sum(repeat for unit, _, repeat in spec.param_order if unit == "block") == spec.num_layers
    assert 1 <= facts["depth"] <= spec.num_layers and len(facts["kinds"]) == facts["depth"]


HAND = ["tiny-llama", "tiny-mistral", "tiny-mixtral", "tiny-qwen2", "tiny-gemma2", "tiny-gpt2", "tiny-bert",
        "llama-3.1-8b", "mixtral-8x7b", "gemma-2-9b", "gpt2-xl", "bert-large", "qwen2.5-7b"]


@pytest.mark.parametrize("name", HAND)
def test_hand_written_specs_equal_the_derived_ones(name, tmp_path, monkeypatch):
    monkeypatch.setenv("SHARDFIT_CACHE_DIR", str(tmp_path))
    cfg = load_hf_config(name)
    hand, derived = analytic_spec(cfg, name, name), derived_spec(cfg, name, name)
    for field in ("n_params", "num_layers", "block_params", "non_block_params", "largest_layer_params",
                  "hidden_size", "num_heads", "num_kv_heads", "head_dim", "vocab_size", "tie_embeddings",
                  "num_experts", "experts_per_token", "causal_lm"):
        assert getattr(hand, field) == getattr(derived, field), field
    assert derived.block_class == hand.block_class
    # The linears LoRA targets, quantizes and ZeRO-3 keeps gathered: the same from both rules.
    # NOTE: transformers 5 stores MoE experts as 3-D parameters, not nn.Linear: the hand rules still
    # list them as linears (LoRA / QLoRA estimates), the derived spec does not.
    experts = ("gate_proj", "up_proj", "down_proj") if hand.num_experts else ()
    hand_linears = [row for row in states.model_linears(hand) if row[0] not in experts]
    assert sorted(hand_linears) == sorted(states.model_linears(derived))
    for threshold in (100_000, 10**9):
        assert states.zero3_persistent_params(hand, threshold) == states.zero3_persistent_params(derived, threshold)


def test_second_plan_of_a_config_reads_the_cache_without_torch(tmp_path):
    config = tmp_path / "qwen3-small" / "config.json"
    config.parent.mkdir()
    config.write_text(json.dumps(tiny_config("qwen3")))
    env = {**os.environ, "SHARDFIT_CACHE_DIR": str(tmp_path / "cache")}
    argv = ["plan", str(config.parent), "--gpus", "2", "--strategy", "fsdp2", "--seq", "128", "--json"]
    first = subprocess.run([sys.executable, "-m", "shardfit", *argv], env=env, capture_output=True, text=True, timeout=300)
    assert first.returncode == 0, first.stderr
    assert "[transformers]" not in first.stderr  # the derivation is quiet
    entries = list((tmp_path / "cache" / "specs").glob("*.json"))
    assert len(entries) == 1
    entry = json.loads(entries[0].read_text())
    assert entry["config"]["model_type"] == "qwen3" and entry["coefficients"]
    code = ("import sys, json; from shardfit.cli import main\n"
            f"try: main({argv!r})\nexcept SystemExit as e: assert not e.code, e.code\n"
            "assert 'torch' not in sys.modules and 'transformers' not in sys.modules, 'imported'")
    second = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert second.returncode == 0, second.stderr
    assert json.loads(second.stdout) == json.loads(first.stdout)


def test_cache_key_follows_config_and_transformers_version(monkeypatch, tmp_path):
    monkeypatch.setenv("SHARDFIT_CACHE_DIR", str(tmp_path))
    cfg = tiny_config("qwen3")
    key = spec_cache.config_key(cfg)
    assert spec_cache.config_key(dict(reversed(list(cfg.items())))) == key  # key order does not matter
    assert spec_cache.config_key({**cfg, "hidden_size": 96}) != key
    monkeypatch.setattr(spec_cache, "transformers_version", lambda: "0.0.1")
    assert spec_cache.config_key(cfg) != key


def test_damaged_or_cleared_cache_is_derived_again(monkeypatch, tmp_path):
    monkeypatch.setenv("SHARDFIT_CACHE_DIR", str(tmp_path))
    cfg = tiny_config("olmo2")
    spec = derived_spec(cfg, "olmo2-small", "olmo2-small")
    path = spec_cache.entry_path(spec.config_hash)
    path.write_text("{not json")
    assert derived_spec(cfg, "olmo2-small", "olmo2-small") == spec
    assert spec_cache.clear() == 1 and not path.exists()


def test_unknown_model_type_is_one_line(tmp_path):
    config = tmp_path / "config.json"
    config.write_text(json.dumps({"model_type": "no-such-model", "hidden_size": 8}))
    with pytest.raises(ShardfitError, match="not known to the installed transformers"):
        load_model_spec(str(config))
