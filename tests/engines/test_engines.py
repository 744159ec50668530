"""Every engine on 2 real CPU ranks (gloo), through the real training loop.

One torchrun launch runs the whole matrix (launches cost 6-15 s each on CPU); the tests assert on
its JSON results. Single-process launches before and after it give the 1-process reference, DCP
1 -> 2 and 2 -> 1, and DeepSpeed -> DCP conversions.
"""
from __future__ import annotations

import json
import math

import pytest
import launch

from jobs import ENGINES, STEPS, matrix_jobs, reference_jobs, single_rank_jobs

pytestmark = [pytest.mark.multirank, pytest.mark.deepspeed, pytest.mark.slow]
WORKER = "tests/engines/worker.py"


def _launch(tmp, name, jobs, nproc):
    spec, result = tmp / f"{name}.json", tmp / f"{name}-result.json"
    spec.write_text(json.dumps(jobs))
    launch.torchrun([WORKER, str(spec), str(result)], nproc=nproc, timeout=1200, env=launch.test_env())
    return json.loads(result.read_text())


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("engines")
    root = str(tmp / "matrix")
    results = _launch(tmp, "reference", reference_jobs(str(tmp / "reference")), nproc=1)
    results.update(_launch(tmp, "matrix", matrix_jobs(root, str(tmp / "reference")), nproc=2))
    from shardfit.train.convert import deepspeed_to_dcp

    for stage in ("zero2", "zero3"):  # DeepSpeed -> DCP, resumed below by DDP / FSDP2 on one rank
        if results[f"{stage}-fp32-none"]["ok"]:
            deepspeed_to_dcp(tmp / "matrix" / stage / "checkpoints" / "step-2", tmp / f"{stage}-as-dcp")
    results.update(_launch(tmp, "single", single_rank_jobs(str(tmp / "single"), root), nproc=1))
    return {"results": results, "root": tmp / "matrix"}


def _ok(runs, name):
    result = runs["results"][name]
    assert result["ok"], f"{name}: {result.get('error')}\n{result.get('trace', '')}"
    return result


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("precision,ac", [("fp32", "none"), ("fp32", "full"), ("bf16", "none"), ("bf16", "full")])
def test_loss_finite_and_decreasing(runs, engine, precision, ac):
    losses = _ok(runs, f"{engine}-{precision}-{ac}")["losses"]
    assert len(losses) == STEPS and all(math.isfinite(x) for x in losses)
    assert losses[-1] < losses[0] - 0.1, losses


@pytest.mark.parametrize("engine", ENGINES)
def test_activation_checkpointing_recomputes_and_keeps_the_math(runs, engine):
    plain, ac = _ok(runs, f"{engine}-fp32-none"), _ok(runs, f"{engine}-fp32-full")
    assert plain["losses"] == pytest.approx(ac["losses"], rel=1e-5)
    # A block's MLP runs once per step without AC, twice with it (forward, then recompute in backward).
    assert (plain["mlp_calls"], ac["mlp_calls"]) == (1, 2)


def test_fp32_losses_agree_across_engines_and_with_one_process(runs):
    reference = _ok(runs, "single-ddp-accum2")["losses"]
    for engine in ENGINES:
        assert _ok(runs, f"{engine}-fp32-none")["losses"] == pytest.approx(reference, rel=1e-4), engine


def test_ddp_fsdp_fsdp2_bit_identical_first_steps(runs):
    # Same arithmetic until clipping reorders a reduction: the first two steps match exactly.
    first = [_ok(runs, f"{e}-fp32-none")["losses"][:2] for e in ("ddp", "fsdp", "fsdp2")]
    assert first[0] == first[1] == first[2]


