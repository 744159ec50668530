"""The forward and backward peaks of a plan from its traced step (estimate/backward_timeline.py).

The trace sees one device with every gradient in .grad. Each engine keeps the same tensors and adds its
own, and the tracker files some of them elsewhere; this module says, per engine, where each traced term
goes at each instant and which engine buffers are alive beside it (estimate/buffers.py):
- one device, DDP: as traced; DDP's flat buckets beside (allocated at wrap time).
- FSDP1 / FSDP2: the running unit's gradients are unsharded temporaries; a unit's gradients become
  shards (the gradients at rest, in the optimizer's dtype) once reduce-scattered at its end; the
  root's (head, embedding, positions, input projections) stay unsharded until the root reduces at
  the end of backward (FSDP2 with the embedding and head as units of their own reduces the head's
  right after its backward). A unit reshards before it reduces, so beside its reduce-scatter only the
  next unit is gathered; FSDP1 holds the unsharded gradient through it, FSDP2 only its flat copy; on
  gloo (device "cpu") the collective works on one more full-size copy of its input.
- DeepSpeed ZeRO-1/2/3: each gradient is copied into the reduction bucket in its post-accumulate-grad
  hook and dropped, so a gradient stays in .grad only until its hook finishes (the first hook
  allocates the buckets beside it). A hook whose gradient does not fit beside the bucket's reduces the
  bucket first, through a flat copy of it (replayed over the full model's hooks,
  zero_partitions.bucket_reductions; ZeRO-3's reduce-scatter on gloo copies it once more, and its last
  reductions come at the embedding's hook and after it). ZeRO-1/2's gradient buffer exists once the
  first reduction is done (ZeRO-3's partition from the start). ZeRO-3's assumed module gradient is
  none at a tied head (its gradient waits, partial, in autograd's input buffer), the trace's own in
  the embedding's part, at most the block's largest parameter's inside a block.
The largest instant wins; its split is the estimate's.
"""
from __future__ import annotations

from shardfit.spec.fsdp_units import separate_embedding_units
from shardfit.estimate import zero_partitions
from shardfit.spec.plan import is_deepspeed_kind

ONE_DEVICE = ("single", "ddp")
FSDP = ("fsdp", "fsdp2")


def traced_kinds(kind: str) -> bool:
    """Whether the traced step sets this engine's forward and backward split."""
    return kind in ONE_DEVICE or kind in FSDP or kind in ("zero1", "zero2", "zero3")


def forward_peak(step, buf) -> tuple[int, int]:
    """(activations, temporaries) at the largest traced forward instant: autocast's casts and the
    loss's logits and label copies are in the trace (it ran the model's own loss); the engine's
    gathered units or buckets beside them."""
    moment = {"pre": buf.fwd_block if buf.fwd_pre is None else buf.fwd_pre, "block": buf.fwd_block,
              "post": buf.fwd_loss}
    best = (0, 0)
    for instant in step.forward:
        candidate = (instant.activations, instant.temporaries + instant.weight_copies + moment[instant.part])
        if sum(candidate) > sum(best):
            best = candidate
    return best


def backward_peak(plan, step, buf, states, grads_persistent: int) -> tuple[int, int, int]:
    """(activations, grads, temporaries) at the largest traced backward instant under the plan's engine."""
    kind = plan.strategy.kind
    if kind in FSDP:
        split = _fsdp(plan, step, buf, states, grads_persistent)
    elif is_deepspeed_kind(kind):
        split = _deepspeed(plan, step, buf, states, grads_persistent)
    else:
        split = _one_device(step, buf, grads_persistent)
    # On a tie the earlier instant is the one a tracker reports (the first to reach the peak): backward
    # runs the head's part first, then the blocks, then the embedding's.
    order = {"post": 0, "block": 1, "pre": 2}
    best, best_rank = (0, 0, 0), (0, 0)
    for index, (instant, candidate) in enumerate(split):
        rank = (order[instant.part], index)
        if sum(candidate) > sum(best) or (sum(candidate) == sum(best) and rank < best_rank):
            best, best_rank = candidate, rank
    return best


