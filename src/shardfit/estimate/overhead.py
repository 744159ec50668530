"""Runtime overhead a GPU run pays on top of its tensors; a CPU run has none of it, so it is reported
apart (Estimate.overhead) and the tensor categories stay comparable with CPU measurements."""
from __future__ import annotations

MIB = 1024**2

# CUDA context with lazy module loading plus the cuBLAS/cuBLASLt workspaces of the default stream.
CUDA_CONTEXT_BYTES = 512 * MIB
# NCCL's own buffers per communicator (NCCL_BUFFSIZE 4 MiB x channels x send/recv, + proxy/IB
# buffers when it spans nodes). Memory-math.md: "hundreds of MiB per communicator".
NCCL_INTRA_NODE_BYTES = 256 * MIB
NCCL_INTER_NODE_EXTRA_BYTES = 256 * MIB
# PyTorch's caching allocator rounds to 512 B blocks inside 2 MiB / 20 MiB segments; steady-state
# fragmentation of a training loop is a few percent of the tensor peak.
ALLOCATOR_MARGIN = 0.05


def cuda_context_bytes() -> int:
    # Source: measured CUDA 12 contexts with lazy loading are 0.3-0.5 GiB; we take the top.
    return CUDA_CONTEXT_BYTES


def nccl_buffer_bytes(world: int, nodes: int, communicators: int) -> int:
    # Source: NCCL allocates per-communicator channel buffers; none without a peer.
    if world <= 1:
        return 0
    per = NCCL_INTRA_NODE_BYTES + (NCCL_INTER_NODE_EXTRA_BYTES if nodes > 1 else 0)
    return per * communicators


def allocator_margin_bytes(tensor_peak: int) -> int:
    # Source: CUDA caching allocator fragmentation (reserved - allocated) of a steady training loop.
    return int(tensor_peak * ALLOCATOR_MARGIN)
