"""The `zero_optimization` section a Plan's strategy means in DeepSpeed's own keys: one builder for
what `emit` gives users and what the engines (train, bench, profile) run. Plain data; no deepspeed."""
from __future__ import annotations

from shardfit.spec.plan import Strategy

# The communication buffers DeepSpeed sizes in elements: the Strategy field, and the zero_optimization
# key zero_optimization() writes it as (doctor and `plan --deepspeed` read a user's JSON back with it).
BUFFER_KEYS = (("reduce_bucket_size", "reduce_bucket_size"), ("allgather_bucket_size", "allgather_bucket_size"),
               ("prefetch_bucket_size", "stage3_prefetch_bucket_size"),
               ("max_live_parameters", "stage3_max_live_parameters"))
DS_KEY = dict(BUFFER_KEYS)


def _offload(device: str, nvme_path: str | None, pin_memory: bool) -> dict:
    section = {"device": device, "pin_memory": pin_memory}
    if device == "nvme":
        section["nvme_path"] = nvme_path
    return section


def zero_optimization(s: Strategy, *, pin_memory: bool = True) -> dict:
    """DeepSpeed's zero_optimization for zero1/2/3. pin_memory: pinned host buffers for offload,
    which need a CUDA device (a CPU run passes False)."""
    stage = int(s.kind[-1])
    zero = {"stage": stage, "overlap_comm": s.overlap_comm, "contiguous_gradients": True,
            "reduce_bucket_size": s.reduce_bucket_size}
    if stage in (1, 2):
        zero.update(reduce_scatter=True, allgather_partitions=True, allgather_bucket_size=s.allgather_bucket_size)
    else:
        zero.update(stage3_prefetch_bucket_size=s.prefetch_bucket_size,
                    stage3_param_persistence_threshold=s.param_persistence_threshold,
                    stage3_max_live_parameters=s.max_live_parameters,
                    stage3_max_reuse_distance=s.max_reuse_distance,
                    # Sharded checkpoints: gathering 16-bit weights on rank 0 at save time needs the whole model there.
                    stage3_gather_16bit_weights_on_model_save=False)
    if s.offload_optimizer:
        zero["offload_optimizer"] = _offload(s.offload_optimizer, s.nvme_path, pin_memory)
    if s.offload_params:
        zero["offload_param"] = _offload(s.offload_params, s.nvme_path, pin_memory)
    return zero
