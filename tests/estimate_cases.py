"""Hand-made specs and plans for the estimator tests (no presets, no torch)."""
from __future__ import annotations

from shardfit.spec.model_spec import ModelSpec, params_only_spec
from shardfit.spec.plan import Cluster, LoRA, Plan, Training, parse_strategy

# A small Llama-shaped model with GQA: every derived number in the tests is checked by hand on it.
H, HEADS, KV, HD, INTER, VOCAB, LAYERS = 64, 4, 2, 16, 128, 256, 2
BLOCK = H * HEADS * HD + 2 * H * KV * HD + HEADS * HD * H + 3 * H * INTER + 2 * H  # 36992
NON_BLOCK = 2 * VOCAB * H + H  # untied embedding + head + final norm
HAND = ModelSpec(name="hand-llama", family="llama", source="test", n_params=LAYERS * BLOCK + NON_BLOCK,
                 hidden_size=H, num_layers=LAYERS, num_heads=HEADS, num_kv_heads=KV, head_dim=HD,
                 intermediate_size=INTER, vocab_size=VOCAB, block_class="LlamaDecoderLayer",
                 block_params=BLOCK, largest_layer_params=VOCAB * H, non_block_params=NON_BLOCK)

BIG = ModelSpec(name="big-llama", family="llama", source="test", n_params=8_030_261_248, hidden_size=4096,
                num_layers=32, num_heads=32, num_kv_heads=8, head_dim=128, intermediate_size=14336,
                vocab_size=128256, block_class="LlamaDecoderLayer", block_params=218_112_000,
                largest_layer_params=525_336_576, non_block_params=1_050_677_248)

GPT = ModelSpec(name="hand-gpt2", family="gpt2", source="test", n_params=200_000, hidden_size=64, num_layers=2,
                num_heads=4, num_kv_heads=4, head_dim=16, intermediate_size=256, vocab_size=512,
                tie_embeddings=True, mlp="gelu", norm="layernorm", dropout=0.1, block_class="GPT2Block",
                block_params=50_000, largest_layer_params=32_768, non_block_params=100_000)


def plan(model=HAND, strategy="ddp", gpus=8, nodes=1, gpu="H100-80GB", lora=None, **training) -> Plan:
    return Plan(model=model, strategy=parse_strategy(strategy), training=Training(**training),
                cluster=Cluster(nodes=nodes, gpus_per_node=gpus, gpu=gpu))


def params_plan(n=7.5e9, strategy="zero3", gpus=64, **training) -> Plan:
    nodes = max(1, gpus // 8)
    return Plan(model=params_only_spec(n), strategy=parse_strategy(strategy), training=Training(**training),
                cluster=Cluster(nodes=nodes, gpus_per_node=gpus // nodes))


__all__ = ["HAND", "BIG", "GPT", "LoRA", "plan", "params_plan"]
