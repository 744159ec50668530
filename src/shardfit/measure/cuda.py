"""CUDA-only figures: the caching allocator's view, which tensor accounting can't see."""
from __future__ import annotations


def cuda_stats() -> dict:
    """allocated / reserved / max allocated, allocator retries, fragmentation (reserved − allocated)
    and memory outside PyTorch (device used − reserved: CUDA context, NCCL, cuBLAS workspaces)."""
    import torch

    stats = torch.cuda.memory_stats()
    allocated = torch.cuda.memory_allocated()
    reserved = torch.cuda.memory_reserved()
    free, total = torch.cuda.mem_get_info()
    return {
        "allocated": allocated,
        "reserved": reserved,
        "max_allocated": torch.cuda.max_memory_allocated(),
        "max_reserved": torch.cuda.max_memory_reserved(),
        "num_alloc_retries": int(stats.get("num_alloc_retries", 0)),
        "num_ooms": int(stats.get("num_ooms", 0)),
        "fragmentation": reserved - allocated,
        "outside_pytorch": max(0, (total - free) - reserved),
        "device_total": total,
    }


def dump_snapshot(path: str) -> str | None:
    """Write the allocator history (open it at https://pytorch.org/memory_viz)."""
    import torch

    try:
        torch.cuda.memory._dump_snapshot(path)
    except Exception:  # noqa: BLE001 - history was never enabled; the diagnosis still stands
        return None
    return path
