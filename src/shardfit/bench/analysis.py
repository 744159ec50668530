"""Judging the measured figures: prediction vs measurement, collectives vs theory, each strategy's
loss vs the DDP/fp32 reference (with the likely cause of a divergence), and the environment."""
from __future__ import annotations

import os
import platform
from importlib.metadata import PackageNotFoundError, version

from shardfit.bench.comm import theoretical_comm
from shardfit.estimate.estimator import estimate

# |loss - reference| / reference above this is a divergence. DeepSpeed in fp32 matches DDP to
# ~1e-4 (different reduction order); 16-bit training drifts by a few 1e-3 over a few steps.
TOLERANCE = {"fp32": 3e-3, "bf16": 2e-2, "fp16": 2e-2, "bf16-pure": 2e-2}
_DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2, "bf16-pure": 2}


def predicted(plan) -> dict | None:
    """The estimator's per-rank tensor bytes by category at its peak phase (an `error` entry when
    it cannot estimate this plan)."""
    try:
        result = estimate(plan)
        return {"peak_bytes": result.peak_bytes, "peak_phase": result.peak_phase,
                "by_category_at_peak": dict(result.phases[result.peak_phase]),
                "by_phase": {phase: dict(cats) for phase, cats in result.phases.items()},
                "device_peak_bytes": result.device_peak_bytes, "host": dict(result.host)}
    except Exception as exc:  # noqa: BLE001 - a missing prediction must not lose the measurement
        return {"error": f"{type(exc).__name__}: {exc}"[:300]}


def comm_theory(plan) -> dict:
    t, kind = plan.training, plan.strategy.kind
    sixteen = _DTYPE_BYTES[t.precision]
    # Parameters travel in the compute dtype; gradients are reduced in fp32 by DDP (autocast keeps
    # fp32 grads) and by FSDP1/FSDP2 (shardfit.engines sets reduce_dtype fp32), in 16-bit by DeepSpeed
    # (its communication dtype follows the model's) and whenever the model itself is 16-bit.
    grad_bytes = sixteen if (plan.strategy.is_deepspeed or t.precision == "bf16-pure") else 4
    persistent = _persistent_params(plan) if kind == "zero3" else 0
    root = plan.model.non_block_params if kind in ("fsdp", "fsdp2") else 0
    return theoretical_comm(plan.strategy, plan.model.n_params, grad_bytes=grad_bytes, param_bytes=sixteen,
                            root_params=root, persistent_params=persistent)


def _persistent_params(plan) -> int:
    """Rough: when even a whole block is under DeepSpeed's persistence threshold, nothing is
    partitioned; otherwise assume the partitioned bulk dominates."""
    spec = plan.model
    threshold = plan.strategy.param_persistence_threshold
    if max(spec.largest_layer_params, spec.block_params) and max(spec.largest_layer_params, 1) < threshold:
        return spec.n_params
    return 0


def likely_cause(plan) -> str:
    """The usual reason a strategy's loss leaves the DDP/fp32 reference, for this plan."""
    s, t = plan.strategy, plan.training
    if t.precision == "bf16-pure" and s.kind in ("fsdp", "fsdp2", "ddp"):
        return "bf16 optimizer state without fp32 master weights (pure bf16): updates below bf16 resolution are lost"
    if t.precision == "fp16" and t.loss_scaling is False:
        return "fp16 without loss scaling: small gradients underflow to zero"
    if s.is_deepspeed and s.offload_optimizer:
        return "DeepSpeed's CPU Adam (offload) is a different AdamW implementation from torch's"
    if t.precision in ("bf16", "fp16") and s.kind == "fsdp":
        return "gradients reduced in 16-bit (FSDP MixedPrecision reduce_dtype) instead of fp32"
    if t.precision in ("bf16", "fp16"):
        return f"{t.precision} autocast rounding differs from the fp32 reference"
    if s.is_deepspeed:
        return "DeepSpeed's bucketed reduction order differs; beyond ~1e-3 suspect its optimizer settings (eps, weight decay)"
    return "unexpected for an fp32 data-parallel strategy: check seeds, data order and the LR schedule"


