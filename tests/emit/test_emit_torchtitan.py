"""emit --format torchtitan: the torchrun line for torchtitan 0.3.0, parsed by torchtitan's own loader
(ConfigManager over the config_registry function, then ParallelDims for the world), and the one-line
refusals where torchtitan cannot run the plan."""
from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from dataclasses import asdict
from pathlib import Path

import pytest

from shardfit.emit import emit
from shardfit.emit.torchtitan import TITAN_MODELS, titan_model, torchtitan_args
from shardfit.errors import ShardfitError
from shardfit.fit import FitRequest, fit
from shardfit.spec.models import load_model_spec
from shardfit.spec.parallelism import Parallelism, chunk_layers, resolve
from shardfit.spec.plan import LoRA, Plan, Strategy

ROOT = Path(__file__).resolve().parents[2]
LOADER = ROOT / ".venv" / "torchtitan-loader"
QWEN3_1_7B = {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": 2048,
              "intermediate_size": 6144, "num_hidden_layers": 28, "num_attention_heads": 16, "num_key_value_heads": 8,
              "head_dim": 128, "vocab_size": 151936, "max_position_embeddings": 40960, "tie_word_embeddings": True,
              "rms_norm_eps": 1e-6, "rope_theta": 1000000}


def _plan(model="llama-3.1-8b", nodes=1, gpus=8, strategy=None, parallelism=None, **training):
    setup = {"micro_batch": 2, "grad_accum": 4, "seq_len": 4096, "activation_checkpointing": "full", **training}
    return Plan(model=model if not isinstance(model, str) else load_model_spec(model)).with_changes(
        strategy=strategy or Strategy(kind="fsdp2"), cluster={"nodes": nodes, "gpus_per_node": gpus},
        training=setup, parallelism=parallelism or Parallelism())


def _script_args(plan) -> tuple[list[str], list[str]]:
    """(torchrun's own options, the arguments after -m torchtitan.train), read back from the script."""
    text = emit(plan, "torchtitan").files["run_torchtitan.sh"]
    command = next(line for line in text.replace("\\\n", " ").splitlines() if line.startswith("torchrun"))
    words = shlex.split(command)
    cut = words.index("torchtitan.train")
    return words[1:cut - 1], words[cut + 1:]


def _cases():
    """Plans across the layouts torchtitan composes, with what the loader must make of them."""
    pp_plan = _plan("llama-3.1-70b", nodes=4, parallelism=Parallelism(tp=8, sequence_parallel=True, pp=4,
                                                                        pp_schedule="interleaved", pp_virtual_stages=2))
    return {
        "fsdp2 tp2+sp": _plan(parallelism=Parallelism(tp=2, sequence_parallel=True)),
        "hsdp cp2 selective": _plan(strategy=Strategy(kind="fsdp2", sharding="hybrid_shard"), nodes=2,
                                    parallelism=Parallelism(cp=2), activation_checkpointing="selective"),
        "70b tp8 pp4 interleaved": pp_plan,
        "ddp bf16 no ac": _plan(strategy=Strategy(kind="ddp"), gpus=4, activation_checkpointing="none"),
        "single pure bf16": _plan(strategy=Strategy(kind="single"), gpus=1, precision="bf16-pure"),
        "offload fp32 chunked": _plan(strategy=Strategy(kind="fsdp2", offload_params="cpu", reshard_after_forward=False),
                                      precision="fp32", loss="chunked", loss_chunks=4, optimizer_impl="single"),
    }


def _expected(plan) -> dict:
    layout, t = resolve(plan), plan.training
    m = layout.microbatches if layout.pp > 1 else 1
    return {"dims": {"dp_replicate": layout.dp_replicate, "dp_shard": layout.dp_shard, "cp": layout.cp,
                     "tp": layout.tp, "pp": layout.pp, "ep": layout.ep},
            "local_batch_size": t.micro_batch * m, "global_batch_size": plan.global_batch, "seq_len": t.seq_len,
            "sequence_parallel": layout.sequence_parallel}


