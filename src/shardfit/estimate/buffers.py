"""What each engine holds besides its model states, at each moment of a step where memory can peak.

The moments: at rest (between steps), inside a block's forward, at the loss, at the start of
backward, inside the first block backward reaches, when a block's gradient is reduced, inside the
last block, at the end of backward, during the optimizer step and during a checkpoint save. The
byte counts come from temporaries.py; this module only says which buffers coexist when, per engine
(measured on CPU against real 2-rank runs, tests/measure/test_engine_matrix.py).
"""
from __future__ import annotations

from typing import NamedTuple

from shardfit.estimate import flat_shards
from shardfit.estimate import states as sts
from shardfit.estimate.lora_sharding import largest_adapter
from shardfit.estimate import temporaries as tmp
from shardfit.estimate import zero_partitions
from shardfit.spec.fsdp_units import separate_embedding_units


class FsdpParts(NamedTuple):
    """FSDP1 / FSDP2 buffers (bytes per rank) that the traced step's instants combine: the root's
    gathered weights, one gathered unit and the two a unit's backward holds (itself + the prefetched
    next), every unit when none reshards after forward, the embedding unit (torchtitan's wrapping), the
    reduce-scatter input FSDP2 still holds of the last unit / of the head; a unit's reduce-scatter
    (its inputs, temporaries; its output shard, a gradient); at the end of backward, the weights still
    gathered and the root's (or the embedding unit's) reduce-scatter the same way."""
    root: int
    unit: int
    units: int
    kept: int
    embedding: int
    separate: bool
    held_unit: int
    held_head: int
    unit_reduce: int
    unit_shard: int
    end_held: int
    end_reduce: int
    end_shard: int
    layer_units: tuple = ()  # one gathered unit per layer where the spec knows them (blocks of unequal size)


class Buffers:
    """Temporaries (bytes per rank) at each moment, plus the grads some engines hold apart."""
    __slots__ = ("rest", "fwd_pre", "fwd_block", "fwd_loss", "start", "inside", "reduce", "last", "end", "opt", "ckpt",
                 "head_grad", "end_grads", "grads_rest", "grads_early", "head_grad_late", "fsdp", "last_flushes",
                 "module_grad", "embedding_part", "reduce_copies")

    def __init__(self, rest: int = 0, during: int | None = None):
        during = rest if during is None else during
        self.rest = self.ckpt = rest
        self.fwd_block = self.fwd_loss = self.start = self.inside = self.reduce = self.last = self.end = during
        self.fwd_pre = None  # before the first block (the embedding's part), where it differs from fwd_block
        self.opt = rest
        self.head_grad = self.end_grads = self.grads_rest = 0
        self.grads_early = None  # grads once backward reaches the blocks, when allocated all at once
        # the head's grads beside grads_last / grads_full late in backward (None: head_grad, unsharded till the end)
        self.head_grad_late = None
        self.fsdp: FsdpParts | None = None  # FSDP's buffers one by one, for the traced step's instants
        self.last_flushes: tuple = ()  # ZeRO-3: (elements reduced, elements waiting) of its last reductions
        self.module_grad = 0  # ZeRO-3: the gathered module's gradient assumed in `inside` (its largest)
        self.embedding_part = None  # ZeRO-3: in the embedding's backward (the last modules), else `last`
        self.reduce_copies = 1  # ZeRO-3: full copies of the bucket a reduction holds (gloo: 2)


def last_param_elements(model, part: str) -> int:
    """Elements of the last parameter, in registration order, of a block unit ("block": the largest
    such among the block kinds) or of the root ("root"); 0 where the spec has no parameter order."""
    lasts = [group[-1] for label, group, _ in model.param_order if label == part and group]
    if not lasts:
        return 0
    return max(lasts) if part == "block" else lasts[-1]


