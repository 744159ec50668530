"""GPU catalog: memory, bf16 rate, bandwidths. Figures are vendor datasheet values (dense, no
sparsity); memory is what `torch.cuda.get_device_properties(...).total_memory` reports, in GiB,
which is a little under the marketed size. Link figures are per GPU and per direction."""
from __future__ import annotations

from dataclasses import dataclass

from shardfit.errors import ShardfitError
from shardfit.spec.sizes import parse_gib

GIB = 1024**3


@dataclass(frozen=True, kw_only=True)
class MeasuredRates:
    """Rates `shardfit calibrate` achieved on one machine (spec/device_profile.py). They are already
    achieved rates, so the step-time model applies none of its datasheet efficiencies to them."""
    device: str  # "cpu" | "cuda": where they were measured
    matmul: tuple[tuple[str, int, int, float], ...]  # (dtype "fp32"|"bf16", tokens M, width K=N, TFLOP/s)
    memory_gbs: float  # a large device copy, read + write bytes per second
    links: tuple[tuple[str, float, float], ...]  # (link "intra"|"inter"|"nic", GB/s per rank, latency s)
    comm_overlap: float  # fraction of overlappable communication hidden behind compute, as measured
    host_link_gbs: float | None  # pinned host<->device copy; None where the device is the host (CPU)
    optimizer_params_per_s: float  # the engines' own optimizer (torch AdamW) on this device
    cpu_adam_params_per_s: float  # the offload path's CPU Adam (DeepSpeed's, or torch's AdamW)
    # (name, seconds) of an engine's host work per tensor / submodule (fit/engine_overhead.py);
    # empty where calibrate did not measure them (the catalog figures are used then)
    hooks: tuple[tuple[str, float], ...] = ()

    def link(self, name: str) -> tuple[float, float] | None:
        """(GB/s, latency s) of a measured link, None when calibrate did not measure it."""
        return next(((gbs, latency) for link, gbs, latency in self.links if link == name), None)

    def hook(self, name: str, default: float) -> float:
        """Seconds of a measured engine hook, or `default` when calibrate did not measure it."""
        return next((seconds for hook, seconds in self.hooks if hook == name), default)


@dataclass(frozen=True, kw_only=True)
class GPU:
    name: str
    memory_gib: float
    bf16_tflops: float  # dense tensor-core rate for 16-bit inputs (fp16 where there is no bf16)
    supports_bf16: bool
    memory_bandwidth_gbs: float
    intra_node_gbs: float  # NVLink / xGMI / PCIe peer bandwidth, one direction
    inter_node_gbs: float  # typical network per GPU in clusters of this GPU (IB / RoCE / Ethernet)
    host_link_gbs: float  # PCIe to host RAM: the offload path
    measured: MeasuredRates | None = None  # set for a calibrated device profile; None = datasheet figures

    @property
    def memory_bytes(self) -> int:
        return int(self.memory_gib * GIB)


