"""LoRA under FSDP: what the frozen base costs in gradients, per engine, as each really works.

FSDP2 (per-parameter DTensor sharding) gives a gradient, an unsharded-gradient buffer and a
reduce-scatter only to parameters with requires_grad: under LoRA that is the adapters alone, and
the root (embeddings, head) reduces nothing.

FSDP1 flattens each unit into one FlatParameter. With use_orig_params=True frozen and trainable
parameters may share it (torch/distributed/fsdp/_flat_param.py `_validate_tensors_to_flatten`: the
flat parameter's requires_grad is the OR of its tensors'), so autograd produces the gradient of the
whole flat parameter: the unit's full unsharded gradient, its reduce-scatter, and a sharded fp32
gradient of the whole unit kept until the next forward -- a full fine-tune's gradients, zeros for the
frozen part. A unit with no adapter (the root) has requires_grad False and none of it. The optimizer
sees the original parameters as views of each rank's contiguous slice, so the adapters belong to the
ranks whose slices hold them: measured on tiny-llama, rank 0 holds every q/k/v/o adapter.
"""
from __future__ import annotations

from shardfit.estimate.states import block_linears, model_linears


def _block_layout(model, rank: int, targets: tuple[str, ...]) -> list[tuple[int, bool]]:
    """(elements, trainable) of one block's parameters in registration order: each linear's weight,
    then peft's lora_A (r x in) and lora_B (out x r) when it is a target; the norms (the rest) last."""
    wanted, everything = set(targets), "all-linear" in targets
    layers = max(model.num_layers, 1)
    if model.derived:
        linears = [(name, i, o, max(1, round(n / layers))) for name, i, o, n in model.linears]
    else:
        linears = list(block_linears(model))
    out, used = [], 0
    for name, n_in, n_out, copies in linears:
        for _ in range(copies):
            out.append((n_in * n_out, False))
            used += n_in * n_out
            if everything or name in wanted:
                out += [(rank * n_in, True), (rank * n_out, True)]
    rest = max(0, model.block_params - used)
    if rest:
        out.append((rest, False))
    return out


def fsdp1_adapter_share(model, rank: int, targets: tuple[str, ...], shard: int) -> float:
    """The largest fraction of a unit's adapter elements inside one rank's contiguous slice of the
    unit's FlatParameter (1/shard when they spread evenly; 1.0 when one rank holds them all)."""
    layout = _block_layout(model, rank, targets)
    total = sum(n for n, _ in layout)
    adapters = sum(n for n, trained in layout if trained)
    if not adapters or shard <= 1:
        return 1.0
    size = -(-total // shard)  # FSDP1 pads the flat parameter to a multiple of the world size
    best = 0
    for k in range(shard):
        lo, hi, pos, held = k * size, (k + 1) * size, 0, 0
        for n, trained in layout:
            if trained:
                held += max(0, min(hi, pos + n) - max(lo, pos))
            pos += n
        best = max(best, held)
    return best / adapters


def largest_adapter(model, rank: int, targets: tuple[str, ...]) -> int:
    """Elements of the largest adapter matrix (lora_A r x in, lora_B out x r): the optimizer's largest tensor."""
    wanted, everything = set(targets), "all-linear" in targets
    sizes = [rank * max(i, o) for name, i, o, _ in model_linears(model) if everything or name in wanted]
    return max(sizes, default=0)


def fsdp_lora_states(st, kind: str, model, lora, trained: int, shard: int, precision: str) -> int:
    """Adjust FSDP's model states (`st`, from states.model_states) for LoRA and return the trained
    elements per unit (what FSDP2 reduces per block). FSDP1: the sharded flat grad of every unit that holds
    an adapter (the whole unit), and the adapters' optimizer state on the ranks whose slices hold them."""
    per_unit = trained // max(model.num_layers, 1)
    if kind != "fsdp" or not model.has_shape or st.host:
        return per_unit
    targets = tuple(lora.target_modules)
    share = fsdp1_adapter_share(model, lora.rank, targets, shard)
    blocks = model.n_params - model.non_block_params + trained
    grad_bytes = 2 if precision == "bf16-pure" else 4  # the flat parameter's (fp32 master) dtype
    st.grads_full = int(grad_bytes * blocks / shard)
    st.optimizer = int(st.optimizer * share * shard)
    st.trained_per_rank = int(trained * share)
    return per_unit
