"""Pipeline parallelism through torch.distributed.pipelining: each rank builds a PipelineStage per chunk
of contiguous layers of a transformers decoder it holds (torchtitan's manual split, not the tracer:
`pipeline()` needs an fx-traceable forward, which transformers' masks and rotary caches are not), and
one of torch's schedules runs the plan's micro-batches through the stages: GPipe, 1F1B, interleaved 1F1B
and the zero-bubble ones (ZB1P, ZB-V, DualPipeV: each backward split into the input gradient and a
later weight gradient). Several chunks per rank under the interleaved ones (pp_virtual_stages: chunk k
of pp x v, in model order, on rank k % pp) and two in a V under ZB-V and DualPipeV (rank r runs chunks
r and 2p - 1 - r: spec/parallelism.rank_chunks).

The first stage owns the token embedding, the last the final norm, the head and the loss; every
stage recomputes the rotary embedding and the causal mask from the sequence length (cheap, and no
extra tensor crosses the stage boundary: only the hidden states, which is what the estimator's p2p
buffers count). Inside a stage (world = pp x dp x tp, pp outermost, tp innermost: torchtitan's
order): tensor parallel over the stage's tp ranks with the model's own transformers TP plan (its paths
taken relative to the stage), then DDP or FSDP2 over its dp ranks (FSDP2 when tp > 1 too). Each tp
rank sends its hidden states (replicated, or its sequence shard) to the same tp rank of the next stage. Under the plan's
loss_parallel the last stage's head leaves its logits vocab-sharded and the schedule's loss and its
backward run under torch's loss_parallel. Under sequence parallel a stage receives and sends its tp
rank's sequence shard of the hidden states (the estimator's p2p buffers / tp), a Shard(1) DTensor inside
the stage. No context or expert parallel inside a stage yet.

forward_backward(batch, last) collects micro-batches until `last`, then runs the whole schedule once
(forward and backward of all of them): the plan's pp_microbatches are its grad_accum micro-batches.
"""
from __future__ import annotations

from contextlib import contextmanager, nullcontext

import torch
import torch.distributed as dist
from torch.distributed.tensor.parallel import loss_parallel

from shardfit.engines import base, pipeline_state, sequence_parallel
from shardfit.engines import tensor_parallel as tpar
from shardfit.engines.native import dcp_checkpoint
from shardfit.errors import ShardfitError
from shardfit.spec.parallelism import (MULTI_CHUNK_SCHEDULES, SPLIT_BACKWARD_SCHEDULES, TORCH_SCHEDULES, chunk_layers,
                                       chunk_rank, holds_edges, rank_chunks, resolve)


class StageModule(torch.nn.Module):
    """One pipeline rank's part of a decoder-only transformers model (llama-style: base.embed_tokens,
    base.layers, base.norm, base.rotary_emb, lm_head)."""

    def __init__(self, model, first: int, count: int, is_first: bool, is_last: bool, autocast=None):
        super().__init__()
        # bf16 under DDP or unwrapped: autocast around the stage's forward (the schedule calls it; the
        # backward it records runs outside). FSDP2 casts the gathered parameters itself.
        self._autocast = autocast or nullcontext
        inner = model.get_base_model() if hasattr(model, "get_base_model") else model
        body = getattr(inner, inner.base_model_prefix)
        self.config = inner.config
        self.embed_tokens = body.embed_tokens if is_first else None
        self.layers = torch.nn.ModuleList(body.layers[first:first + count])
        self.indices = range(first, first + count)  # the layers' indices in the whole model
        self.rotary_emb = body.rotary_emb
        self.norm = body.norm if is_last else None
        self.lm_head = inner.lm_head if is_last else None
        self.sequence_mesh = None  # the tp mesh under sequence parallel (set by _tensor_parallel)
        self.split_backward = False  # under a zero-bubble schedule (set by setup)

    def forward(self, hidden):
        with self._autocast():
            return self._forward(hidden)

    def _forward(self, hidden):
        from transformers.masking_utils import create_causal_mask

        if self.embed_tokens is not None:
            hidden = self.embed_tokens(hidden)
        elif self.sequence_mesh is not None:
            # Sequence parallel: a stage receives this tp rank's sequence shard and sends its own (the
            # residual stream between the TP regions is a Shard(1) DTensor inside the stage).
            from torch.distributed.tensor import DTensor, Shard

            hidden = DTensor.from_local(hidden, self.sequence_mesh, [Shard(1)])
        positions = torch.arange(hidden.shape[1], device=hidden.device).unsqueeze(0)
        mask = create_causal_mask(config=self.config, inputs_embeds=hidden, attention_mask=None, cache=None,
                                  position_ids=positions)
        rotary = self.rotary_emb(hidden, position_ids=positions)
        for layer in self.layers:
            hidden = layer(hidden, attention_mask=mask, position_embeddings=rotary, position_ids=positions)
        if self.lm_head is not None:
            return self.lm_head(self.norm(hidden))
        if self.sequence_mesh is None:
            return hidden
        # NOTE: to_local() is a view, and the zero-bubble schedules detach a stage's output in place after its
        # input gradient ("Can't detach views in-place"): there the stage sends a copy.
        return hidden.to_local().clone() if self.split_backward else hidden.to_local()


