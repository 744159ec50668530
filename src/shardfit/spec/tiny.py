"""Tiny configs of any transformers model type: the type's own defaults with every size knob the
config has shrunk, so a meta-device build is instant and a CPU step takes milliseconds. What the
tests and benchmarks train and measure, and what `shardfit models --tiny TYPE` writes for a user who
wants to try a real run of an architecture on a laptop. transformers is imported inside the function."""
from __future__ import annotations

from shardfit.errors import ShardfitError

# Size knobs across model families (hidden width, layers, heads, MLP, vocabulary, experts, Mamba, MLA).
SMALL = {
    "hidden_size": 64, "n_embd": 64, "d_model": 64, "dim": 64, "n_embed": 64, "embed_dim": 64,
    "num_hidden_layers": 2, "n_layer": 2, "num_layers": 2, "n_layers": 2, "num_decoder_layers": 2,
    "encoder_layers": 2, "decoder_layers": 2,
    "num_attention_heads": 4, "n_head": 4, "num_heads": 4, "n_heads": 4, "encoder_attention_heads": 4,
    "decoder_attention_heads": 4,
    "num_key_value_heads": 2, "num_kv_heads": 2, "multi_query_group_num": 2,
    "head_dim": 16, "kv_channels": 16, "d_kv": 16,
    "intermediate_size": 128, "n_inner": 128, "ffn_dim": 128, "d_ff": 128, "ffn_hidden_size": 128,
    "encoder_ffn_dim": 128, "decoder_ffn_dim": 128, "moe_intermediate_size": 32,
    "shared_expert_intermediate_size": 64,
    "vocab_size": 320, "max_position_embeddings": 512, "n_positions": 512,
    "num_local_experts": 4, "num_experts": 4, "n_routed_experts": 4, "moe_num_experts": 4,
    "num_experts_per_tok": 2, "top_k": 2, "moe_topk": 2, "n_shared_experts": 1, "n_group": 1, "topk_group": 1,
    "q_lora_rank": 32, "kv_lora_rank": 16, "qk_rope_head_dim": 8, "qk_nope_head_dim": 8, "v_head_dim": 16,
    "mamba_d_state": 8, "state_size": 8, "mamba_n_heads": 4, "mamba_d_head": 16, "mamba_expand": 2,
    "first_k_dense_replace": 1, "sliding_window": 4096, "attention_chunk_size": 4096,
}


def shrink(data: dict) -> dict:
    """Size knobs shrunk at every level (text / vision sub-configs too); per-layer lists cut to two."""
    out = dict(data)
    layers_before = next((out[k] for k in ("num_hidden_layers", "n_layer", "num_layers") if isinstance(out.get(k), int)), None)
    for key, value in out.items():
        if isinstance(value, dict) and key.endswith("_config"):
            out[key] = shrink(value)
        elif key in SMALL and isinstance(value, int) and not isinstance(value, bool) and value > 0:
            out[key] = SMALL[key]
    if isinstance(out.get("qk_rope_head_dim"), int) and "head_dim" in out:
        out["head_dim"] = out["qk_rope_head_dim"]  # MLA: the rotary tables are qk_rope_head_dim wide
    vocab = out.get("vocab_size")
    for key, value in out.items():
        # Special token ids of the full vocabulary must stay inside the small one.
        if key.endswith("token_id") and isinstance(value, int) and isinstance(vocab, int) and value >= vocab:
            out[key] = vocab - 1
    if layers_before:
        for key, value in list(out.items()):
            if isinstance(value, (list, str)) and len(value) == layers_before and ("layer" in key or "pattern" in key
                                                                                 or isinstance(value, list)):
                out[key] = value[:2]
    return out


def tiny_config(model_type: str) -> dict:
    """The type's default config with its size knobs shrunk (a plain dict, as a config.json holds)."""
    from transformers import CONFIG_MAPPING

    if model_type not in CONFIG_MAPPING:
        raise ShardfitError(f"model_type '{model_type}' is not known to the installed transformers: "
                            f"see transformers' CONFIG_MAPPING for the names (e.g. qwen3, deepseek_v3, olmo2)")
    data = shrink(CONFIG_MAPPING[model_type]().to_dict())
    data["model_type"] = model_type
    return data
