"""The estimator's last step: the activations and the states composed into the five phases' peaks, and
the runtime overhead on top of the tensor peak."""
from __future__ import annotations

from shardfit.estimate import overhead as ovh
from shardfit.estimate import traced_phases
from shardfit.estimate.step_activations import Activations, Recorder
from shardfit.estimate.step_states import States


def phases_step(plan, acts: Activations, states: States) -> tuple[dict[str, dict[str, int]], int]:
    """(phase -> category -> bytes, the tensor peak over the phases)."""
    buf, params, opt = states.buffers, states.params, states.optimizer
    grads_full = states.grads_full
    grads_optimizer = grads_full + states.grads_step if states.grads_optimizer is None else states.grads_optimizer
    params_optimizer = params if states.params_optimizer is None else states.params_optimizer
    grads_persistent = states.grads_persistent
    # At rest (before a step's first micro-batch, at a checkpoint save) the step before has set the
    # accumulated gradients to None: only what an engine keeps across steps is there.
    rest = max(grads_persistent, buf.grads_rest)
    if plan.training.grad_accum > 1:
        # Gradients accumulate across micro-steps: the next forward runs with them allocated.
        grads_persistent = max(grads_persistent, grads_full)
    if acts.traced_step is not None:
        acts_f, temps_f = traced_phases.forward_peak(acts.traced_step, buf)
    else:
        acts_f, temps_f = _forward_peak(acts, buf)
    acts_b, grads_b, temps_b = _backward_peak(plan, acts, buf, states, grads_persistent, grads_full)
    phases = {
        "load": {"params": params, "grads": rest, "optimizer": opt, "activations": 0, "temporaries": buf.rest},
        "forward": {"params": params, "grads": grads_persistent, "optimizer": opt,
                    "activations": acts_f, "temporaries": temps_f},
        "backward": {"params": params, "grads": grads_b, "optimizer": opt, "activations": acts_b, "temporaries": temps_b},
        "optimizer": {"params": params_optimizer, "grads": grads_optimizer, "optimizer": opt, "activations": 0,
                      "temporaries": buf.opt},
        "checkpoint": {"params": params, "grads": rest, "optimizer": opt, "activations": 0, "temporaries": buf.ckpt},
    }
    peak = params + opt + max(rest + buf.rest, grads_persistent + acts_f + temps_f, grads_b + acts_b + temps_b,
                              grads_optimizer + buf.opt + params_optimizer - params, rest + buf.ckpt)
    return phases, peak


def _forward_peak(acts: Activations, buf) -> tuple[int, int]:
    """Forward peaks at the loss (every activation + the logits) or inside the last block (its gathered
    units / eager scores and, when checkpointed, its working set; no head activations yet), whichever
    is larger. Returns (activations, temporaries)."""
    best = (acts.blocks + acts.head,
            buf.fwd_loss + acts.loss_forward + acts.loss_inputs + acts.weight_copies_forward)
    inside = (acts.blocks + acts.before_head,
              buf.fwd_block + acts.attention_forward + acts.weight_copies_forward + acts.forward_work)
    for candidate in [inside] + [(saved, buf.fwd_block + acts.weight_copies_forward + temps)
                                 for saved, temps in acts.traced_inside]:
        if sum(candidate) > sum(best):
            best = candidate
    return best


def _backward_peak(plan, acts: Activations, buf, states: States, grads_persistent: int,
                   grads_full: int) -> tuple[int, int, int]:
    """Backward peaks at its start (all activations + loss gradients), inside the first block it
    reaches (a recomputed block + one block's gradient working set), inside the last block (nearly
    every gradient + that block's activations) or at its end (all gradients); the largest wins.
    Returns (activations, grads, temporaries)."""
    if acts.traced_step is not None:
        return traced_phases.backward_peak(plan, acts.traced_step, buf, states, grads_persistent)
    model = plan.model
    best = (acts.blocks + acts.head, grads_persistent + acts.loss_grads,
            buf.start + acts.loss_backward + acts.weight_copies)
    done = 1.0 - (model.block_params + model.vocab_size * model.hidden_size) / model.n_params \
        if model.has_shape and model.n_params else 0.0
    grads_last = grads_persistent + int((grads_full - grads_persistent) * max(done, 0.0))
    grads_reduced, acts_reduced = grads_persistent, acts.blocks
    if buf.grads_early is not None:  # allocated whole at the first reduction
        grads_reduced = grads_last = buf.grads_early
        # ...which comes only once reduce_bucket_size gradient elements exist: the head's, then those of
        # the last blocks, whose backward has already freed their activations (DeepSpeed ZeRO-1/2).
        if model.has_shape and model.block_params and model.num_layers:
            head = model.vocab_size * model.hidden_size
            bucket = plan.strategy.reduce_bucket_size
            blocks_done = min(model.num_layers, -(-max(0, bucket - head) // model.block_params))
            acts_reduced = int(acts.blocks * (1 - blocks_done / model.num_layers))
    head_grad = buf.head_grad
    head_late = head_grad if buf.head_grad_late is None else buf.head_grad_late
    # FSDP's unsharded root gradients (the head's in the root unit, the embedding's at the end) are
    # .grad of unsharded parameters until the root reduces: temporaries, as the tracker files them.
    root_unsharded = buf.fsdp is not None and not buf.fsdp.separate
    for acts_b, grads_b, temps_b, unsharded in (
            (acts.blocks + acts.recompute, grads_persistent, buf.inside + acts.backward_work + acts.weight_copies,
             head_grad),
            (acts_reduced, grads_reduced, buf.reduce + acts.weight_copies, head_grad),
            (acts.last_block, grads_last, buf.last + acts.backward_work, head_late),
            (0, grads_full, buf.end + (buf.end_grads if buf.fsdp is not None else 0),
             head_late + (0 if buf.fsdp is not None else buf.end_grads))):
        candidate = (acts_b, grads_b, temps_b + unsharded) if root_unsharded else (acts_b, grads_b + unsharded, temps_b)
        if sum(candidate) > sum(best):
            best = candidate
    return best


def overhead_step(plan, shard: int, peak: int, *, device: str, accounting: str,
                  record: Recorder | None) -> dict[str, int]:
    cluster = plan.cluster
    world = cluster.world_size
    if device == "cuda" and accounting == "real":
        hybrid = shard not in (1, world)
        overhead = {"cuda_context": ovh.cuda_context_bytes(),
                    "nccl": ovh.nccl_buffer_bytes(world, cluster.nodes, 2 if hybrid else 1),
                    "allocator_margin": ovh.allocator_margin_bytes(peak)}
    else:
        overhead = {"cuda_context": 0, "nccl": 0, "allocator_margin": 0}
    if record:
        record.term("overhead.cuda_context", overhead["cuda_context"], "constant", {}, "CUDA context + cuBLAS workspace")
        record.term("overhead.nccl", overhead["nccl"], "per communicator (more across nodes)",
                    {"world": world, "nodes": cluster.nodes}, "NCCL channel buffers")
        record.term("overhead.allocator_margin", overhead["allocator_margin"], f"{ovh.ALLOCATOR_MARGIN:g} * tensor peak",
                    {"tensor_peak": peak}, "caching-allocator fragmentation")
    return overhead
