"""DeepSpeed's own model-state estimator, restated without importing DeepSpeed.

Mirrors `estimate_zero2_model_states_mem_needs` (runtime/zero/stage_1_and_2.py) and
`estimate_zero3_model_states_mem_needs` (runtime/zero/stage3.py) of DeepSpeed 0.19: the same
arithmetic and the same int() truncation, so tests can compare byte for byte. It counts 18 B/param
for the sharded part (16-bit grad 2 + fp32 grad 4 + fp32 master 4 + Adam 8) and ignores
activations, buckets, CUDA context and LoRA. cpu figures are per node and carry a 1.5 buffer factor.
"""
from __future__ import annotations


def zero2_model_states(total_params: int, num_gpus_per_node: int = 1, num_nodes: int = 1,
                       cpu_offload: bool = True, additional_buffer_factor: float = 1.5) -> tuple[int, int]:
    """(cpu_bytes_per_node, gpu_bytes_per_gpu), as DeepSpeed computes them."""
    total_gpus = num_nodes * num_gpus_per_node
    if cpu_offload:
        gpu_mem = 2 * total_params
        cpu_mem = total_params * max(4 * total_gpus, 16) * additional_buffer_factor
    else:
        gpu_mem = 2 * total_params + int(18 * total_params / total_gpus)
        cpu_mem = total_params * 4 * num_gpus_per_node * additional_buffer_factor
    return int(cpu_mem), int(gpu_mem)


def zero3_model_states(total_params: int, largest_layer_params: int, num_gpus_per_node: int = 1,
                       num_nodes: int = 1, cpu_offload: bool = True, cpu_offload_params: bool = True,
                       zero_init: bool = True, additional_buffer_factor: float = 1.5) -> tuple[int, int, int]:
    """(cpu_bytes_per_node, gpu_bytes_per_gpu, largest_layer_memory), as DeepSpeed computes them."""
    total_gpus = num_nodes * num_gpus_per_node
    gpus_factor = 1 / num_nodes
    largest_layer_memory = 4 * largest_layer_params
    if cpu_offload:
        if cpu_offload_params:
            gpu_mem = largest_layer_memory
            if zero_init:
                cpu_mem = total_params * 18 * gpus_factor * additional_buffer_factor
            else:
                cpu_mem = total_params * max(4 * num_gpus_per_node, 18 * gpus_factor) * additional_buffer_factor
        else:
            gpu_mem = largest_layer_memory + int(2 * total_params / total_gpus)
            if zero_init:
                cpu_mem = total_params * 16 * gpus_factor * additional_buffer_factor
            else:
                cpu_mem = total_params * max(4 * num_gpus_per_node, 16 * gpus_factor) * additional_buffer_factor
    else:
        gpu_mem = largest_layer_memory + int(18 * total_params / total_gpus)
        if zero_init:
            cpu_mem = largest_layer_params * 4 * num_gpus_per_node * additional_buffer_factor
        else:
            cpu_mem = total_params * 4 * num_gpus_per_node * additional_buffer_factor
    return int(cpu_mem), int(gpu_mem), int(largest_layer_memory)