def stack_microbatches(batches: list[dict], seq_len: int, device) -> tuple:
    """(input ids, labels) of the schedule's whole batch: every micro-batch padded on the right to the
    plan's seq_len. The stages' receive buffers are shaped once, by the first step, and the loop's
    batches are padded only to their own longest example; a right pad masked out of the loss (-100)
    leaves a causal model's real-token logits and its loss unchanged."""
    def pad(tensor, value):
        return torch.nn.functional.pad(tensor, (0, seq_len - tensor.shape[1]), value=value)

    ids = torch.cat([pad(b["input_ids"], 0) for b in batches]).to(device)
    labels = torch.cat([pad(b["labels"], -100) for b in batches]).to(device)
    return ids, labels


def check(plan, model, ctx) -> None:
    par = plan.parallelism
    if par.cp > 1 or par.ep > 1 or ctx.world_size % (par.pp * par.tp):
        raise ShardfitError(f"the pipeline engine runs pp x dp x tp (world = pp x dp x tp) so far: pp = {par.pp}, "
                            f"tp = {par.tp} on {ctx.world_size} ranks with cp = {par.cp}, ep = {par.ep}; cp/ep x pp "
                            "are plan / emit only (issue 14)")
    dp = ctx.world_size // (par.pp * par.tp)
    if dp > 1 and plan.strategy.kind not in ("ddp", "fsdp2"):
        raise ShardfitError(f"data parallel inside a pipeline stage runs under ddp or fsdp2, not "
                            f"{plan.strategy.label}: use --strategy ddp or fsdp2")
    if dp > 1 and par.tp > 1 and plan.strategy.kind != "fsdp2":
        raise ShardfitError("data parallel over tensor-parallel stages runs under fsdp2 (FSDP2 x TP, torchtitan's "
                            f"composition), not {plan.strategy.label}: use --strategy fsdp2")
    if plan.training.precision not in ("fp32", "bf16"):
        raise ShardfitError(f"the pipeline engine runs fp32 and bf16 (autocast / FSDP2 mixed precision), not "
                            f"{plan.training.precision}: use --precision bf16")
    if plan.training.lora is not None or plan.training.activation_checkpointing != "none":
        raise ShardfitError("the pipeline engine runs without LoRA and activation checkpointing so far")
    if getattr(model.config, "tie_word_embeddings", False):
        raise ShardfitError(f"{plan.model.name} ties its head to its embedding, which would sit on two stages: "
                            "the pipeline engine runs untied models only")
    body = getattr(model, model.base_model_prefix, None)
    if not all(hasattr(body, name) for name in ("embed_tokens", "layers", "norm", "rotary_emb")):
        raise ShardfitError(f"{type(model).__name__} is not a llama-style decoder (embed_tokens, layers, norm, "
                            "rotary_emb): the pipeline engine cannot split it")


@contextmanager
def _forward_only(schedule):
    """The schedule running only the forwards of its action lists, with their sends and receives, in
    torch's own lowered order (DualPipeV's overlapped forward + backward keeps its forward): torch
    validates any list it lowers for a full backward, so the lowered one is filtered instead. The same
    schedule object, so its stages switch between training and evaluation as under 1F1B."""
    from torch.distributed.pipelining.schedules import FORWARD, RECV_F, SEND_F

    def forwards(action):
        if action.sub_actions:
            return [a for sub in action.sub_actions for a in forwards(sub)]
        return [action] if action.computation_type in (FORWARD, SEND_F, RECV_F) else []

    lowered = schedule.pipeline_order_with_comms
    schedule.pipeline_order_with_comms = {rank: [a for action in actions for a in forwards(action)]
                                          for rank, actions in lowered.items()}
    try:
        yield
    finally:
        schedule.pipeline_order_with_comms = lowered


def _drop_other_stages(model, modules) -> None:
    """Free the parameters of every layer this rank's stage does not run (torchtitan deletes them from
    its meta-built copy). The rank built the whole model: left alone, the other stages' weights stay
    referenced by it for the whole run. Measured (pp = 2 x dp = 2, tiny-llama): 451,584 B of the other
    stage's weights alive beside the stage's own in every phase."""
    kept = {id(t) for module in modules for t in (*module.parameters(), *module.buffers())}
    for sub in model.modules():
        for name, param in list(sub.named_parameters(recurse=False)):
            if id(param) not in kept:
                setattr(sub, name, torch.nn.Parameter(param.to("meta"), requires_grad=param.requires_grad))


