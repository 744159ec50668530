"""Device profiles (spec/device_profile.py): the round trip, the step-time model reading measured
rates as they are (no datasheet efficiency on top), plan / fit / bench flags, bad files, no torch."""
import json
import subprocess
import sys

import pytest

from launch import shardfit
from shardfit.errors import ShardfitError
from shardfit.estimate.traffic import micro_batch_traffic_bytes
from shardfit.fit import FitRequest, fit, step_time
from shardfit.fit.steptime import GEMM_EFFICIENCY, comm_parts, matmul_rate, memory_seconds, optimizer_seconds
from shardfit.spec.device_profile import DeviceProfile, load_profile, save_profile
from shardfit.spec.gpus import get_gpu
from shardfit.spec.models import load_model_spec
from shardfit.spec.plan import Plan


def _profile(**changes) -> DeviceProfile:
    figures = dict(
        device="cpu", name="test cpu", machine={"hostname": "h"}, torch="2.0", date="2026-12-02T00:00:00+00:00",
        ranks=2, threads_per_rank=1,
        matmul=[{"dtype": "fp32", "tokens": 64, "width": 64, "tflops": 0.004},
                {"dtype": "fp32", "tokens": 4096, "width": 64, "tflops": 0.016},
                {"dtype": "fp32", "tokens": 64, "width": 1024, "tflops": 0.02},
                {"dtype": "fp32", "tokens": 4096, "width": 1024, "tflops": 0.02},
                {"dtype": "bf16", "tokens": 1024, "width": 256, "tflops": 0.08}],
        memory_bandwidth_gbs=6.0, links={"intra": {"backend": "gloo", "bandwidth_gbs": 0.9, "latency_s": 4e-4}},
        comm_overlap=0.15, host_link_gbs=None, optimizer={"impl": "torch.optim.AdamW", "params_per_s": 4e7},
        cpu_adam={"impl": "deepspeed.ops.adam.DeepSpeedCPUAdam", "params_per_s": 2e8}, memory_gib=23.0)
    figures.update(changes)
    return DeviceProfile(**figures)


def _plan(**training) -> Plan:
    return Plan(model=load_model_spec("tiny-llama")).with_changes(
        strategy={"kind": "ddp"}, cluster={"nodes": 1, "gpus_per_node": 2, "gpu": "custom:1"},
        training={"micro_batch": 2, "seq_len": 64, "precision": "fp32", **training})


@pytest.mark.parametrize("suffix", [".json", ".yaml"])
def test_round_trip_keeps_every_rate(tmp_path, suffix):
    profile = _profile()
    path = save_profile(profile, tmp_path / f"p{suffix}")
    loaded = load_profile(path)
    assert loaded == profile and loaded.rates() == profile.rates()
    assert json.loads(path.read_text())["shardfit_device_profile"] == 1 if suffix == ".json" else True
    assert not list(tmp_path.glob("*.partial"))


def test_measured_rates_are_used_as_they_are():
    gpu = _profile().as_gpu(memory_gib=1.0)
    plan = _plan()  # 128 tokens per micro-batch, width 64: between the 64- and 4096-token points
    rate, _ = matmul_rate(plan, gpu)
    # log-linear between 4 and 16 GFLOP/s at 64 and 4096 tokens; no GEMM_EFFICIENCY, no ramp on top
    share = 1  # log2(128 / 64) = 1 of log2(4096 / 64) = 6
    assert rate == pytest.approx((0.004 + (0.016 - 0.004) * share / 6) * 1e12)
    assert memory_seconds(plan, gpu) == pytest.approx(micro_batch_traffic_bytes(plan) / 6e9)
    assert optimizer_seconds(plan, gpu) == pytest.approx(plan.model.n_params / 4e7)
    t = step_time(plan, gpu)
    (part,) = comm_parts(plan)
    assert t.comm_s == pytest.approx(part.bytes / 0.9e9 + part.collectives * 4e-4)
    # The catalog path does discount: the same plan on a datasheet device uses GEMM_EFFICIENCY.
    catalog_rate, eff = matmul_rate(plan, get_gpu("H100-80GB"))
    assert eff < GEMM_EFFICIENCY and catalog_rate < get_gpu("H100-80GB").bf16_tflops * 1e12 * GEMM_EFFICIENCY


def test_measured_overlap_replaces_the_datasheet_figure():
    plan = _plan()
    hidden, exposed = (step_time(plan, _profile(comm_overlap=x).as_gpu()) for x in (1.0, 0.0))
    assert exposed.exposed_comm_s == pytest.approx(exposed.comm_s)
    assert hidden.exposed_comm_s < exposed.exposed_comm_s


