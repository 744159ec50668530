"""Temporary buffers: gathered FSDP units, reduce buffers, DeepSpeed buckets, loss and optimizer-step
scratch, checkpoint consolidation. Each function counts one buffer, per rank, in bytes."""
from __future__ import annotations

from shardfit.estimate.states import model_linears


def gathered_unit_bytes(unit_params: int, dtype_bytes: int, units: int = 2) -> int:
    # Source: FSDP all-gathers one unit before computing it; the prefetch keeps the next one live too.
    return int(unit_params * dtype_bytes * units)


def root_unit_bytes(non_block_params: int, dtype_bytes: int) -> int:
    # Source: FSDP1/FSDP2 do not reshard the root after forward (embeddings + head stay gathered).
    return int(non_block_params * dtype_bytes)


def unsharded_grad_bytes(unit_params: int, dtype_bytes: int) -> int:
    # Source: FSDP backward: the unit's full gradient in the compute dtype before reduce-scatter.
    return int(unit_params * dtype_bytes)


def reduce_scatter_bytes(unit_params: int, shard: int, reduce_bytes: int, input_copy: bool,
                         backend_copy: bool = False) -> int:
    # Source: FSDP1 casts the unsharded grad to reduce_dtype (a copy when it differs); FSDP2's
    # foreach_reduce always copies into a flat reduce_dtype input; the output is unit/S in reduce_dtype.
    return reduce_scatter_input_bytes(unit_params, reduce_bytes, input_copy, backend_copy) \
        + reduce_scatter_output_bytes(unit_params, shard, reduce_bytes)


def reduce_scatter_input_bytes(unit_params: int, reduce_bytes: int, input_copy: bool, backend_copy: bool) -> int:
    # Source: as above; gloo (CPU) has no native reduce-scatter: ProcessGroupGloo reduces a full-size
    # copy of the input and keeps its rank's chunk (seen by the tracker inside reduce_scatter_single).
    return int(unit_params * reduce_bytes * ((1 if input_copy else 0) + (1 if backend_copy else 0)))


def reduce_scatter_output_bytes(unit_params: int, shard: int, reduce_bytes: int) -> int:
    # The rank's reduced shard: the new sharded gradient (the tracker files it as grads).
    return int(unit_params / shard * reduce_bytes)


def all_units_gathered_bytes(total_params: int, dtype_bytes: int) -> int:
    # Source: SHARD_GRAD_OP / fsdp2 reshard_after_forward=False keep every unit gathered fwd->bwd.
    return int(total_params * dtype_bytes)


def ddp_bucket_bytes(grad_bytes: int, bucket_view: bool) -> int:
    # Source: torch DDP Reducer: flat buckets cover every grad; gradient_as_bucket_view makes grads views.
    return 0 if bucket_view else int(grad_bytes)


def zero12_ipg_bucket_bytes(reduce_bucket_size: int, lp: int, overlap_comm: bool) -> int:
    # Source: deepspeed stage_1_and_2.py setup_buckets(): reduce_bucket_size elements, doubled with overlap_comm.
    return int(reduce_bucket_size * lp * (2 if overlap_comm else 1))


def zero3_ipg_bucket_bytes(reduce_bucket_size: int, lp: int) -> int:
    # Source: deepspeed stage3.py __init__: one reduce_bucket_size bucket allocated at init.
    return int(reduce_bucket_size * lp)


def zero3_live_param_bytes(largest_layer: int, prefetch_bucket: int, max_live: int, lp: int) -> int:
    # Source: deepspeed PartitionedParameterCoordinator: current module + prefetch, capped by max_live.
    return int(min(largest_layer + prefetch_bucket, max(max_live, largest_layer)) * lp)


