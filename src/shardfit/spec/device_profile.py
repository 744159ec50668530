"""A device profile: the rates `shardfit calibrate` measured on one machine, saved as JSON or YAML,
and the GPU-like object the step-time model consumes. No torch: loading a profile is analytic.

A catalog GPU carries datasheet figures, which the step-time model discounts by its efficiencies; a
profile carries achieved rates (GPU.measured), which it uses as they are.
"""
from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path

from shardfit.errors import ShardfitError
from shardfit.spec.gpus import GPU, MeasuredRates
from shardfit.spec.planfile import json_load_unique, yaml_load_unique

PROFILE_VERSION = 1
HOOK_NAMES = ("deepspeed_grad_hook", "deepspeed_zero3_fetch", "sac_dispatch_per_op", "eager_forward_op",
              "eager_backward_op", "eager_recompute_op", "eager_head_ops", "ddp_grad_hook",
              *(f"{kind}_unit_{per}" for kind in ("fsdp2", "fsdp2_no_reshard", "fsdp_full_shard", "fsdp_shard_grad_op")
                for per in ("micro", "step")))  # the engine_hooks figures the model reads
FORMAT_KEY = "shardfit_device_profile"  # its value is the version


@dataclass(frozen=True, kw_only=True)
class DeviceProfile:
    device: str  # "cpu" | "cuda"
    name: str  # the processor or the GPU's name
    machine: dict  # hostname, platform, cores
    torch: str
    date: str  # ISO 8601, UTC
    ranks: int  # ranks that ran at once while measuring (the rates are per rank under that sharing)
    threads_per_rank: int
    matmul: list  # [{"dtype", "tokens", "width", "tflops"}]
    memory_bandwidth_gbs: float
    links: dict  # {"intra": {"backend", "bandwidth_gbs", "latency_s", ...}}
    comm_overlap: float
    host_link_gbs: float | None
    optimizer: dict  # {"impl", "params_per_s"}: the engines' optimizer on this device
    cpu_adam: dict  # {"impl", "params_per_s"}: the offload path's CPU Adam
    memory_gib: float  # device memory (RAM on CPU)
    # {"deepspeed_grad_hook": s, "deepspeed_zero3_fetch": s, "sac_dispatch_per_op": s, "deepspeed":
    # version, ...}: host work per tensor / submodule / op (fit/engine_overhead.py); absent in older profiles
    engine_hooks: dict = field(default_factory=dict)
    notes: list = field(default_factory=list)
    version: int = PROFILE_VERSION

    def rates(self) -> MeasuredRates:
        return MeasuredRates(
            device=str(self.device),
            matmul=tuple((m["dtype"], int(m["tokens"]), int(m["width"]), float(m["tflops"])) for m in self.matmul),
            memory_gbs=float(self.memory_bandwidth_gbs),
            links=tuple((link, float(v["bandwidth_gbs"]), float(v["latency_s"])) for link, v in sorted(self.links.items())),
            comm_overlap=float(self.comm_overlap),
            host_link_gbs=None if self.host_link_gbs is None else float(self.host_link_gbs),
            optimizer_params_per_s=float(self.optimizer["params_per_s"]),
            cpu_adam_params_per_s=float(self.cpu_adam["params_per_s"]),
            hooks=tuple((name, float(self.engine_hooks[name])) for name in HOOK_NAMES if name in self.engine_hooks))

    def as_gpu(self, memory_gib: float | None = None) -> GPU:
        """The GPU the step-time model consumes: the measured rates, and the memory of `memory_gib`
        (a budget) or of the device itself. The datasheet-style fields hold the measured figures too
        (the best matmul rate, the copy bandwidth, the link), for what reads only those (MFU)."""
        rates = self.rates()
        best = {dtype: max(t for d, _, _, t in rates.matmul if d == dtype) for dtype, *_ in rates.matmul}
        intra = rates.link("intra") or (0.0, 0.0)
        inter = rates.link("inter") or intra
        return GPU(name=f"profile:{self.name}", memory_gib=float(memory_gib or self.memory_gib),
                   bf16_tflops=best.get("bf16", best.get("fp32", 0.0)), supports_bf16="bf16" in best,
                   memory_bandwidth_gbs=rates.memory_gbs, intra_node_gbs=intra[0], inter_node_gbs=inter[0],
                   host_link_gbs=rates.host_link_gbs or rates.memory_gbs, measured=rates)

    def to_data(self) -> dict:
        data = asdict(self)
        data.pop("version")
        return {FORMAT_KEY: self.version, **data}