def test_fit_ranks_with_the_profile():
    gpu = _profile().as_gpu(memory_gib=get_gpu("custom:0.02").memory_gib)
    request = FitRequest.build(model=load_model_spec("tiny-llama"), gpu="custom:0.02", gpus_per_node=2, seq_len=64,
                               global_batch=8, precision="fp32", device="cpu", engines=("ddp", "fsdp"), device_profile=gpu)
    result = fit(request)
    assert result.gpu is gpu and result.best is not None
    assert result.best.time.total_s == pytest.approx(step_time(result.best.plan, gpu).total_s)
    assert result.best.time.total_s != pytest.approx(step_time(result.best.plan, get_gpu("custom:0.02")).total_s)


def test_a_profile_measured_on_one_node_refuses_a_multi_node_plan():
    plan = _plan().with_changes(cluster={"nodes": 2, "gpus_per_node": 2})
    with pytest.raises(ShardfitError, match="no 'inter' link"):
        step_time(plan, _profile().as_gpu())


@pytest.mark.parametrize("edit, message", [
    (lambda d: d.update(shardfit_device_profile=99), "version 99"),
    (lambda d: d.pop("matmul"), "lacks 'matmul'"),
    (lambda d: d.update(memory_bandwidth_gbs=-1), "memory_bandwidth_gbs must be a positive number"),
    (lambda d: d.update(comm_overlap=3), "comm_overlap must be between 0 and 1"),
])
def test_bad_profiles_fail_in_one_line(tmp_path, edit, message):
    data = _profile().to_data()
    edit(data)
    path = tmp_path / "p.json"
    path.write_text(json.dumps(data))
    with pytest.raises(ShardfitError, match=message):
        load_profile(path)
    done = shardfit("fit", "tiny-llama", "--cpu", "--gpus", "2", "--device-profile", str(path), check=False)
    assert done.returncode == 2 and len(done.stderr.strip().splitlines()) == 1 and "Traceback" not in done.stderr


def test_plan_and_fit_commands_use_the_profile_without_torch(tmp_path):
    path = save_profile(_profile(), tmp_path / "p.json")
    fitted = json.loads(shardfit("fit", "tiny-llama", "--cpu", "--gpu", "custom:0.02", "--gpus", "2", "--seq", "64",
                                 "--global-batch", "8", "--precision", "fp32", "--device-profile", str(path),
                                 "--json").stdout)
    assert fitted["gpu"] == "profile:test cpu" and fitted["best"]["step_s"] > 0
    assert any("device profile" in note for note in fitted["notes"])
    planned = shardfit("plan", "tiny-llama", "--gpus", "2", "--strategy", "ddp,zero3", "--device", "cpu",
                       "--device-profile", str(path)).stdout
    assert "step time under" in planned and "zero3" in planned.split("step time under")[1]
    code = (f"import sys; from shardfit.spec.device_profile import load_profile; from shardfit.fit import fit;"
            f"g = load_profile({str(path)!r}).as_gpu(); assert g.measured is not None;"
            f"assert 'torch' not in sys.modules, 'torch imported'")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_measured_engine_hooks_replace_the_published_figures(tmp_path):
    from shardfit.fit.engine_overhead import host_seconds

    hooks = {"deepspeed_grad_hook": 1e-5, "deepspeed_zero3_fetch": 2e-4, "deepspeed": "0.19.8"}
    profile = _profile(engine_hooks=hooks)
    loaded = load_profile(save_profile(profile, tmp_path / "p.json"))
    assert loaded.engine_hooks == hooks
    plan = _plan().with_changes(strategy={"kind": "zero3"})
    measured = host_seconds(plan, loaded.as_gpu(memory_gib=1.0))
    catalog = host_seconds(plan, _profile().as_gpu(memory_gib=1.0))  # no hooks measured: published figures
    assert 0 < measured < catalog


def test_a_profile_without_engine_hooks_still_loads_and_a_negative_hook_is_refused(tmp_path):
    data = _profile().to_data()
    data.pop("engine_hooks")
    path = tmp_path / "old.json"
    path.write_text(json.dumps(data))
    assert load_profile(path).engine_hooks == {}
    data["engine_hooks"] = {"deepspeed_zero3_fetch": -1.0}
    path.write_text(json.dumps(data))
    with pytest.raises(ShardfitError, match="engine_hooks.deepspeed_zero3_fetch"):
        load_profile(path)
