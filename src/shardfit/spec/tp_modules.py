"""Which modules of a transformers model its tensor-parallel plan touches, found by walking the model
(meta-built or real): the modules that own colwise linears (sequence parallel all-gathers their input),
the norms between those regions (sequence parallel shards them), the routed experts (expert parallel
splits them). The engines (engines/sequence_parallel.py) and the tracer (estimate/derived.py) share
these lists, so what is estimated is what runs. No torch import here: the model is given.
"""
from __future__ import annotations


def _owner_patterns(plan: dict) -> list[list[str]]:
    return [path.rsplit(".", 1)[0].split(".") for path, style in plan.items() if style == "colwise" and "." in path]


def colwise_owners(model, plan: dict) -> list[str]:
    """The modules that own the colwise linears of the TP plan `plan` (the attention, the MLP): under
    sequence parallel each all-gathers its sequence-sharded input once (engines/sequence_parallel.py)."""
    owners = _owner_patterns(plan)
    return [name for name, _ in model.named_modules() if name and any(
        len(name.split(".")) == len(owner) and all(w in ("*", p) for p, w in zip(name.split("."), owner))
        for owner in owners)]


def between_region_norms(model, plan: dict) -> list[str]:
    """The norms sequence parallel runs on sequence shards: leaf RMSNorm / LayerNorm modules outside
    every module that owns a colwise linear of the TP plan `plan` ({path pattern: style}; paths
    relative to `model`). A norm inside the attention (Qwen3's per-head q_norm) sees this rank's heads,
    not the stream between the regions."""
    owners = _owner_patterns(plan)

    def inside(name: str) -> bool:
        parts = name.split(".")
        return any(len(parts) > len(owner) and all(w in ("*", p) for p, w in zip(parts, owner)) for owner in owners)

    return [name for name, module in model.named_modules()
            if name and type(module).__name__.endswith(("RMSNorm", "LayerNorm")) and not list(module.children())
            and not inside(name)]


def routed_expert_params(block, num_experts: int) -> int:
    """The routed experts' parameters in a block: tensors under a module named `experts` (transformers'
    MoE blocks: `mlp.experts.gate_up_proj`, `block_sparse_moe.experts.down_proj`; not `shared_experts`)
    with one row per expert."""
    if not num_experts:
        return 0
    return sum(p.numel() for name, p in block.named_parameters()
               if "experts" in name.split(".")[:-1] and p.dim() >= 2 and p.shape[0] == num_experts)
