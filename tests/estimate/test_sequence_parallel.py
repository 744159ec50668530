"""What sequence parallel shards (estimate/sequence_parallel.py): the bytes the norms between the TP
regions save, traced from the model's own code, shipped for the presets; measured against real FSDP2
x TP x SP steps in tests/engines/test_tensor_parallel.py."""
from __future__ import annotations

import pytest

from shardfit.spec.models import model_spec_for

pytest.importorskip("torch")


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-gemma2", "tiny-mixtral", "llama-3.1-8b"])
def test_shipped_norm_bytes_equal_a_fresh_trace(name, tmp_path, monkeypatch):
    from shardfit.estimate import sequence_parallel

    monkeypatch.setenv("SHARDFIT_CACHE_DIR", str(tmp_path))
    spec = model_spec_for(name)
    shipped = sequence_parallel._shipped()[name]
    monkeypatch.setattr(sequence_parallel, "_shipped", lambda: {})
    sequence_parallel.sharded_norm_bytes.cache_clear()
    try:
        for regime, value in shipped.items():
            assert list(sequence_parallel.sharded_norm_bytes(spec, regime)) == pytest.approx(value), regime
    finally:
        sequence_parallel.sharded_norm_bytes.cache_clear()


def test_the_norms_save_what_their_code_saves():
    """Llama's RMSNorm (fp32): its input (for pow), the normalised hidden states (for the weight's
    multiply) and the reciprocal RMS, two per block; Gemma-2 has four norms per block (pre and post)."""
    from shardfit.estimate.sequence_parallel import sharded_norm_bytes

    llama, gemma = model_spec_for("tiny-llama"), model_spec_for("tiny-gemma2")
    h = llama.hidden_size
    assert sharded_norm_bytes(llama, "fp32") == (2 * (4 * h + 4 * h + 4), 4 * h + 4 * h + 4, 0)
    # 16-bit stream: the fp32 upcast for the variance, the bf16 normalised states.
    assert sharded_norm_bytes(llama, "half") == (2 * (4 * h + 2 * h + 4), 4 * h + 2 * h + 4, 0)
    assert sharded_norm_bytes(gemma, "fp32")[0] == 2 * sharded_norm_bytes(llama, "fp32")[0]


def test_owners_reading_one_normed_input_gather_it_twice(tmp_path):
    """Cohere's parallel block: the attention and the MLP read the one normed input; under SP each
    all-gathers its own copy (one extra per layer); Qwen3's read different norms' outputs."""
    import json

    from shardfit.estimate.sequence_parallel import sharded_norm_bytes
    from shardfit.spec.models import load_model_spec
    from shardfit.spec.tiny import tiny_config

    extras = {}
    for arch in ("cohere", "qwen3"):
        folder = tmp_path / arch
        folder.mkdir()
        (folder / "config.json").write_text(json.dumps(tiny_config(arch)))
        extras[arch] = sharded_norm_bytes(load_model_spec(str(folder)), "fp32")[2]
    assert extras == {"cohere": 1.0, "qwen3": 0.0}


def test_a_norm_inside_the_attention_is_not_between_the_regions():
    """Qwen3's per-head q_norm / k_norm run on this rank's heads (spec/tp_modules.between_region_norms,
    which the engine's sequence parallel and the trace share)."""
    from shardfit.spec.derive import build_hf_model
    from shardfit.spec.tp_modules import between_region_norms
    from shardfit.spec.tiny import tiny_config

    model = build_hf_model(tiny_config("qwen3"), device="meta")
    names = between_region_norms(model, model._tp_plan)
    assert "model.norm" in names and "model.layers.0.input_layernorm" in names
    assert not [n for n in names if "q_norm" in n or "k_norm" in n]
    assert len(names) == 2 * len(model.model.layers) + 1