def _moment(instant, buf) -> int:
    """The engine's buffers at this instant: backward's start (the head), inside a block with another
    still below it (the next unit prefetched), inside the first block, the embedding's backward
    (ZeRO-3: the embedding gathered, nothing left to prefetch)."""
    if instant.part == "post":
        return buf.start
    if instant.part == "block":
        return buf.inside if instant.below else buf.last
    return buf.last if buf.embedding_part is None else buf.embedding_part


def _below(instant, parts) -> int:
    """The unit prefetched below a block: the next layer's own where layers differ, else one unit."""
    layer = instant.layer
    if parts.layer_units and 0 < layer < len(parts.layer_units):
        return parts.layer_units[layer - 1]
    return parts.unit


def _own_and_below(instant, parts) -> int:
    """Inside a block: its own unit and, with a block below, the next one prefetched."""
    layer = instant.layer
    own = parts.layer_units[layer] if parts.layer_units and 0 <= layer < len(parts.layer_units) else parts.unit
    return own + (_below(instant, parts) if instant.below else 0)


def _fsdp_moment(instant, parts) -> int:
    """What FSDP holds beside the traced tensors: the root's weights; inside a block, its unit and the
    next one prefetched (one alone in the first block, where FSDP2 prefetches the embedding unit
    instead), every unit when none reshards; the reduce-scatter input FSDP2 still holds of the unit
    above (of the head's unit, above the top block)."""
    if instant.part == "post":
        return parts.root + (parts.kept or parts.unit)
    if instant.part == "pre":
        return parts.root + parts.embedding + parts.held_unit
    gathered = parts.kept or _own_and_below(instant, parts)
    prefetched = parts.embedding if parts.separate and not instant.below else 0
    return parts.root + gathered + prefetched + (parts.held_unit if instant.above else parts.held_head)


def _one_device(step, buf, grads_persistent: int):
    # Under accumulation the gradients exist from the first micro-batch on; a later micro-batch adds its
    # fresh ones into them, each freed once added.
    for i in step.backward:
        grads = grads_persistent or i.grads_current + i.grads_done
        yield i, (i.activations, grads, i.temporaries + i.weight_copies + _moment(i, buf))


def _fsdp(plan, step, buf, states, grads_persistent: int):
    separate = separate_embedding_units(plan.strategy, plan.model)
    total = max(step.all_grads, 1)

    def sharded(traced_bytes: int) -> int:
        # A reduced gradient's share of the gradients at rest (sharded, in the optimizer's dtype).
        return grads_persistent or int(states.grads_full * traced_bytes / total)

    block_grads = step.all_grads - step.head_grads - step.embedding_grads
    for i in step.backward:
        head_done = step.head_grads if i.part != "post" else 0
        # Inside the embedding's part every block is done; what it has made beyond them is the root's
        # (positions, input projections, the tied embedding).
        blocks_done = min(i.grads_done - head_done, block_grads)
        embedding_done = i.grads_done - head_done - blocks_done
        # The root's unsharded gradients wait for its reduction at the end; the head, as a unit of its
        # own, is reduced at once.
        if separate:
            grads, root_unsharded = sharded(blocks_done + head_done), embedding_done
        else:
            grads, root_unsharded = sharded(blocks_done), head_done + embedding_done
        unsharded = i.grads_current + root_unsharded
        moment = buf.start if i.part == "post" else _fsdp_moment(i, buf.fsdp)
        temps = i.temporaries + i.weight_copies + unsharded + moment
        yield i, (i.activations, grads, temps)
        if not i.end or i.part == "post":
            continue
        # A unit reshards before it reduces. FSDP1 keeps the unsharded gradient through the collective;
        # FSDP2 frees it (and the previous unit's flat input) once copied into its flat input. The
        # reduce-scatter's inputs are temporaries, its output shard a gradient.
        parts = buf.fsdp
        fsdp1 = plan.strategy.kind == "fsdp"
        if i.part == "block":  # beside it the root (its gradients waiting) and the next unit, prefetched
            gathered = parts.kept or (_below(i, parts) if i.below else parts.embedding if parts.separate else 0)
            waiting = unsharded if fsdp1 else root_unsharded
            yield i, (i.activations, grads + parts.unit_shard,
                      i.temporaries + i.weight_copies + waiting + parts.root + gathered + parts.unit_reduce)
        else:  # the root's reduction (the embedding unit's, the root and it still gathered)
            yield i, (i.activations, grads + parts.end_shard,
                      i.temporaries + (unsharded if fsdp1 else 0) + parts.end_held + parts.end_reduce)