def compare(results: list[dict], plans: dict, reference: dict | None = None) -> None:
    """Add `correctness` (vs the DDP/fp32 reference: `reference`, the separate fp32 job run when
    the plan is not fp32, else the ddp row) and `memory_error` (measured vs predicted) in place.
    plans: the plan each strategy ran, by label (bench() built them already)."""
    if reference is None or reference.get("status") != "ok":
        reference = next((r for r in results if r.get("strategy") == "ddp" and r.get("status") == "ok"), None)
    ref_loss = reference["loss"]["final"] if reference else None
    ref_world = reference.get("world_size") if reference else None
    for result in results:
        if result.get("status") != "ok":
            continue
        splan = plans[result["strategy"]]
        precision = splan.training.precision
        exact_ref = reference is not None and (reference.get("precision") or precision) == "fp32"
        if ref_loss is None:
            result["correctness"] = {"status": "no reference", "note": "the DDP reference did not run: nothing to compare against"}
        elif ref_world is not None and result["world_size"] != ref_world:
            # Each rank trains on its own share of the batch: fewer ranks see other data (bench --nproc 1 compares).
            result["correctness"] = {"status": "not comparable",
                                     "note": f"{result['world_size']} rank(s) train on other data than the {ref_world}-rank "
                                             "reference: compare with `shardfit bench --nproc 1`"}
        else:
            loss = result["loss"]["final"]
            rel = abs(loss - ref_loss) / abs(ref_loss)
            tol = TOLERANCE[precision]
            status = "match" if rel <= tol else "diverged"
            result["correctness"] = {
                "status": status, "reference": "ddp/fp32" if exact_ref else f"ddp/{precision}",
                "reference_loss": ref_loss, "loss": loss, "rel_diff": rel, "tolerance": tol,
                "k": result["loss"]["k"], "likely_cause": likely_cause(splan) if status == "diverged" else None}
        pred = result.get("predicted")
        measured = result["memory"]["peak_bytes"]
        if pred and "peak_bytes" in pred and measured:
            result["memory_error"] = {"predicted_bytes": pred["peak_bytes"], "measured_bytes": measured,
                                      "rel_error": (pred["peak_bytes"] - measured) / measured}
        theory = result.get("comm_theory")
        if theory and theory["volume_bytes"]:
            result["comm_ratio"] = result["comm"]["volume_bytes"] / theory["volume_bytes"]


def environment(nproc: int) -> dict:
    import torch

    env = {"python": platform.python_version(), "platform": platform.platform(), "machine": platform.machine(),
           "cpu_count": os.cpu_count(), "torch": torch.__version__, "world_size": nproc,
           "device": "cuda" if torch.cuda.is_available() else "cpu",
           "backend": "nccl" if torch.cuda.is_available() else "gloo"}
    if torch.cuda.is_available():
        env["gpu"] = torch.cuda.get_device_name(0)
        env["cuda"] = torch.version.cuda
    for name in ("deepspeed", "transformers", "shardfit", "numpy", "matplotlib"):
        try:  # metadata, not import: importing deepspeed prints accelerator warnings
            env[name] = version(name)
        except PackageNotFoundError:
            env[name] = None
    try:
        env["load_average"] = list(os.getloadavg())
    except OSError:
        pass
    return env


def _mb(value) -> str:
    return "-" if value is None else f"{value / 1e6:.2f} MB"


def progress_line(result: dict) -> str:
    label = f"{result['strategy']:<20}"
    if result.get("status") != "ok":
        return f"{label} {result.get('status', 'failed').upper():<8} {result.get('error', '')[:90]}"
    step = result["step_time_s"]["median"] * 1e3 if result.get("step_time_s") else float("nan")
    ckpt = result.get("checkpoint") or {}
    saved = f"ckpt {_mb(ckpt['bytes'])} saved" if ckpt else "no ckpt"
    return (f"{label} ok       peak {_mb(result['memory']['peak_bytes'])}  step {step:.1f} ms  "
            f"comm {_mb(result['comm']['bytes'])}/step  loss {result['loss']['final']:.4f}  {saved}  "
            f"({result['job_s']:.0f} s)")