@pytest.mark.parametrize("engine", ENGINES)
def test_resume_is_bit_identical(runs, engine):
    full = _ok(runs, f"{engine}-fp32-none")
    resumed = _ok(runs, f"{engine}-resume")
    assert resumed["steps"] == list(range(3, STEPS + 1))
    assert resumed["losses"] == full["losses"][2:]  # exact equality: bit for bit
    evals = [r for r in full["records"] if "val_loss" in r]
    assert [r["step"] for r in evals] == [2, 4] and all(len(r["sample_ids"]) > 0 for r in evals)
    # The step-4 evaluation sees the same weights in both runs.
    again = next(r for r in resumed["records"] if "val_loss" in r)
    assert (again["val_loss"], again["sample_ids"]) == (evals[1]["val_loss"], evals[1]["sample_ids"])


def test_dcp_checkpoint_from_one_rank_resumes_on_two(runs):
    single = _ok(runs, "single-ddp-accum2")["losses"]
    resumed = _ok(runs, "fsdp2-1to2")
    assert resumed["steps"] == list(range(3, STEPS + 1))
    assert resumed["losses"] == pytest.approx(single[2:], rel=1e-5)


def test_dcp_checkpoint_resumes_on_one_rank(runs):
    # fsdp2 on 2 ranks saved step 2; one rank accumulating both micro-batches continues the same run.
    full = _ok(runs, "fsdp2-fp32-none")["losses"]
    for name in ("fsdp2-2to1", "ddp-from-fsdp2-2to1"):
        resumed = _ok(runs, name)
        assert resumed["steps"] == list(range(3, STEPS + 1))
        assert resumed["losses"] == pytest.approx(full[2:], rel=1e-5), name


def test_single_engine_is_the_one_process_math_without_a_wrapper(runs):
    # One process accumulating both micro-batches: DDP over a group of one changes no gradient bit.
    reference = _ok(runs, "single-ddp-accum2")["losses"]
    full = _ok(runs, "single-fp32-none")
    assert full["losses"] == reference
    assert _ok(runs, "single-fp32-full")["losses"] == pytest.approx(full["losses"], rel=1e-5)
    assert (full["mlp_calls"], _ok(runs, "single-fp32-full")["mlp_calls"]) == (1, 2)
    for name in ("single-bf16-full", "single-fp16"):
        losses = _ok(runs, name)["losses"]
        assert len(losses) == STEPS and all(math.isfinite(x) for x in losses) and losses[-1] < losses[0] - 0.1, name


def test_single_engine_resumes_bit_identically(runs):
    full = _ok(runs, "single-fp32-none")
    resumed = _ok(runs, "single-resume")
    assert resumed["steps"] == list(range(3, STEPS + 1))
    assert resumed["losses"] == full["losses"][2:]  # exact equality: bit for bit
    evals = [r for r in full["records"] if "val_loss" in r]
    again = next(r for r in resumed["records"] if "val_loss" in r)
    assert (again["val_loss"], again["sample_ids"]) == (evals[1]["val_loss"], evals[1]["sample_ids"])
    step = runs["root"].parent / "reference" / "single-engine" / "checkpoints" / "step-4"
    manifest = json.loads((step / "manifest.json").read_text())
    assert (manifest["engine"], manifest["format"], manifest["world_size"]) == ("single", "dcp", 1)


def test_single_engine_resumes_a_two_rank_fsdp2_checkpoint(runs):
    full = _ok(runs, "fsdp2-fp32-none")["losses"]
    resumed = _ok(runs, "single-from-fsdp2-2to1")
    assert resumed["steps"] == list(range(3, STEPS + 1))
    assert resumed["losses"] == pytest.approx(full[2:], rel=1e-5)


def test_single_engine_export_loads_in_transformers(runs):
    import torch
    from transformers import AutoModelForCausalLM

    from shardfit.train.generate import greedy
    from worker import PROBE

    result = _ok(runs, "single-fp32-none")
    model = AutoModelForCausalLM.from_pretrained(str(runs["root"].parent / "reference" / "single-engine-hf")).eval()
    with torch.no_grad():
        logits = model(input_ids=torch.tensor(PROBE)).logits.float()[0, -3:, :8]
        assert torch.allclose(logits, torch.tensor(result["logits"]), atol=1e-5)
        assert greedy(model, [256, *"In the morning".encode()], 12, "cpu", eos_id=257) == result["generated"]