def _deepspeed(plan, step, buf, states, grads_persistent: int):
    s = plan.strategy
    # Elements per traced gradient byte: ZeRO runs a 16-bit model under bf16 / fp16.
    per_byte = 1 / (4 if plan.training.precision == "fp32" else 2)
    last_pre_hook = max((k for part, _, k, _ in step.hook_sequence if part == "pre"), default=-1)
    reductions, first = {}, None
    zero3 = buf.grads_early is None and bool(buf.last_flushes)  # ZeRO-3 with its layout known
    if ((buf.grads_early is not None and (s.kind == "zero2" or s.overlap_comm)) or zero3) and not s.offload_optimizer:
        reductions, first = zero_partitions.bucket_reductions(step.hook_sequence, s.reduce_bucket_size)
    hooked_elements = {(part, layer, k): n for part, layer, k, n in step.hook_sequence}
    for i in step.backward:
        # Each gradient hook copies its .grad into the bucket: until its hook finishes a gradient is in
        # .grad (the first hook allocates the buckets beside it); the hooked ones were reduced.
        made = i.grads_hooked * per_byte
        reduced = reductions.get((i.part, i.layer, i.hook), 0) if i.hook >= 0 else 0
        if buf.grads_early is not None:  # ZeRO-1/2: the gradient buffer from the first reduction on
            done = made >= (first if first is not None else s.reduce_bucket_size)
            # (at the first reduction's own moment the buffer is not there yet: it follows the copy)
            grads = grads_persistent or (buf.grads_early if done and not (reduced and made <= first) else 0)
            grads += i.grads_pending
        else:
            # NOTE: ZeRO-3 measured without the pending gradients: the assumed module gradient
            # (buffers.zero3_buffers) stands for them (calibration §14).
            grads = grads_persistent
        # The head's backward holds no other unit's buffers. A tied head makes no module gradient of its
        # own there: its weight's gradient waits, partial, in autograd's input buffer until the
        # embedding adds its share (the trace has it among the temporaries already).
        unmade = buf.module_grad if plan.model.tie_embeddings and i.part == "post" else 0
        if i.part == "pre" and buf.embedding_part is not None:
            # ZeRO-3 in the embedding's backward: the module gradient is the one the trace has made so
            # far (a tied embedding's sum exists only once both shares are in).
            unmade = buf.module_grad - min(buf.module_grad, i.grads_current)
        temps = i.temporaries + i.weight_copies - unmade + (buf.start if made == 0 else buf.inside
                                                            if i.part == "post" else _moment(i, buf))
        if not zero3:  # ZeRO-1/2: a hook that reduces the full bucket first holds its flat copy
            yield i, (i.activations, grads, temps + int(reduced / per_byte))
            continue
        yield i, (i.activations, grads, temps)
        # ZeRO-3's reductions: a hook whose gradient does not fit beside the bucket's reduces it first
        # (the same rule), through a flat copy of its gradients (and gloo's copy of that) beside the
        # gradient waiting in .grad; the last ones at the embedding's hook and after it (a 16-bit model
        # under bf16 / fp16).
        if i.part == "pre" and i.hook >= 0 and i.hook == last_pre_hook:
            for flushed, waiting in buf.last_flushes:
                yield i, (i.activations, grads + int(waiting / per_byte),
                          temps + buf.reduce_copies * int(flushed / per_byte))
        elif reduced:
            yield i, (i.activations, grads + int(hooked_elements[(i.part, i.layer, i.hook)] / per_byte),
                      temps + buf.reduce_copies * int(reduced / per_byte))
