"""Expert parallelism for the FSDP2 engine through transformers' own (transformers.distributed): the
model's `base_model_ep_plan` ("grouped_gemm" experts, "ep_dispatch_experts" routing) shards each MoE
block's routed experts over ep ranks, which exchange their tokens with autograd all-to-alls
(`ep_implementation="all_to_all"`); then FSDP2 shards the dispatched experts over the ranks that share an
expert shard (its `efsdp` mesh) and everything else over all the data-parallel ranks (`fsdp`), as
torchtitan does. shardfit drives it (`prepare_distribute_model` / `maybe_distribute_model` on the model
it built): it writes no sharding or collective of its own.

ep borrows its ranks from the data-parallel ones (spec/parallelism.py: ep divides dp_shard), so every
rank still reads its own batch.
"""
from __future__ import annotations

from shardfit.errors import ShardfitError


def check(plan, model) -> None:
    par, t = plan.parallelism, plan.training
    if par.tp > 1 or par.pp > 1 or par.cp > 1:
        raise ShardfitError(f"the expert-parallel engine runs ep over data-parallel FSDP2 ranks only (tp = {par.tp}, "
                            f"pp = {par.pp}, cp = {par.cp}): set them to 1, or ep to 1")
    if par.dp_replicate > 1:
        raise ShardfitError("the expert-parallel engine shards over every data-parallel rank (FSDP2): set "
                            "parallelism.dp_replicate to 1")
    if t.activation_checkpointing != "none" or t.lora is not None or t.loss == "chunked":
        raise ShardfitError("the expert-parallel engine runs without activation checkpointing, LoRA and the chunked "
                            "loss so far: set --ac none, no LoRA, --loss standard (or ep 1)")
    if t.precision not in ("fp32", "bf16") or plan.strategy.offload_params:
        raise ShardfitError(f"the expert-parallel engine runs fp32 or bf16 (FSDP2 mixed precision) without offload, not "
                            f"{t.precision}{' with offload' if plan.strategy.offload_params else ''}")
    ep_plan = dict(getattr(model.config, "base_model_ep_plan", None) or {})
    if "ep_dispatch_experts" not in ep_plan.values():
        raise ShardfitError(f"{type(model).__name__} has no expert-parallel plan (transformers' base_model_ep_plan with "
                            "an ep_dispatch_experts rule): set parallelism.ep to 1")


def apply(plan, model, ctx):
    """`model` (built whole on this rank, the same on every rank) with its experts sharded over ep and
    FSDP2 over the data-parallel ranks; returns the distributed model."""
    from transformers.distributed import DistributedConfig

    check(plan, model)
    config = DistributedConfig(fsdp_size=ctx.world_size, ep_size=plan.parallelism.ep, ep_implementation="all_to_all",
                               fsdp_mixed_precision=plan.training.precision == "bf16")
    config, _, meshes = model.prepare_distribute_model(config, None)
    return type(model).maybe_distribute_model(model, config, meshes)