def _tensor_parallel(model, module, tp_mesh, loss_parallel: bool = False, sp: bool = False) -> None:
    """The model's transformers TP plan on this stage's part of it: each path taken relative to the
    stage (the base model's prefix dropped), and only those that name a module the stage holds; under
    loss_parallel the head leaves its logits vocab-sharded (tensor_parallel.tp_styles)."""
    from fnmatch import fnmatchcase

    prefix = model.base_model_prefix + "."
    names = [name for name, _ in module.named_modules() if name]
    wanted = {}
    for path, style in tpar.model_tp_plan(model).items():
        local = path[len(prefix):] if path.startswith(prefix) else path
        if any(len(n.split(".")) == len(local.split(".")) and fnmatchcase(n, local) for n in names):
            wanted[local] = style
    styles = tpar.tp_styles(sp=sp, vocab_sharded=loss_parallel)
    tpar.parallelize(module, tp_mesh, wanted, type(model).__name__, styles)
    if sp:
        sequence_parallel.shard_between_regions(module, tp_mesh, wanted)
        module.sequence_mesh = tp_mesh


def _data_parallel(plan, module, mesh):
    """The stage's data parallel over its dp ranks: DDP (the schedule's backward skips its all-reduce on
    every micro-batch but the last) or FSDP2 on each block and the stage (torchtitan's composition;
    the schedule defers resharding and the reduce-scatter to the last micro-batch)."""
    if plan.strategy.kind == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        return DistributedDataParallel(module, process_group=mesh.get_group())
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    low = base.low_precision_dtype(plan)
    policy = MixedPrecisionPolicy(param_dtype=low, reduce_dtype=torch.float32) if low else MixedPrecisionPolicy()
    for layer in module.layers:
        fully_shard(layer, mesh=mesh, reshard_after_forward=False, mp_policy=policy)
    return fully_shard(module, mesh=mesh, reshard_after_forward=False, mp_policy=policy)