_CATALOG = [
    GPU(name="H100-80GB", memory_gib=79.1, bf16_tflops=989, supports_bf16=True, memory_bandwidth_gbs=3350, intra_node_gbs=450, inter_node_gbs=50, host_link_gbs=64),
    GPU(name="H100-PCIe", memory_gib=79.1, bf16_tflops=756, supports_bf16=True, memory_bandwidth_gbs=2000, intra_node_gbs=64, inter_node_gbs=25, host_link_gbs=64),
    GPU(name="H200", memory_gib=139.8, bf16_tflops=989, supports_bf16=True, memory_bandwidth_gbs=4800, intra_node_gbs=450, inter_node_gbs=50, host_link_gbs=64),
    GPU(name="B200", memory_gib=178.4, bf16_tflops=2250, supports_bf16=True, memory_bandwidth_gbs=8000, intra_node_gbs=900, inter_node_gbs=50, host_link_gbs=64),
    GPU(name="A100-80GB", memory_gib=79.2, bf16_tflops=312, supports_bf16=True, memory_bandwidth_gbs=2039, intra_node_gbs=300, inter_node_gbs=25, host_link_gbs=32),
    GPU(name="A100-40GB", memory_gib=39.4, bf16_tflops=312, supports_bf16=True, memory_bandwidth_gbs=1555, intra_node_gbs=300, inter_node_gbs=25, host_link_gbs=32),
    GPU(name="A10G", memory_gib=22.0, bf16_tflops=70, supports_bf16=True, memory_bandwidth_gbs=600, intra_node_gbs=32, inter_node_gbs=12.5, host_link_gbs=32),
    GPU(name="L4", memory_gib=22.0, bf16_tflops=121, supports_bf16=True, memory_bandwidth_gbs=300, intra_node_gbs=32, inter_node_gbs=12.5, host_link_gbs=32),
    GPU(name="L40S", memory_gib=44.4, bf16_tflops=362, supports_bf16=True, memory_bandwidth_gbs=864, intra_node_gbs=32, inter_node_gbs=12.5, host_link_gbs=32),
    GPU(name="RTX-3090", memory_gib=23.7, bf16_tflops=71, supports_bf16=True, memory_bandwidth_gbs=936, intra_node_gbs=32, inter_node_gbs=12.5, host_link_gbs=32),
    GPU(name="RTX-4090", memory_gib=23.6, bf16_tflops=165, supports_bf16=True, memory_bandwidth_gbs=1008, intra_node_gbs=32, inter_node_gbs=12.5, host_link_gbs=32),
    GPU(name="V100-16GB", memory_gib=15.8, bf16_tflops=125, supports_bf16=False, memory_bandwidth_gbs=900, intra_node_gbs=150, inter_node_gbs=12.5, host_link_gbs=16),
    GPU(name="V100-32GB", memory_gib=31.7, bf16_tflops=125, supports_bf16=False, memory_bandwidth_gbs=900, intra_node_gbs=150, inter_node_gbs=12.5, host_link_gbs=16),
    GPU(name="T4", memory_gib=14.6, bf16_tflops=65, supports_bf16=False, memory_bandwidth_gbs=320, intra_node_gbs=16, inter_node_gbs=6.25, host_link_gbs=16),
    GPU(name="MI300X", memory_gib=191.5, bf16_tflops=1307, supports_bf16=True, memory_bandwidth_gbs=5300, intra_node_gbs=448, inter_node_gbs=50, host_link_gbs=64),
]
CATALOG: dict[str, GPU] = {gpu.name.lower(): gpu for gpu in _CATALOG}
_ALIASES = {"h100": "h100-80gb", "h100-sxm": "h100-80gb", "a100": "a100-80gb", "v100": "v100-32gb",
            "3090": "rtx-3090", "4090": "rtx-4090", "h200-141gb": "h200", "mi300": "mi300x"}


def custom_gpu(memory_gib: float) -> GPU:
    """A GPU known only by its memory; rates are H100-like so step-time ranking still works."""
    if not memory_gib > 0:
        raise ShardfitError(f"custom GPU memory must be positive, got {memory_gib} GiB")
    base = CATALOG["h100-80gb"]
    return GPU(name=f"custom-{memory_gib:g}GiB", memory_gib=memory_gib, bf16_tflops=base.bf16_tflops,
               supports_bf16=True, memory_bandwidth_gbs=base.memory_bandwidth_gbs,
               intra_node_gbs=base.intra_node_gbs, inter_node_gbs=base.inter_node_gbs,
               host_link_gbs=base.host_link_gbs)


def get_gpu(name: str) -> GPU:
    """Look up a GPU by catalog name (case-insensitive), or `custom:24` / `24GiB` for a custom size."""
    key = str(name).strip().lower().replace("_", "-").replace(" ", "-")
    key = _ALIASES.get(key, key)
    if key in CATALOG:
        return CATALOG[key]
    raw = str(name).strip()
    custom = raw[len("custom:"):] if key.startswith(("custom:", "custom-")) else None
    text = custom if custom is not None else raw
    if custom is not None or (text[:1].isdigit() or text[:1] == "."):
        # 'g' alone was always GiB here; every other unit is what it says (GB = 10**9, GiB = 2**30).
        text = text[:-1] if text.lower().endswith("g") else text
        return custom_gpu(parse_gib(text, what="custom GPU memory"))
    known = ", ".join(gpu.name for gpu in _CATALOG)
    raise ShardfitError(f"unknown GPU '{name}': use one of {known}, or a custom size such as 'custom:24' (GiB) or 'custom:80GB'")


def split_gpus(total: int, nodes: int | None = None) -> tuple[int, int]:
    """(nodes, GPUs per node) for `--gpus TOTAL [--nodes N]`, the same in every command: without
    --nodes, up to 8 GPUs are one node and more are split over ceil(TOTAL / 8) equal nodes."""
    if total < 1:
        raise ShardfitError(f"--gpus must be at least 1, got {total}")
    if nodes is not None and nodes < 1:
        raise ShardfitError(f"--nodes must be at least 1, got {nodes}")
    if nodes is None:
        nodes = 1 if total <= 8 else (total + 7) // 8
    if total % nodes:
        raise ShardfitError(f"--gpus {total} (the total) does not split evenly over {nodes} nodes: "
                            "give a multiple of --nodes")
    return nodes, total // nodes