def test_every_layout_keeps_its_degrees_batch_and_split():
    for name, plan in _cases().items():
        _, args = _script_args(plan)
        assert args == torchtitan_args(plan)[0], name  # the script carries exactly the argument list
        value = dict(zip(args, args[1:]))
        layout = resolve(plan)
        assert int(value["--parallelism.data_parallel_shard_degree"]) * int(
            value["--parallelism.data_parallel_replicate_degree"]) * layout.tp * layout.cp * layout.pp == \
            plan.cluster.world_size, name
        assert args[-1].startswith("activation-checkpoint:"), name  # tyro's subcommand last
    pp_args = torchtitan_args(_cases()["70b tp8 pp4 interleaved"])[0]
    start = pp_args.index("--parallelism.module_fqns_per_model_part") + 1
    parts = pp_args[start:start + 8]
    assert [len([n for n in p.split(",") if n.startswith("layers.")]) for p in parts] == list(chunk_layers(80, 8))
    assert parts[0].startswith("tok_embeddings,layers.0,") and parts[-1].endswith("layers.79,norm,lm_head")


def test_the_model_is_matched_on_its_shape_not_its_name(tmp_path):
    assert titan_model(load_model_spec("llama-3.1-70b")).config == "llama3_70b"
    assert titan_model(load_model_spec("llama-3.1-405b")).config == "llama3_405b"
    path = tmp_path / "config.json"
    path.write_text(json.dumps(QWEN3_1_7B))
    assert titan_model(load_model_spec(str(path))).config == "qwen3_1_7b"
    path.write_text(json.dumps({**QWEN3_1_7B, "num_hidden_layers": 27}))
    with pytest.raises(ShardfitError, match="none has .* shape .*27 layers"):
        titan_model(load_model_spec(str(path)))


@pytest.mark.parametrize("change,match", [
    ({"strategy": Strategy(kind="zero3")}, "FSDP2 only, not zero3"),
    ({"strategy": Strategy(kind="fsdp")}, "FSDP2 only"),
    ({"training": {"precision": "fp16"}}, "not fp16"),
    ({"training": {"optimizer": "adamw8bit"}}, "not adamw8bit"),
    ({"training": {"lora": LoRA(rank=8)}}, "not LoRA"),
    ({"model": "tiny-llama"}, "none has tiny-llama's shape"),
    ({"training": {"grad_accum": 6}, "parallelism": Parallelism(pp=2, pp_microbatches=4)}, "multiple of"),
])
def test_what_torchtitan_cannot_run_is_one_line(change, match):
    plan = _plan(change.pop("model", "llama-3.1-8b"))
    if change:
        plan = plan.with_changes(**change)
    with pytest.raises(ShardfitError, match=match) as caught:
        emit(plan, "torchtitan")
    assert "\n" not in str(caught.value)


def test_every_n_checkpointing_is_written_as_full_with_a_note():
    args, notes = torchtitan_args(_plan(activation_checkpointing="every-2"))
    assert args[-1] == "activation-checkpoint:full"
    assert any("not every 2-th block" in note for note in notes)


def test_fits_405b_pick_on_64_nodes_is_written_for_torchtitan():
    result = fit(FitRequest.build(load_model_spec("llama-3.1-405b"), gpu="H100-80GB", gpus_per_node=8, nodes=64,
                                  seq_len=8192))
    plan = result.best.plan
    launch, args = _script_args(plan)
    assert launch[:4] == ["--nnodes", "64", "--nproc-per-node", "8"]
    value = dict(zip(args, args[1:]))
    assert value["--config"] == "llama3_405b"
    assert int(value["--parallelism.tensor_parallel_degree"]) == resolve(plan).tp
    assert any("Float8Linear" in note for note in emit(plan, "torchtitan").notes)


