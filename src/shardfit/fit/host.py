"""Host RAM and NVMe as constraints of a fit plan: what each plan needs per node, and the host RAM
assumed when --host-memory-gib is not given.

Offload moves states to host RAM (pinned), and a full-state-dict save gathers on rank 0's host: a
plan whose host need is beyond the machine is not a plan. Without --host-memory-gib the need is
compared with a typical GPU server (below) and plans beyond it are flagged, never recommended silently.
"""
from __future__ import annotations

from shardfit.units import fmt_bytes

GIB = 1024**3
# Cloud and DGX GPU servers carry about twice their GPUs' memory in host RAM (DGX H100: 2 TiB for
# 8 x 80 GB; p4d.24xlarge: 1152 GiB for 8 x 40 GB; g5.xlarge: 16 GiB for one A10G, the low end).
HOST_PER_GPU_MEMORY = 2.0
MIN_ASSUMED_HOST_GIB = 64


def assumed_host_gib(gpu, gpus_per_node: int) -> float:
    return max(MIN_ASSUMED_HOST_GIB, HOST_PER_GPU_MEMORY * gpu.memory_gib * gpus_per_node)


def host_limit(request, gpu) -> tuple[float, bool]:
    """(host RAM per node in GiB, True when it is the assumption rather than --host-memory-gib)."""
    if request.base.cluster.host_memory_gib is not None:
        return request.base.cluster.host_memory_gib, False
    return assumed_host_gib(gpu, request.base.cluster.gpus_per_node), True


def assumption_note(request, gpu) -> str:
    limit, assumed = host_limit(request, gpu)
    if not assumed:
        return f"host RAM {limit:g} GiB per node (--host-memory-gib): plans beyond it are rejected"
    return (f"host RAM assumed {limit:g} GiB per node ({HOST_PER_GPU_MEMORY:g} x GPU memory, at least "
            f"{MIN_ASSUMED_HOST_GIB} GiB; set --host-memory-gib): plans beyond it are flagged")


def over_assumed(host_bytes: int, request, gpu) -> bool:
    limit, assumed = host_limit(request, gpu)
    return assumed and host_bytes > limit * GIB


def needs_text(host_bytes: int, nvme_bytes: int, request, gpu) -> str:
    """'host RAM 23.5 GiB per node[, NVMe 1.2 TiB per node][ -- ABOVE the 64 GiB assumed ...]'."""
    text = f"host RAM {fmt_bytes(host_bytes)} per node" if host_bytes else "no host RAM for states (no offload)"
    if nvme_bytes:
        text += f", NVMe {fmt_bytes(nvme_bytes)} per node"
    if over_assumed(host_bytes, request, gpu):
        limit, _ = host_limit(request, gpu)
        text += f" -- ABOVE the {limit:g} GiB assumed: check the machine, give --host-memory-gib"
    return text
