"""`shardfit calibrate` for real (2 gloo ranks), its profile read back and used by plan / fit, the
oracle benchmark's reduced grid (benchmarks/bench_fit_oracle.py), and `fit --verify` correcting the
step time under the calibrated profile."""
import json

import pytest
import yaml

from launch import load_benchmark, shardfit
from shardfit.fit.steptime import step_time
from shardfit.spec.device_profile import HOOK_NAMES, load_profile
from shardfit.spec.gpus import get_gpu
from shardfit.spec.plan import plan_from_dict

pytestmark = [pytest.mark.multirank, pytest.mark.slow, pytest.mark.deepspeed]

oracle = load_benchmark("bench_fit_oracle")


@pytest.fixture(scope="module")
def calibrated(tmp_path_factory):
    path = tmp_path_factory.mktemp("calibrate") / "profile.yaml"
    done = shardfit("calibrate", "-o", str(path), timeout=300)
    return path, done.stdout


def test_calibrate_profile_round_trip(calibrated, tmp_path):
    path, stdout = calibrated
    data = yaml.safe_load(path.read_text())
    assert data["shardfit_device_profile"] == 1 and data["device"] == "cpu" and data["torch"] and data["date"]
    profile = load_profile(path)
    rates = profile.rates()
    assert {d for d, *_ in rates.matmul} == {"fp32", "bf16"} and all(t > 0 for *_, t in rates.matmul)
    assert rates.memory_gbs > 0 and rates.host_link_gbs is None  # no host link on CPU: skipped, and said
    assert "skipped" in stdout and profile.links["intra"]["backend"] == "gloo"
    assert 0 <= rates.comm_overlap <= 1 and rates.optimizer_params_per_s > 0 and rates.cpu_adam_params_per_s > 0
    assert profile.cpu_adam["impl"].startswith(("deepspeed.ops.adam.DeepSpeedCPUAdam", "torch.optim.AdamW"))
    assert f"{rates.memory_gbs:.1f} GB/s copy" in stdout  # the printed figures are the saved ones
    # DeepSpeed's hooks measured with the installed DeepSpeed, and what the step-time model reads
    hooks = profile.engine_hooks
    assert hooks["deepspeed"] and hooks["deepspeed_grad_hook"] >= 0 and hooks["deepspeed_zero3_fetch"] >= 0
    assert hooks["sac_dispatch_per_op"] > 0  # SAC's policy call per aten op, timed on this device
    # the eager host work per op of a transformers model, DDP's per gradient, FSDP's per unit (the engines')
    for name in ("eager_forward_op", "eager_backward_op", "eager_recompute_op", "ddp_grad_hook"):
        assert hooks[name] > 0, name
    for flavour in ("fsdp2", "fsdp2_no_reshard", "fsdp_full_shard", "fsdp_shard_grad_op"):
        assert hooks[f"{flavour}_unit_micro"] + hooks[f"{flavour}_unit_step"] > 0, flavour
    assert 0 < hooks["eager_head_ops"] < 335  # the non-block ops of tiny-llama's forward
    assert dict(rates.hooks) == {k: hooks[k] for k in HOOK_NAMES}
    assert "per ZeRO-3 submodule fetch" in stdout and "us per op" in stdout
    # fit and plan use the saved rates: fit's predicted step is the step-time model under this profile.
    fitted = json.loads(shardfit("fit", "tiny-llama", "--cpu", "--gpu", "custom:0.02", "--gpus", "2", "--seq", "64",
                                 "--global-batch", "8", "--precision", "fp32", "--device-profile", str(path),
                                 "--json").stdout)
    plan = plan_from_dict(fitted["plan"])
    gpu = profile.as_gpu(memory_gib=get_gpu("custom:0.02").memory_gib)
    assert fitted["best"]["step_s"] == pytest.approx(step_time(plan, gpu).total_s, rel=1e-4)
    planned = json.loads(shardfit("plan", "tiny-llama", "--gpus", "2", "--strategy", "ddp", "--device", "cpu",
                                  "--device-profile", str(path), "--json").stdout)
    assert planned["step_time_s"]["ddp"] > 0


@pytest.fixture(scope="module")
def reduced(calibrated, tmp_path_factory):
    path, _ = calibrated
    summary = oracle.run(str(path), tmp_path_factory.mktemp("oracle"), reduced=True, progress=lambda *a, **k: None)
    print(oracle.report(summary))
    return summary


def test_oracle_reduced_grid_measures_every_candidate_and_the_pick_fits(reduced):
    rows = reduced["rows"]
    assert all(r["status"] in ("ok", "oom") for r in rows), [r["error"] for r in rows if r["status"] not in ("ok", "oom")]
    assert any(r["status"] == "oom" for r in rows) and reduced["measured_ok"] >= 3  # the budget bites
    assert reduced["pick_within_budget"]  # fit's pick, measured, stays under the budget
    assert all(r["measured_peak"] <= oracle.BUDGET_BYTES for r in rows if r["status"] == "ok")
    assert -1 <= reduced["spearman"] <= 1 and 0 < reduced["pick_throughput_ratio"] <= 1


@pytest.mark.xfail(strict=False, reason="a wall-clock ratio on 2 CPU cores that the rest of the suite shares: "
                   "reported here, held by benchmarks/bench_fit_oracle.py on a quiet machine (docs/fit.md, the oracle)")
def test_oracle_reduced_grid_pick_reaches_the_throughput_bar(reduced):
    assert reduced["pick_throughput_ratio"] >= oracle.PICK_BAR, oracle.report(reduced)


def test_verify_corrects_the_step_time_under_the_profile(calibrated, tmp_path):
    path, _ = calibrated
    fitted = json.loads(shardfit("fit", "tiny-llama", "--cpu", "--gpu", "custom:0.02", "--gpus", "2", "--seq", "64",
                                 "--global-batch", "8", "--precision", "fp32", "--engine", "ddp,fsdp",
                                 "--device-profile", str(path), "--verify", "--json", timeout=300, cwd=tmp_path).stdout)
    verified = fitted["verify"]
    assert verified["measured_step_s"] > 0 and verified["predicted_step_s"] > 0
    ratio = verified["time_ratio"]
    assert ratio == pytest.approx(verified["measured_step_s"] / verified["predicted_step_s"])
    corrected = verified["corrected_step_s"]
    assert len(corrected) == 1 + len(fitted["alternatives"])
    assert max(corrected.values()) == pytest.approx(max(a["step_s"] for a in [fitted["best"], *fitted["alternatives"]]) * ratio,
                                                    rel=1e-3)