def test_checkpoints_are_complete_and_pruned(runs):
    folders = sorted(p.name for p in (runs["root"] / "fsdp2" / "checkpoints").iterdir())
    assert folders == ["step-2", "step-4", "step-5"]  # keep 3; the final step is always saved
    step = runs["root"] / "fsdp2" / "checkpoints" / "step-4"
    manifest = json.loads((step / "manifest.json").read_text())
    assert manifest["step"] == 4 and manifest["world_size"] == 2 and manifest["format"] == "dcp"
    assert sorted(p.name for p in (step / "rng").iterdir()) == ["rank-0.pt", "rank-1.pt"]
    assert (step / "plan.yaml").read_text().startswith("model:")
    ds = runs["root"] / "zero3" / "checkpoints" / "step-4"
    assert json.loads((ds / "manifest.json").read_text())["format"] == "deepspeed" and (ds / "deepspeed" / "ds").is_dir()


@pytest.mark.parametrize("engine", ENGINES)
def test_export_loads_in_transformers_with_same_logits_and_generation(runs, engine):
    import torch
    from transformers import AutoModelForCausalLM

    from shardfit.train.generate import greedy
    from worker import PROBE

    result = _ok(runs, f"{engine}-fp32-none")
    model = AutoModelForCausalLM.from_pretrained(str(runs["root"] / f"{engine}-hf")).eval()
    with torch.no_grad():
        logits = model(input_ids=torch.tensor(PROBE)).logits.float()[0, -3:, :8]
        assert torch.allclose(logits, torch.tensor(result["logits"]), atol=1e-5)
        prompt = [256, *"In the morning".encode()]
        assert greedy(model, prompt, 12, "cpu", eos_id=257) == result["generated"]


@pytest.mark.parametrize("name", ["ddp-accum2", "fsdp2-accum2", "zero2-accum2", "fsdp-hybrid", "fsdp2-hsdp",
                                  "fsdp2-offload", "ddp-fp16", "fsdp2-fp16",
                                  "zero2-offload", "zero3-offload"])
def test_other_configurations_train(runs, name):
    losses = _ok(runs, name)["losses"]
    assert all(math.isfinite(x) for x in losses) and losses[-1] < losses[0], losses


def test_hybrid_layouts_match_plain_data_parallel(runs):
    # HSDP (2 replicas x 1 shard) and FSDP1 hybrid (1 x 2) are the same math as plain FSDP2.
    reference = _ok(runs, "fsdp2-fp32-none")["losses"]
    assert _ok(runs, "fsdp2-hsdp")["losses"] == pytest.approx(reference, rel=1e-5)
    assert _ok(runs, "fsdp-hybrid")["losses"] == pytest.approx(reference, rel=1e-5)
    assert _ok(runs, "fsdp2-offload")["losses"] == pytest.approx(reference, rel=1e-5)


def test_accumulation_matches_across_engines(runs):
    ddp = _ok(runs, "ddp-accum2")["losses"]
    assert _ok(runs, "fsdp2-accum2")["losses"] == pytest.approx(ddp, rel=1e-4)
    assert _ok(runs, "zero2-accum2")["losses"] == pytest.approx(ddp, rel=1e-4)


def test_deepspeed_offload_resume_is_bit_identical(runs):
    full = _ok(runs, "zero3-offload")["losses"]
    assert _ok(runs, "zero3-offload-resume")["losses"] == full[2:]
    assert full == pytest.approx(_ok(runs, "zero3-fp32-none")["losses"], rel=1e-5)


def test_nan_loss_stops_or_skips(runs):
    stopped = runs["results"]["ddp-nan-stop"]
    assert not stopped["ok"] and "ShardfitError: loss is" in stopped["error"], stopped
    skipped = _ok(runs, "ddp-nan-skip")["records"]
    assert len(skipped) == 4 and skipped[0]["skipped"] is False
    assert any(r["skipped"] for r in skipped[1:]) and all(math.isfinite(r["loss"]) or r["skipped"] for r in skipped)