_REQUIRED = ("device", "name", "machine", "torch", "date", "ranks", "threads_per_rank", "matmul",
             "memory_bandwidth_gbs", "links", "comm_overlap", "host_link_gbs", "optimizer", "cpu_adam", "memory_gib")


def _positive(value, what: str, path) -> None:
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value) or value <= 0:
        raise ShardfitError(f"device profile {path}: {what} must be a positive number, got {value!r}: "
                            "rerun `shardfit calibrate`")


def profile_from_data(data, path="(data)") -> DeviceProfile:
    if not isinstance(data, dict) or FORMAT_KEY not in data:
        raise ShardfitError(f"{path} is not a shardfit device profile (no '{FORMAT_KEY}' key): "
                            "write one with `shardfit calibrate -o FILE`")
    if data[FORMAT_KEY] != PROFILE_VERSION:
        raise ShardfitError(f"device profile {path} has version {data[FORMAT_KEY]!r}; this shardfit reads version "
                            f"{PROFILE_VERSION}: rerun `shardfit calibrate`")
    missing = [key for key in _REQUIRED if key not in data]
    if missing:
        raise ShardfitError(f"device profile {path} lacks '{missing[0]}': rerun `shardfit calibrate`")
    try:
        fields = {key: data[key] for key in (*_REQUIRED, "engine_hooks", "notes") if key in data}
        profile = DeviceProfile(**fields)
        rates = profile.rates()
    except (TypeError, KeyError, ValueError, AttributeError) as exc:
        raise ShardfitError(f"device profile {path} is malformed ({type(exc).__name__}: {exc}): "
                            "rerun `shardfit calibrate`") from None
    if not rates.matmul:
        raise ShardfitError(f"device profile {path} has no matmul rates: rerun `shardfit calibrate`")
    for dtype, _, _, tflops in rates.matmul:
        _positive(tflops, f"the {dtype} matmul rate", path)
    _positive(rates.memory_gbs, "memory_bandwidth_gbs", path)
    for link, gbs, latency in rates.links:
        _positive(gbs, f"the {link} link's bandwidth", path)
        if not latency >= 0:
            raise ShardfitError(f"device profile {path}: the {link} link's latency must be >= 0, got {latency}")
    if not 0 <= rates.comm_overlap <= 1:
        raise ShardfitError(f"device profile {path}: comm_overlap must be between 0 and 1, got {rates.comm_overlap}")
    _positive(rates.optimizer_params_per_s, "optimizer.params_per_s", path)
    _positive(rates.cpu_adam_params_per_s, "cpu_adam.params_per_s", path)
    _positive(profile.memory_gib, "memory_gib", path)
    for name, seconds in rates.hooks:
        if not (math.isfinite(seconds) and seconds >= 0):
            raise ShardfitError(f"device profile {path}: engine_hooks.{name} must be >= 0 seconds, got {seconds}")
    return profile


def save_profile(profile: DeviceProfile, path) -> Path:
    """Write JSON (or YAML for .yaml/.yml) next to the target, then rename it over: a good profile is
    never half-overwritten."""
    path = Path(path)
    data = profile.to_data()
    if path.suffix.lower() in (".yaml", ".yml"):
        import yaml

        text = yaml.safe_dump(data, sort_keys=False)
    else:
        text = json.dumps(data, indent=1) + "\n"
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(path.name + ".partial")
    partial.write_text(text)
    partial.replace(path)
    return path


def load_profile(path) -> DeviceProfile:
    path = Path(path)
    if not path.is_file():
        raise ShardfitError(f"--device-profile {path}: no such file (write one with `shardfit calibrate -o {path}`)")
    text = path.read_text()
    try:
        yaml_file = path.suffix.lower() in (".yaml", ".yml")
        data = yaml_load_unique(text) if yaml_file else json_load_unique(text)
    except Exception as exc:  # noqa: BLE001 - any parse error is one line for the user
        raise ShardfitError(f"device profile {path} does not parse ({type(exc).__name__}): rerun `shardfit calibrate`") from None
    return profile_from_data(data, path)
