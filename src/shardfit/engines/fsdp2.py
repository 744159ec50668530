"""FSDP2: `fully_shard` on each block, then on the root; DTensor parameters sharded over a 1-D mesh,
or over a 2-D (replicate, shard) mesh for HSDP. The optimizer is created after sharding so it holds
the sharded parameters."""
from __future__ import annotations

import dataclasses
import logging
import warnings
from contextlib import contextmanager

import torch
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

from shardfit.engines import base, expert_parallel, native, tensor_parallel
from shardfit.errors import ShardfitError
from shardfit.spec.fsdp_units import separate_embedding_units


def embedding_units(plan, model):
    """(token embedding, output head) modules to wrap as units of their own, or (None, None) to leave
    them in the root. The model's own tie decides too: a head whose weight is the embedding's is one
    parameter, which one unit must own."""
    if not separate_embedding_units(plan.strategy, plan.model) or plan.parallelism.tp > 1:
        # NOTE: under TP the rank-local estimate (estimate/model_parallel.py) keeps the vocab-sharded
        # embedding and head in the root unit; torchtitan's separate units there are not modelled yet.
        return None, None
    embedding, head = model.get_input_embeddings(), model.get_output_embeddings()
    if embedding is None or head is None or embedding.weight is head.weight:
        if plan.strategy.embedding_units == "separate":
            raise ShardfitError(f"{plan.model.name}'s head is tied to its embedding (one weight): it cannot be two "
                                "FSDP units; use strategy.embedding_units auto or root")
        return None, None
    return embedding, head


def _fully_shard(plan, model, blocks_cls, mesh, policy, offload):
    """shardfit's FSDP2 units: each block, the embedding and head on their own when the plan says so,
    the root; returns the head's unit (None when it stays in the root)."""
    s = plan.strategy
    kwargs = {"mesh": mesh, "mp_policy": policy}
    if offload is not None:
        kwargs["offload_policy"] = offload
    embedding, head = embedding_units(plan, model)
    if embedding is not None:
        # torchtitan's wrapping (spec/fsdp_units.py): the embedding resharded after its forward, the head kept
        # gathered until its backward (which comes at once) and reduce-scattered right after it.
        fully_shard(embedding, reshard_after_forward=s.reshard_after_forward, **kwargs)
    for block in [m for m in model.modules() if isinstance(m, blocks_cls)]:
        fully_shard(block, reshard_after_forward=s.reshard_after_forward, **kwargs)
    if head is not None:
        fully_shard(head, reshard_after_forward=False, **kwargs)
    # The root's own parameters (the final norm; the embedding and head unless wrapped above) are needed
    # right away by backward: keep them gathered.
    fully_shard(model, reshard_after_forward=False, **kwargs)
    return head


def setup(plan, model, ctx) -> base.Engine:
    s = plan.strategy
    model, blocks_cls = base.prepare_model(plan, model)
    model = model.to(ctx.device)
    low = base.low_precision_dtype(plan)
    policy = MixedPrecisionPolicy()
    if low is not None and plan.training.precision != "bf16-pure":
        policy = MixedPrecisionPolicy(param_dtype=low, reduce_dtype=torch.float32)
    # NOTE: pinned memory needs CUDA; on CPU the policy must not pin.
    offload = CPUOffloadPolicy(pin_memory=ctx.device.type == "cuda") if s.offload_params else None
    mesh = base.device_mesh(ctx, base.hybrid_group(plan, ctx))
    if plan.parallelism.tp > 1:  # FSDP2 x TP: the blocks' linears sharded over tp first (tensor_parallel.py)
        mesh = tensor_parallel.apply(plan, model, ctx)
        # NOTE: the gathered logits come out of the TP head as a view, and FSDP2 warns (on every rank) that an
        # in-place op on it would skip its pre-backward hook. The loss reads the logits out of place
        # (engines/chunked_loss.py): tp = 2 matches data parallel's losses and gradient norms (tests/train).
        warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module .* returned a view tensor",
                                category=UserWarning)
    if plan.parallelism.ep > 1:
        # Expert parallel: transformers shards the experts over ep and applies FSDP2 itself (its units:
        # the dispatched experts on their own mesh, each block, the final norm with the head, the root).
        model, head = expert_parallel.apply(plan, model, ctx), None
    else:
        head = _fully_shard(plan, model, blocks_cls, mesh, policy, offload)
    params = base.trainable_params(model)
    optimizer = base.build_optimizer(plan, params)
    scheduler = base.build_scheduler(plan, optimizer)
    scaler = base.sharded_scaler(plan, ctx)

    @contextmanager
    def sync(enabled: bool):  # every micro-batch reduces (below), whatever `enabled` says
        # NOTE: gradients are reduce-scattered on every micro-batch, as torchtitan does. With
        # set_requires_gradient_sync(False) each unit would keep its whole gradient in the reduce dtype
        # until the last micro-batch: measured (0.82M-parameter Llama, 2 ranks, accumulation 2) 3.28 MB
        # of fp32 gradients where the sharded ones are 1.64 MB. The memory estimate and fit's step time
        # (a reduce-scatter per micro-batch) both plan this way.
        yield

    def clip(max_norm: float):
        if plan.parallelism.tp > 1 or plan.parallelism.ep > 1:  # DTensors on more than one mesh
            return tensor_parallel.clip_grad_norm(params, max_norm)
        return torch.nn.utils.clip_grad_norm_(params, max_norm, foreach=False)

    def full_state():
        skip = base.tied_duplicates(base.unwrap(model))
        if plan.parallelism.tp > 1:
            # NOTE: gathering a (dp, tp) DTensor whole takes two all-gathers, which DTensor warns about
            # on every rank; for an export that runs once this is the expected cost, not news.
            logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
        for name, tensor in model.state_dict().items():
            if name in skip:
                continue
            # One parameter at a time: all ranks all-gather it, rank 0 keeps a host copy.
            full = tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor
            yield name, (full.detach().cpu() if ctx.is_main else None)

    engine = native.build_engine("fsdp2", plan, ctx, model, base.unwrap(model), optimizer, scheduler, scaler,
                                 sync, clip, full_state)
    forward_only = engine.inference

    @contextmanager
    def inference():
        # Generation runs many forwards: gather every unit once and keep it gathered until the end,
        # instead of an all-gather per block per token.
        model.set_reshard_after_forward(False)
        try:
            with forward_only() as wrapped:
                yield wrapped
        finally:
            model.set_reshard_after_forward(s.reshard_after_forward)
            model.set_reshard_after_forward(False, recurse=False)  # the root stays gathered, as in training
            if head is not None:
                head.set_reshard_after_forward(False)
            model.reshard()
            for module in model.modules():
                if module is not model and hasattr(module, "reshard"):
                    module.reshard()

    return dataclasses.replace(engine, inference=inference)