def _parse_with_torchtitan(cases: list[dict], tmp_path) -> list[dict]:
    if not (LOADER / ".stamp").exists():
        if os.environ.get("CI"):
            pytest.fail("torchtitan's loader is missing: scripts/torchtitan-loader.sh did not install it")
        pytest.skip("torchtitan's loader is not installed: run bash scripts/torchtitan-loader.sh")
    (tmp_path / "cases.json").write_text(json.dumps(cases))
    env = {**os.environ, "PYTHONPATH": str(LOADER)}
    proc = subprocess.run([sys.executable, str(Path(__file__).with_name("torchtitan_parse.py")),
                           str(tmp_path / "cases.json"), str(tmp_path / "out.json")],
                          env=env, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads((tmp_path / "out.json").read_text())


# torchtitan 0.3.0's llama3_405b config builds Float8Linear at load (torchao on an SM89+ GPU), so on CPU its
# lines are parsed against llama3_70b's config: the same Trainer.Config fields, another registry entry.
_CPU_CONFIG = {"llama3_405b": "llama3_70b"}


@pytest.mark.slow
def test_torchtitans_own_loader_accepts_every_emitted_line_and_reads_the_plan_back(tmp_path):
    plans = dict(_cases())
    plans["fit 405b"] = fit(FitRequest.build(load_model_spec("llama-3.1-405b"), gpu="H100-80GB", gpus_per_node=8,
                                             nodes=64, seq_len=8192)).best.plan
    cases = []
    for plan in plans.values():
        args = _script_args(plan)[1]
        at = args.index("--config") + 1
        args[at] = _CPU_CONFIG.get(args[at], args[at])
        cases.append({"world": plan.cluster.world_size, "args": args})
    # Controls: the loader does reject what it should (a misspelt field; degrees that miss the world).
    cases.append({"world": 8, "args": ["--module", "llama3", "--config", "llama3_8b", "--parallelism.tensor_degree", "2"]})
    cases.append({"world": 6, "args": cases[0]["args"]})
    rows = [{"module": m.module, "config": m.config} for m in TITAN_MODELS if m.config not in _CPU_CONFIG]
    cases += [{"world": None, "args": ["--module", r["module"], "--config", r["config"]]} for r in rows]
    results = _parse_with_torchtitan(cases, tmp_path)

    for (name, plan), result in zip(plans.items(), results):
        assert result["ok"], f"{name}: {result['error']}"
        want, t = _expected(plan), plan.training
        assert result["dims"] == want["dims"], name
        got = result["training"]
        assert (got["local_batch_size"], got["global_batch_size"], got["seq_len"]) == (
            want["local_batch_size"], want["global_batch_size"], want["seq_len"]), name
        assert got["steps"] == plan.schedule.steps and got["max_norm"] == plan.schedule.grad_clip, name
        assert result["parallelism"]["sequence_parallel"] == want["sequence_parallel"], name
        assert got["param"] == ("bfloat16" if t.precision == "bf16" else "float32"), name
        assert got["dtype"] == ("bfloat16" if t.precision == "bf16-pure" else "float32"), name
        assert got["cpu_offload"] == bool(plan.strategy.offload_params), name
        ac = t.activation_checkpointing
        assert result["ac"] == {"none": None, "full": "FullAC", "selective": "SelectiveAC"}[ac], name
        if resolve(plan).pp > 1:
            parts = result["parallelism"]["parts"]
            assert sum(len([n for n in p if n.startswith("layers.")]) for p in parts) == plan.model.num_layers
            assert result["parallelism"]["microbatch_size"] == t.micro_batch
            assert result["parallelism"]["schedule"] == "Interleaved1F1B"
    offload = results[list(plans).index("offload fp32 chunked")]
    assert (offload["loss_chunks"], offload["optimizer"], offload["parallelism"]["reshard"]) == (4, "for-loop", "never")
    misspelt, wrong_world = results[len(plans)], results[len(plans) + 1]
    assert not misspelt["ok"] and "tensor_degree" in misspelt["error"].replace("-", "_")
    assert not wrong_world["ok"] and "WORLD_SIZE(6)" in wrong_world["error"]

    # Every TITAN_MODELS row is the architecture torchtitan's registry builds for that config.
    for row, result in zip(rows, results[len(plans) + 2:]):
        assert result["ok"], f"{row['config']}: {result['error']}"
        model = next(m for m in TITAN_MODELS if m.config == row["config"])
        recorded = {k: v for k, v in asdict(model).items() if k in result["model"]}
        assert result["model"] == recorded, row["config"]


def test_zero_bubble_schedules_keep_torchs_names_and_the_model_order_split():
    for schedule, name in (("zero-bubble", "InterleavedZeroBubble"), ("zbv", "ZBVZeroBubble"), ("dualpipev", "DualPipeV")):
        virtual = 1 if schedule == "zero-bubble" else 2
        plan = _plan("llama-3.1-70b", nodes=4, grad_accum=16, parallelism=Parallelism(
            tp=8, pp=4, pp_schedule=schedule, pp_virtual_stages=virtual))
        args = torchtitan_args(plan)[0]
        assert args[args.index("--parallelism.pipeline_parallel_schedule") + 1] == name
        start = args.index("--parallelism.module_fqns_per_model_part") + 1
        parts = args[start:start + 4 * virtual]  # model order: torchtitan places them in the schedule's V itself
        assert parts[0].startswith("tok_embeddings,layers.0,") and parts[-1].endswith("layers.79,norm,lm_head")