def fsdp_buffers(kind, s, model, precision, shard, unit, root, largest, gather_bytes, st, impl, optimizer,
                 checkpoint, rec, lora_unit=None, lora=None, backend_copy: bool = False) -> Buffers:
    """FSDP1 / FSDP2 with the blocks wrapped and the root holding embeddings, final norm and head.
    Under LoRA (`lora_unit`: adapter elements per block) the frozen root reduces nothing, and FSDP2
    reduces only the adapters (estimate/lora_sharding.py). backend_copy: the collectives run on gloo
    (CPU), whose reduce-scatter works on a full-size copy of its input."""
    reshard = (s.sharding != "shard_grad_op") if kind == "fsdp" else s.reshard_after_forward
    units = embedding_unit_bytes(s, model, root, gather_bytes)
    # With the embedding and head in units of their own the root keeps the final norm only.
    root_b = tmp.root_unit_bytes(root - (2 * model.vocab_size * model.hidden_size if units else 0), gather_bytes)
    if kind == "fsdp" and s.sharding == "no_shard" and precision == "fp32":
        units_b = 0  # no gather, no low-precision copy: the full fp32 params are used in place
    elif reshard:
        units_b = tmp.gathered_unit_bytes(unit, gather_bytes, 2)
    else:
        units_b = tmp.all_units_gathered_bytes(model.n_params - root, gather_bytes)
    one_unit = tmp.gathered_unit_bytes(unit, gather_bytes, 1) if units_b else 0
    kept = 0 if reshard else units_b  # every unit stays gathered from forward to backward
    # FSDP2 under LoRA: only the adapters have gradients, in the unsharded param dtype.
    reduced, grad_dtype = (lora_unit, 4 if precision == "fp32" else 2) if lora_unit is not None and kind == "fsdp2" \
        else (unit, gather_bytes)
    grad_b = tmp.unsharded_grad_bytes(reduced, grad_dtype)
    # The head's unsharded grad is a .grad of the root's params from the start of backward; the
    # embedding's appears only at the end. A frozen root (LoRA) has none.
    embed = 0 if model.tie_embeddings or not root else min(root, model.vocab_size * model.hidden_size)
    root_grads = root if lora_unit is None else 0
    end_extra = tmp.unsharded_grad_bytes(min(embed, root_grads), gather_bytes)
    head_grad = tmp.unsharded_grad_bytes(root_grads, gather_bytes) - end_extra
    # shardfit's engines reduce in fp32 under MixedPrecision (reduce_dtype=float32).
    reduce_b = 4 if precision in ("bf16", "fp16", "fp32") else 2
    input_copy = kind == "fsdp2" or reduce_b != grad_dtype
    rs_b = tmp.reduce_scatter_bytes(reduced, shard, reduce_b, input_copy)
    b = Buffers()
    # FSDP1's forward_prefetch is off (torch's default; shardfit's engine leaves it): in forward it
    # gathers one unit at a time. FSDP2 issues the next unit's all-gather ahead in forward.
    b.fwd_block = root_b + (one_unit if kind == "fsdp" and reshard else units_b)
    # FSDP2 holds a unit's all-gather output in forward until the next unit's copy-out
    # (FSDPParamGroup.wait_for_unshard): as the first block gathers, the root's is still there.
    b.fwd_pre = b.fwd_block + (root_b if kind == "fsdp2" else 0)
    b.fwd_loss = root_b + (kept or (one_unit if kind == "fsdp2" else 0))  # FSDP2 still holds one unit
    b.start = root_b + (kept or one_unit)  # the last block's unit is prefetched
    b.inside = root_b + units_b  # current + prefetched unit (+ the activation grads, added later)
    b.reduce = root_b + units_b + grad_b + rs_b  # the block's full grad and the reduce-scatter buffers
    b.last = root_b + one_unit  # nothing left to prefetch
    b.end = tmp.reduce_scatter_bytes(root_grads, shard, reduce_b, True)  # the root reshards, then reduces
    b.head_grad, b.end_grads = head_grad, end_extra
    if units is not None:
        _separate_units(b, units, root_b, one_unit, units_b, kept, st, model, lora_unit, shard, reduce_b, gather_bytes)
    # FSDP2 keeps a reduce-scatter's flat input (reduce dtype) until the next one is issued
    # (FSDPParamGroup.reduce_scatter_state), so it lives through the next unit's backward; FSDP1 frees
    # its input once the shard is out.
    held = kind == "fsdp2" and lora_unit is None
    # At the end the root reduces its gradients (resharded first), or, with the embedding as a unit of its
    # own, the embedding unit reduces while the root and the embedding stay gathered.
    end_elements = (0 if lora_unit is not None else model.vocab_size * model.hidden_size) if units is not None \
        else root_grads
    end_held = root_b + units[0] if units is not None else 0
    # FSDP2's foreach_reduce leaves its shard-dim loop variable bound to the unit's last unsharded
    # gradient (registration order, the param dtype) until it returns: that one lives through the
    # reduce-scatter beside its flat copy (Granite-MoE's experts' output weight, 65,536 B in bf16).
    last_grad = last_end_grad = 0
    if kind == "fsdp2" and lora_unit is None and shard > 1:
        last_grad = tmp.unsharded_grad_bytes(last_param_elements(model, "block"), gather_bytes)
        last_end_grad = tmp.unsharded_grad_bytes(
            model.vocab_size * model.hidden_size if units is not None else last_param_elements(model, "root"),
            gather_bytes)
    # Blocks of unequal size (DeepSeek's dense first layers under MoE ones): each layer's own unit.
    layer_units = tuple(int(sum(group) * gather_bytes) for label, group, count in model.param_order
                        if label == "block" for _ in range(count))
    if not units_b or kept or lora_unit is not None or len(layer_units) != model.num_layers:
        layer_units = ()
    b.fsdp = FsdpParts(root=root_b, unit=one_unit, units=units_b, kept=kept,
                       embedding=units[0] if units is not None else 0, separate=units is not None,
                       held_unit=int(unit * reduce_b) if held else 0,
                       held_head=int(model.vocab_size * model.hidden_size * reduce_b) if held and units else 0,
                       unit_reduce=tmp.reduce_scatter_input_bytes(reduced, reduce_b, input_copy, backend_copy)
                       + last_grad,
                       unit_shard=tmp.reduce_scatter_output_bytes(reduced, shard, reduce_b),
                       end_held=end_held,
                       end_reduce=tmp.reduce_scatter_input_bytes(end_elements, reduce_b, input_copy, backend_copy)
                       + last_end_grad,
                       end_shard=tmp.reduce_scatter_output_bytes(end_elements, shard, reduce_b),
                       layer_units=layer_units)
    if kind == "fsdp" and not s.offload_params:
        b.grads_rest = st.grads_full  # FSDP1 frees the flat sharded grad only at the next forward
    # The optimizer's largest tensor: FSDP2 shards every param; FSDP1 (use_orig_params) hands it views
    # of the flat shard, where a whole param can sit on one rank.
    largest = sts.largest_tensor(model, largest)
    if lora is not None:  # the optimizer holds the adapters only
        largest = largest_adapter(model, lora.rank, tuple(lora.target_modules))
    biggest, previous = (largest // shard + 1 if kind == "fsdp2" else min(largest, max(unit, root) // shard + 1)), 0
    if kind == "fsdp" and lora is None and model.param_order:
        # The views of the flat shards, in the optimizer's order (derived specs know the layout).
        biggest, previous = flat_shards.fsdp1_step_scratch(model.param_order, shard, int(gather_bytes))
    b.opt = tmp.optimizer_step_temp_bytes(optimizer, impl, st.trained_per_rank, st.state_bytes, biggest, previous)
    b.ckpt = tmp.checkpoint_save_bytes(checkpoint, max(unit, root), st.state_bytes)
    if rec is not None:
        rec("temporaries.fsdp_root_unit", root_b, "non_block_params*gather_bytes",
            {"non_block_params": root, "gather_bytes": gather_bytes},
            "FSDP keeps the root (embeddings, head) gathered from forward to backward")
        rec("temporaries.fsdp_gathered_units", units_b, "2*unit*gather_bytes" if reshard else "(P - root)*gather_bytes",
            {"unit": unit, "gather_bytes": gather_bytes, "reshard_after_forward": reshard},
            "FSDP all-gather of the current unit plus the prefetched one")
        rec("temporaries.fsdp_unsharded_grads", grad_b + head_grad + end_extra,
            "(unit + root)*gather_bytes (the embedding's part only at the end of backward)",
            {"unit": unit, "root": root, "embedding": embed}, "FSDP backward: full grads before reduce-scatter")
        rec("temporaries.fsdp_reduce_scatter", rs_b, "unit*reduce_bytes (copy-in) + unit/S*reduce_bytes",
            {"unit": unit, "S": shard, "reduce_bytes": reduce_b}, "FSDP reduce-scatter input and output")
    return b


def embedding_unit_bytes(s, model, root: int, gather_bytes) -> tuple[int, int] | None:
    """(embedding, head) gathered bytes when FSDP2 wraps them as units of their own (spec/fsdp_units.py),
    else None."""
    if not separate_embedding_units(s, model) or root < 2 * model.vocab_size * model.hidden_size:
        return None
    one = tmp.root_unit_bytes(model.vocab_size * model.hidden_size, gather_bytes)
    return one, one


def _separate_units(b: Buffers, units, root_b: int, one_unit: int, units_b: int, kept: int, st, model, lora_unit,
                    shard, reduce_b: int, gather_bytes) -> None:
    """The moments of an FSDP2 step whose embedding and head are units of their own (torchtitan).
    Forward: the embedding is gathered for its own forward only; at the loss the head is gathered, with
    its all-gather buffer held until the next all-gather (FSDP2 frees the previous unit's buffer then;
    measured with reshard_after_forward on and off).
    Backward: the head stays gathered until its backward, whose pre-backward prefetches the last block and
    whose gradient is reduce-scattered at once
    (its sharded grad joins the grads; no unsharded root grads live through backward); the embedding is
    prefetched during the last block's backward and reduced at the end."""
    embed_b, head_b = units
    embed_kept = embed_b if kept else 0  # reshard_after_forward off: the embedding stays gathered too
    b.fwd_block += embed_kept
    b.fwd_pre = b.fwd_block + embed_b  # the embedding unit's all-gather output, held as the first block gathers
    b.fwd_loss = root_b + embed_kept + head_b + kept + head_b
    # The last block is prefetched by the head's pre-backward, which runs after the loss's backward: while
    # the loss's gradient buffers are live (backward's start) it is not gathered yet.
    b.start = root_b + embed_kept + head_b + kept
    b.inside += embed_kept
    b.reduce += embed_kept
    # Inside the last block's backward: that block and its all-gather buffer (freed only at the next unit's
    # copy-out, the embedding's), and the embedding's all-gather, prefetched.
    b.last = root_b + embed_b + units_b
    frozen = lora_unit is not None  # LoRA: the embedding and head have no grads
    elements = model.vocab_size * model.hidden_size
    # The head's sharded grad, from its reduce-scatter on: beside the grads at rest inside the blocks, and
    # already part of grads_last / grads_full after them.
    b.head_grad = 0 if frozen else int(st.grads_full * elements / max(model.n_params, 1))
    b.head_grad_late = 0
    b.end_grads = 0 if frozen else tmp.unsharded_grad_bytes(elements, gather_bytes)
    b.end = root_b + embed_b + (0 if frozen else tmp.reduce_scatter_bytes(elements, shard, reduce_b, True))


def ddp_buffers(s, model, st, impl, optimizer, largest, rec) -> Buffers:
    # Source: torch DDP Reducer: flat buckets covering every gradient, allocated at wrap time.
    view = s.ddp_gradient_as_bucket_view
    bucket = tmp.ddp_bucket_bytes(st.grads_full, bucket_view=view)
    b = Buffers(bucket)
    b.opt = bucket + tmp.optimizer_step_temp_bytes(optimizer, impl, st.trained_per_rank, st.state_bytes,
                                                   *sts.step_scratch_params(model, largest))
    if rec is not None:
        rec("temporaries.ddp_buckets", bucket, "grad bytes (0 with gradient_as_bucket_view)",
            {"gradient_as_bucket_view": view, "bucket_cap_mb": s.ddp_bucket_cap_mb},
            "torch DDP Reducer: flat buckets covering every gradient, allocated at wrap time")
    return b


def single_buffers(model, st, impl, optimizer, largest) -> Buffers:
    """One device, no wrapper: DDP minus its reducer, so nothing but the optimizer step's scratch."""
    b = Buffers()
    b.opt = tmp.optimizer_step_temp_bytes(optimizer, impl, st.trained_per_rank, st.state_bytes,
                                          *sts.step_scratch_params(model, largest))
    return b


def zero3_buffers(s, model, trained, world, lp, largest, impl, optimizer, rec, recomputes: bool = False,
                  backend_copy: bool = False) -> Buffers:
    """backend_copy: the collectives run on gloo, whose reduce-scatter copies its input once more."""
    bucket = tmp.zero3_ipg_bucket_bytes(s.reduce_bucket_size, lp)
    # Persistent params are never gathered: only the others are fetched module by module.
    if model.has_shape:
        largest_np, gatherable = sts.zero3_gathered_bounds(model, s.param_persistence_threshold)
    else:
        largest_np, gatherable = largest, model.n_params
    live = min(tmp.zero3_live_param_bytes(largest_np, s.prefetch_bucket_size, s.max_live_parameters, lp),
               gatherable * lp)
    # What forward leaves gathered for backward (the prefetcher's marks, the reuse distance), on top of the
    # current module and its prefetch: held from the loss into backward, released as backward passes them.
    kept = tmp.zero3_kept_params(gatherable, s.prefetch_bucket_size, s.max_live_parameters, s.max_reuse_distance,
                                 recomputes) * lp
    held = max(live, kept)
    mod_grad = tmp.zero3_module_grad_bytes(largest_np, lp)
    b = Buffers(bucket, bucket + held + mod_grad)
    b.fwd_block = b.fwd_loss = bucket + held
    b.last = bucket + live + mod_grad  # the first block's backward: what was kept above it is released
    b.module_grad = mod_grad
    if model.param_order and len(model.param_order) > 1:
        # Inside a block the module gradient is at most the block's largest (derived specs know the
        # layout: the root first, then the blocks), not the embedding's or the head's.
        threshold = s.param_persistence_threshold
        block_np = max((n for _, sizes, _ in model.param_order[1:] for n in sizes if n >= threshold), default=0)
        block_grad = tmp.zero3_module_grad_bytes(min(block_np, largest_np), lp)
        b.inside += block_grad - mod_grad
        b.last += block_grad - mod_grad
    # The embedding's backward is the last: nothing is left to prefetch beside the module it gathers.
    b.embedding_part = bucket + min(largest_np, gatherable) * lp + mod_grad
    if zero_partitions.covers(model.param_order, trained):
        b.last_flushes = zero_partitions.zero3_last_flushes(model.param_order, s.reduce_bucket_size)
    # A reduction (stage3 __avg_scatter_grads -> reduce_scatter_coalesced) flattens the bucket's
    # gradients into one buffer, then reduce-scatters it.
    b.reduce_copies = 2 if backend_copy else 1
    b.opt = bucket
    if not s.offload_optimizer:
        sub = min(int(trained / world), sts.ZERO3_SUB_GROUP_SIZE)
        b.opt += tmp.optimizer_step_temp_bytes(optimizer, impl, sub, 4, sub)
    if rec is not None:
        rec("temporaries.zero3_ipg_bucket", bucket, "reduce_bucket_size*lp",
            {"reduce_bucket_size": s.reduce_bucket_size, "lp": lp}, "deepspeed stage3.py __init__")
        rec("temporaries.zero3_live_params", live, "min(largest + prefetch_bucket, max_live)*lp",
            {"largest": largest_np, "prefetch_bucket_size": s.prefetch_bucket_size,
             "max_live_parameters": s.max_live_parameters, "lp": lp}, "deepspeed PartitionedParameterCoordinator")
        rec("temporaries.zero3_module_grad", mod_grad, "largest*lp", {"largest": largest_np},
            "full 16-bit grad of the gathered module")
        rec("temporaries.zero3_kept_params", kept,
            "min(gatherable, max(max_live (prefetch on), max_reuse_distance/k))*lp",
            {"gatherable": gatherable, "max_live_parameters": s.max_live_parameters,
             "prefetch_bucket_size": s.prefetch_bucket_size, "max_reuse_distance": s.max_reuse_distance, "lp": lp},
            "deepspeed PartitionedParameterCoordinator: prefetched parameters are marked for their backward use "
            "and not released; others are kept if reused within max_reuse_distance")
    return b


def zero12_buffers(s, st, trained, world, lp, largest, impl, optimizer, host, rec) -> Buffers:
    bucket = tmp.zero12_ipg_bucket_bytes(s.reduce_bucket_size, lp, s.overlap_comm)
    gbuf = 0
    if s.offload_optimizer:
        gbuf = tmp.zero_offload_grad_buffer_bytes(largest, lp)
        host["offload_grad_buffer_pinned"] = int(largest * 4)
    b = Buffers(gbuf, gbuf + bucket)
    b.fwd_block = b.fwd_loss = gbuf
    # The buckets appear at the first gradient hook (after the loss's backward); the flat grad
    # partition at the first bucket reduction, allocated whole.
    b.start = gbuf
    b.grads_early = st.grads_full
    b.opt = gbuf
    if not s.offload_optimizer:
        part = int(trained / world)  # one flat fp32 partition is the optimizer's only "parameter"
        b.opt += tmp.optimizer_step_temp_bytes(optimizer, impl, part, 4, part)
    if rec is not None:
        if gbuf:
            rec("temporaries.zero_offload_grad_buffer", gbuf, "largest_param*lp", {"largest_param": largest},
                "stage_1_and_2.py temp_grad_buffer_for_gpu_offload")
        rec("temporaries.zero_ipg_buckets", bucket, "reduce_bucket_size*lp*(2 if overlap_comm)",
            {"reduce_bucket_size": s.reduce_bucket_size, "lp": lp, "overlap_comm": s.overlap_comm},
            "deepspeed stage_1_and_2.py setup_buckets()")
    return b