def setup(plan, model, ctx) -> base.Engine:
    from torch.distributed import pipelining
    from torch.distributed.device_mesh import init_device_mesh

    check(plan, model, ctx)
    layout = resolve(plan)
    stages, tp = layout.pp, layout.tp
    dp = ctx.world_size // (stages * tp)
    # pp outermost, tp innermost (torchtitan's order): the ranks of one stage are dp x tp consecutive
    # ranks, and the stage's dp index is the data rank (tensor_parallel.data_rank: measure/worker.py and
    # train read data by it).
    stage_index = ctx.rank // (dp * tp)
    mesh = init_device_mesh(ctx.device.type, (stages, dp, tp), mesh_dim_names=("pp", "dp", "tp"))
    # pp x v chunks of contiguous layers in model order (v = 1 but under the multi-chunk schedules: one
    # chunk per rank), placed on the ranks as the schedule places them.
    chunks = stages * layout.virtual
    counts = chunk_layers(plan.model.num_layers, chunks)
    mine = list(rank_chunks(stage_index, stages, layout.virtual, layout.schedule))
    autocast = None if (plan.strategy.kind == "fsdp2" and dp > 1) else (lambda: base.autocast(plan, ctx))
    modules = [StageModule(model, sum(counts[:k]), counts[k], k == 0, k == chunks - 1, autocast) for k in mine]
    _drop_other_stages(model, modules)
    for module in modules:
        module.split_backward = layout.schedule in SPLIT_BACKWARD_SCHEDULES
        module.to(ctx.device)
        if tp > 1:
            _tensor_parallel(model, module, mesh["tp"], layout.loss_parallel, layout.sequence_parallel)
    wrapped = [_data_parallel(plan, module, mesh["dp"]) if dp > 1 else module for module in modules]
    pp_group = mesh["pp"].get_group()
    pipeline_stages = [pipelining.PipelineStage(w, k, chunks, ctx.device, group=pp_group) for w, k in zip(wrapped, mine)]
    vocab = model.config.vocab_size

    def loss_fn(logits, labels):
        # The model's own causal-LM loss (shifted, mean over tokens) on one micro-batch; the schedule
        # scales the gradients by 1 / micro-batches, as accumulation would.
        return model.loss_function(logits=logits, labels=labels, vocab_size=vocab)

    schedule = getattr(pipelining, TORCH_SCHEDULES[layout.schedule])(
        pipeline_stages if layout.schedule in MULTI_CHUNK_SCHEDULES else pipeline_stages[0],
        n_microbatches=layout.microbatches, loss_fn=loss_fn)
    # torch's zero-bubble schedules cannot run forward only (their eval walks the I / W actions too:
    # "can't steal_bwd_input if this stage doesn't have backward"): the held-out loss runs their own
    # forward actions only (_forward_only).
    split_backward = layout.schedule in SPLIT_BACKWARD_SCHEDULES
    vocab_sharded = tp > 1 and layout.loss_parallel
    # FSDP2's sharded parameters where it wrapped a chunk
    params = [p for module in modules for p in base.trainable_params(module)]
    module = modules[0] if len(modules) == 1 else torch.nn.ModuleList(modules)
    root = pipeline_state.named_root(model, modules)
    optimizer = base.build_optimizer(plan, params)
    scheduler = base.build_scheduler(plan, optimizer)
    pending: list[dict] = []
    # The ranks that feed the ids and compute the loss: under a V schedule rank 0 does both.
    is_first, is_last = holds_edges(stage_index, stages, layout.virtual, layout.schedule)
    loss_rank = chunk_rank(chunks - 1, stages, layout.virtual, layout.schedule)

    def forward_backward(batch: dict, last: bool):
        pending.append(batch)
        if not last:
            return torch.zeros(())
        ids, labels = stack_microbatches(pending, plan.training.seq_len, ctx.device)
        pending.clear()
        # The sum of the micro-batch losses, known on the last stage: sent to the ranks of its pipeline.
        # Returned for the last micro-batch only (0 for the others), so the loop's sum over micro-batches
        # is the same as an engine's that returns each one's.
        loss = run_schedule(schedule.step, ids, labels)
        dist.broadcast(loss, group=pp_group, group_src=loss_rank)
        return loss

    def run_schedule(run, ids, labels) -> torch.Tensor:
        """schedule.step or .eval on this rank's part (the first stage feeds the ids, the last the
        labels); the summed micro-batch losses on the last stage, 0 on the others. NOTE:
        return_outputs=False: otherwise the last stage keeps every micro-batch's logits (m*b*s*V*d)
        until the next step, only to hand them back merged."""
        losses: list = []
        # Under the vocab-parallel loss the last stage's logits are vocab-sharded DTensors: the schedule's
        # loss and its backward run under torch's loss_parallel; each loss is a replicated DTensor.
        with loss_parallel() if vocab_sharded else nullcontext():
            if is_first:
                run(ids, target=labels if is_last else None, losses=losses, return_outputs=False)
            elif is_last:
                run(target=labels, losses=losses, return_outputs=False)
            else:
                run(return_outputs=False)
        losses = [x.to_local() if hasattr(x, "to_local") else x for x in losses]
        return torch.stack([x.detach().float() for x in losses]).sum() if is_last else torch.zeros(())

    def eval_loss(batches: list[dict]) -> torch.Tensor:
        """The summed loss of the schedule's micro-batch count of held-out micro-batches, forward only:
        on the last stage's ranks (0 on the others)."""
        ids, labels = stack_microbatches(batches, plan.training.seq_len, ctx.device)
        for part in modules:
            part.eval()
        try:
            with torch.no_grad():
                with _forward_only(schedule) if split_backward else nullcontext():
                    return run_schedule(schedule.eval, ids, labels)
        finally:
            for part in modules:
                part.train()

    def step():
        # The norm over every stage's parameters in one all-reduce, each element counted once: a stage's
        # dp x tp ranks hold its parameters (replicated, TP-sharded or FSDP2-sharded over them).
        max_norm = plan.schedule.grad_clip
        norm = tpar.clip_grad_norm(params, max_norm if max_norm and max_norm > 0 else float("inf"),
                                   holders=dp * tp)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        return float(norm), True

    def zero_grad():
        optimizer.zero_grad(set_to_none=True)

    @contextmanager
    def inference():
        raise ShardfitError("the pipeline engine cannot run the whole model on one rank (generation): its "
                            "held-out loss runs through the schedule (eval_loss)")
        yield  # pragma: no cover

    save, save_async, load = dcp_checkpoint(root, optimizer)

    def full_state():
        return pipeline_state.full_state(model, root, ctx, stage_index, dp * tp, counts, stages, layout.schedule)

    # model: what runs forward (the stage, or an interleaved rank's chunks); module: this rank's part
    # under the full model's names, with its config (checkpoints, export).
    return base.Engine(kind="pipeline", plan=plan, ctx=ctx, model=module, module=root, optimizer=optimizer,
                       scheduler=scheduler, forward_backward=forward_backward, step=step, zero_grad=zero_grad,
                       save=save, load=load, inference=inference, full_state=full_state, save_async=save_async,
                       extra_state=lambda: {"scheduler": scheduler.state_dict()},
                       load_extra_state=lambda state: scheduler.load_state_dict(state["scheduler"]),
                       eval_loss=eval_loss)

