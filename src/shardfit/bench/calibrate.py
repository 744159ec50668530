"""`shardfit calibrate`: measure this machine's rates in one torchrun job (bench.calibrate_worker)
and save them as a device profile (spec/device_profile.py) that plan / fit / bench read with
--device-profile."""
from __future__ import annotations

import json
import platform
import socket
import tempfile
import threading
import time
from datetime import datetime, timezone
from pathlib import Path

from shardfit.bench.run import _last_error, torchrun_job
from shardfit.errors import ShardfitError
from shardfit.spec.device_profile import DeviceProfile, save_profile

PREFIX = "calibrate: "


def _echo(log: Path, done: threading.Event, progress) -> None:
    """Print the worker's progress lines as they appear in the job's log."""
    seen = 0
    while True:
        finished = done.is_set()
        if log.exists():
            lines = log.read_text(errors="replace").splitlines()
            for line in lines[seen:]:
                if line.startswith(PREFIX):
                    progress(f"  {line[len(PREFIX):]}")
            seen = len(lines)
        if finished:
            return
        time.sleep(0.25)


def calibrate(out: Path, nproc: int = 2, timeout: float = 240, progress=print) -> DeviceProfile:
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        figures_file, log = Path(tmp) / "figures.json", Path(tmp) / "log.txt"
        log.write_text("")
        done = threading.Event()
        echo = threading.Thread(target=_echo, args=(log, done, progress), daemon=True)
        echo.start()
        try:
            code, seconds = torchrun_job([str(figures_file)], nproc, timeout, log, module="shardfit.bench.calibrate_worker")
        finally:
            done.set()
            echo.join()
        if code is None:
            raise ShardfitError(f"calibrate did not finish within {timeout:.0f} s (a hang, or a busy machine): "
                                "raise --timeout")
        if code != 0 or not figures_file.is_file():
            raise ShardfitError(f"calibrate failed (exit {code}): {_last_error(log)}")
        figures = json.loads(figures_file.read_text())
    notes = list(figures.pop("notes", []))
    notes.append(f"measured in {time.perf_counter() - started:.0f} s with {figures['ranks']} ranks running at once")
    profile = DeviceProfile(
        machine={"hostname": socket.gethostname(), "platform": platform.platform(), "python": platform.python_version()},
        date=datetime.now(timezone.utc).isoformat(timespec="seconds"), notes=notes, **figures)
    save_profile(profile, out)
    return profile


def summary(profile: DeviceProfile) -> list[str]:
    """The profile's figures, one line each (what calibrate prints at the end)."""
    best = {}
    for m in profile.matmul:
        best[m["dtype"]] = max(best.get(m["dtype"], 0.0), m["tflops"])
    link = profile.links["intra"]
    host = "skipped (device is the host)" if profile.host_link_gbs is None else f"{profile.host_link_gbs:.1f} GB/s"
    return [f"device     {profile.device}: {profile.name} ({profile.ranks} ranks x {profile.threads_per_rank} thread(s))",
            "matmul     " + ", ".join(f"{d} {t * 1e3:.1f} GFLOP/s" for d, t in best.items()) + " per rank (best shape)",
            f"memory     {profile.memory_bandwidth_gbs:.1f} GB/s copy per rank",
            f"link intra {link['backend']}: {link['bandwidth_gbs']:.2f} GB/s per rank, {link['latency_s'] * 1e6:.0f} us latency",
            f"overlap    {profile.comm_overlap:.0%} of a collective hides behind compute",
            f"host link  {host}",
            f"optimizer  {profile.optimizer['impl']}: {profile.optimizer['params_per_s'] / 1e6:.0f} M params/s",
            f"CPU Adam   {profile.cpu_adam['impl']}: {profile.cpu_adam['params_per_s'] / 1e6:.0f} M params/s",
            hooks_line(profile.engine_hooks)]


def hooks_line(hooks: dict) -> str:
    sac = (f"SAC {hooks['sac_dispatch_per_op'] * 1e6:.1f} us per op; " if "sac_dispatch_per_op" in hooks else "")
    if "eager_forward_op" in hooks:
        sac += (f"eager {hooks['eager_forward_op'] * 1e6:.1f} / {hooks['eager_backward_op'] * 1e6:.1f} / "
                f"{hooks['eager_recompute_op'] * 1e6:.1f} us per forward / backward / recomputed op; ")
    if "fsdp2_unit_micro" in hooks:
        sac += (f"DDP {hooks['ddp_grad_hook'] * 1e6:.0f} us per gradient, FSDP2 {hooks['fsdp2_unit_micro'] * 1e6:.0f} "
                f"and FSDP1 {hooks['fsdp_full_shard_unit_micro'] * 1e6:.0f} us per unit and micro-batch; ")
    if "deepspeed_grad_hook" not in hooks:
        return f"hooks      {sac}DeepSpeed's not measured (fit uses the published per-hook figures)"
    return (f"hooks      {sac}DeepSpeed {hooks.get('deepspeed', '?')}: {hooks['deepspeed_grad_hook'] * 1e6:.0f} us "
            f"per gradient hook, {hooks['deepspeed_zero3_fetch'] * 1e6:.0f} us per ZeRO-3 submodule fetch")