@pytest.mark.parametrize("engine", ["fsdp", "zero3"])
def test_export_from_checkpoint_equals_live_export(runs, engine, tmp_path):
    """`shardfit export` of the final checkpoint (DCP read key by key / DeepSpeed zero_to_fp32) gives
    the same tensors as the live, gathered export of the same step."""
    from safetensors.torch import load_file

    from shardfit.train.export import export_checkpoint

    files = export_checkpoint(runs["root"] / engine / "checkpoints" / f"step-{STEPS}", tmp_path, max_shard_bytes=60_000)
    assert len(files) > 1 and (tmp_path / "model.safetensors.index.json").is_file()  # sharded on purpose
    offline = {k: v for f in files for k, v in load_file(str(f)).items()}
    live = load_file(str(runs["root"] / f"{engine}-hf" / "model.safetensors"))
    assert offline.keys() == live.keys()
    for name in live:
        assert offline[name].equal(live[name]), name


@pytest.mark.parametrize("stage,engine", [("zero2", "fsdp2"), ("zero3", "ddp")])
def test_deepspeed_checkpoint_converts_to_dcp_and_resumes(runs, stage, engine):
    """Model, AdamW moments, scheduler, data position and RNG survive ZeRO -> DCP: the run continues
    on another engine and one rank with the same losses."""
    full = _ok(runs, f"{stage}-fp32-none")["losses"]
    resumed = _ok(runs, f"{engine}-from-{stage}")
    assert resumed["steps"] == list(range(3, STEPS + 1))
    assert resumed["losses"] == pytest.approx(full[2:], rel=1e-6)


def test_training_starts_from_an_exported_model_folder(runs):
    fresh = _ok(runs, "ddp-fp32-none")["losses"]
    tuned = _ok(runs, "finetune-from-export")["losses"]
    # Same first batch; the exported (trained) weights already predict it far better than fresh ones.
    assert tuned[0] < fresh[0] - 0.5 and tuned[0] == pytest.approx(fresh[-1], abs=0.3)


def test_lora_trains_the_same_under_every_engine(runs):
    reference = _ok(runs, "fsdp-lora")["losses"]
    assert reference[-1] < reference[0] - 0.2
    for engine in ("ddp", "fsdp2", "zero3"):
        assert _ok(runs, f"{engine}-lora")["losses"] == pytest.approx(reference, rel=1e-5), engine


@pytest.mark.parametrize("stage", ["zero1", "zero2", "zero3"])
def test_deepspeed_resumes_from_a_dcp_checkpoint(runs, stage):
    """FSDP2 -> ZeRO mid-run: weights, AdamW moments and step count, scheduler, data position and RNG
    carry over (step 4's loss depends on the moments: zero moments would change it)."""
    full = _ok(runs, "fsdp2-fp32-none")["losses"]
    resumed = _ok(runs, f"{stage}-from-fsdp2")
    assert resumed["steps"] == list(range(3, STEPS + 1))
    assert resumed["losses"] == pytest.approx(full[2:], rel=1e-6)


@pytest.mark.parametrize("engine", ["ddp", "fsdp", "fsdp2", "zero3"])
def test_lora_export_merges_adapters(runs, engine, tmp_path):
    """The exported folder is a plain model (adapters folded in) with the peft model's logits, from
    the live engine and from the checkpoint alike."""
    import torch
    from transformers import AutoModelForCausalLM

    from shardfit.train.export import export_checkpoint
    from worker import PROBE

    result = _ok(runs, f"{engine}-lora")
    export_checkpoint(runs["root"] / f"{engine}-lora" / "checkpoints" / f"step-{STEPS}", tmp_path)
    for folder in (runs["root"] / f"{engine}-lora-hf", tmp_path):
        model = AutoModelForCausalLM.from_pretrained(str(folder)).eval()
        assert not any("lora" in name for name, _ in model.named_parameters())
        with torch.no_grad():
            logits = model(input_ids=torch.tensor(PROBE)).logits.float()[0, -3:, :8]
        assert torch.allclose(logits, torch.tensor(result["logits"]), atol=1e-5), folder