def zero3_kept_params(gatherable: int, prefetch_bucket: int, max_live: int, max_reuse_distance: int,
                      recomputes: bool) -> int:
    """Parameters (elements) ZeRO-3 keeps gathered from forward into backward, released module by
    module as backward passes them. Source: deepspeed PartitionedParameterCoordinator (0.19):
    - the prefetcher walks the parameter trace ahead of each fetch, up to prefetch_bucket_size
      elements it gathers while fewer than max_live_parameters are gathered, and marks every parameter
      it passes with its last use in the step (its backward); __params_to_release never releases a
      parameter marked for a later step. So with prefetching on, everything gathered stays, up to
      max_live_parameters;
    - besides, a released parameter is kept when it reappears in the step's trace within
      max_reuse_distance elements: a module with A parameters above it reappears after k*A (k = 2, or
      3 with recompute), so the top max_reuse_distance / k elements.
    Measured (tests/measure/test_zero3_kept.py: 2 CPU ranks, DeepSpeed 0.19.8, a 0.82M-parameter Llama,
    prefetch 14,745): forward temporaries 3,676,185 B at the defaults, the same with max_reuse_distance 0
    (the prefetcher's marks) or with max_live_parameters 5e4 (the reuse distance): the whole model
    gathered; 743,449 B with both off."""
    kept = min(gatherable, max_live) if prefetch_bucket > 0 else 0
    if max_reuse_distance > 0:
        kept = max(kept, min(gatherable, max_reuse_distance // (3 if recomputes else 2)))
    return kept


def zero3_module_grad_bytes(largest_layer: int, lp: int) -> int:
    # Source: DeepSpeed's estimator's 4*largest_layer: the gathered module's full 16-bit grad.
    return int(largest_layer * lp)


def zero_offload_grad_buffer_bytes(largest_param: int, lp: int) -> int:
    # Source: stage_1_and_2.py temp_grad_buffer_for_gpu_offload (largest param numel, 16-bit).
    return int(largest_param * lp)


def loss_forward_bytes(tokens: int, per_token: float) -> int:
    # Source: transformers ForCausalLMLoss: logits.float() copy for cross-entropy (16-bit logits only).
    return int(tokens * per_token)


def loss_label_bytes(micro_batch: int, seq: int) -> int:
    # Source: transformers ForCausalLMLoss: labels padded by one (int64 b*(s+1)), the shifted labels made
    # contiguous (int64 b*s), and nll_loss's flattened target (int64 b*s), live while the loss runs.
    return int(8 * micro_batch * (seq + 1) + 16 * micro_batch * seq)


def autocast_head_input_bytes(tokens: int, hidden: int) -> int:
    # Source: under torch.autocast the final norm runs in fp32; its output stays referenced by the model
    # output until the loss returns, while lm_head saves only its 16-bit cast.
    return int(tokens * hidden * 4)


def loss_backward_bytes(tokens: int, per_token: float) -> int:
    # Source: autograd: nll_loss grad + log_softmax grad, both fp32 b*s*V.
    return int(tokens * per_token)


def activation_grad_bytes(tokens: int, seq: int, per_token: float, per_token_quad: float) -> int:
    # Source: one block's backward working set: grads of the residual stream and widest intermediates.
    return int(tokens * per_token + tokens * seq * per_token_quad)


def optimizer_step_temp_bytes(optimizer: str, impl: str, trained_on_rank: int, state_bytes: int,
                              largest_param: int, previous_param: int = 0) -> int:
    # Source: torch.optim _multi_tensor_adamw: _foreach_sqrt(exp_avg_sq) copies every state;
    # _single_tensor_adamw: sqrt() then div() of one tensor at a time, while the loop's `denom` still
    # holds the previous parameter's (previous_param: the one registered before the largest);
    # fused kernels allocate nothing.
    if impl == "fused" or optimizer in ("adamw8bit", "sgd"):
        return 0
    if optimizer == "adamw" and impl == "foreach":
        return int(trained_on_rank * state_bytes)
    return int((2 * largest_param + (previous_param if optimizer == "adamw" else 0)) * state_bytes)


def checkpoint_save_bytes(mode: str, unit_params: int, state_bytes: int) -> int:
    # Source: FSDP FULL_STATE_DICT gathers one unit at a time on the GPU (offload_to_cpu per unit);
    # sharded DCP / DeepSpeed per-rank saves write the local shards without a device copy.
    return int(unit_params * state_bytes) if mode == "full" else 0


def qlora_dequant_bytes(model, regime: str, base_dtype: str) -> int:
    """The one dequantized weight a bitsandbytes matmul holds (forward and backward): the widest
    block linear. Under autocast / fp32 the input is the fp32 stream peft's upcast leaves."""
    if base_dtype not in ("nf4", "int8"):
        return 0
    widest = max((i * o for _, i, o, _ in model_linears(model)), default=0)
    if base_dtype == "nf4":
        # Source: bitsandbytes gemm_4bit (default kernel, and CUDA above ~512 tokens) and
        # MatMul4Bit.backward: dequantize_4bit of the whole weight in bnb_4bit_compute_dtype, after
        # dequantize_blockwise of the nested absmax to fp32 (one per 64-block).
        return widest * (4 if regime == "fp32" else 2) + 4 * -(-widest // 64)
    # Source: bitsandbytes MatMul8bitFp.forward/backward (CPU) and MatMul8bitLt.backward (CUDA):
    # CB.to(A.dtype) * SCB, the weight in the input's dtype.
    return widest * (2 if regime == "half" else 4)
