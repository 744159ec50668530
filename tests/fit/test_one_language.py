"""fit and plan speak one language: every strategy label fit can print is one plan accepts, LoRA
targets come from the model's own linears, one LoRA rule for both commands, and every "nothing fits"
suggestion states its host RAM. In-process (cli.main): no torch, no subprocess per label."""
import json

import pytest

from shardfit import cli
from shardfit.estimate import estimate
from shardfit.fit import FitRequest, fit
from shardfit.fit.families import NVME_PLACEHOLDER, families
from shardfit.spec.models import load_model_spec
from shardfit.spec.plan import Plan, parse_strategy

CLUSTERS = [(1, 1), (1, 8), (2, 8), (4, 2)]  # (nodes, GPUs per node): single-GPU, one node, hybrid meshes


def run(capsys, *argv):
    code = cli.main([str(a) for a in argv])
    out = capsys.readouterr()
    return code, out.out, out.err


@pytest.mark.parametrize("nodes,per_node", CLUSTERS)
def test_every_label_fit_can_print_is_accepted_by_plan(capsys, nodes, per_node):
    model = load_model_spec("llama-3.1-8b")
    for fam in families(per_node, nodes, model.hidden_size, NVME_PLACEHOLDER):
        assert fam.strategy.label == fam.label  # the family's name is its strategy's label
        parsed = parse_strategy(fam.label)
        assert parsed.label == fam.label
        plan = Plan(model=model).with_changes(cluster={"nodes": nodes, "gpus_per_node": per_node})
        # plan --strategy LABEL gives the same numbers fit compared with the budget.
        ours = estimate(plan.with_changes(strategy=fam.strategy))
        theirs = estimate(plan.with_changes(strategy=parse_strategy(fam.label) if "nvme" not in fam.label else
                                            fam.strategy))
        assert theirs.device_peak_bytes == ours.device_peak_bytes, fam.label
        argv = ["plan", "llama-3.1-8b", "--gpus", nodes * per_node, "--nodes", nodes, "--strategy", fam.label, "--json"]
        if "nvme" in fam.label:
            argv += ["--nvme-path", NVME_PLACEHOLDER]
        code, out, err = run(capsys, *argv)
        assert code == 0, (fam.label, err)
        row = json.loads(out)["strategies"][0]
        assert row["strategy"] == fam.label


def test_fsdp2_hybrid_shards_inside_a_node():
    plan = Plan(model=load_model_spec("llama-3.1-8b")).with_changes(cluster={"nodes": 2, "gpus_per_node": 8})
    hybrid = estimate(plan.with_changes(strategy=parse_strategy("fsdp2:hybrid")))
    full = estimate(plan.with_changes(strategy=parse_strategy("fsdp2")))
    assert hybrid.phases["load"]["params"] == pytest.approx(2 * full.phases["load"]["params"], rel=0.01)


@pytest.mark.parametrize("model,gpu,seq,targets", [("gpt2-xl", "custom:0.5", 1024, "c_attn"),
                                                   ("bert-large", "custom:0.25", 512, "query,key,value")])
def test_nothing_fits_suggests_lora_on_the_models_own_linears(capsys, model, gpu, seq, targets):
    code, out, err = run(capsys, "fit", model, "--gpu", gpu, "--gpus", 1, "--seq", seq)
    assert code == 1 and not err, err  # "nothing fits", not a LoRA-target error
    assert "NOTHING FITS" in out and f"(adapts {targets})" in out
    code, out, err = run(capsys, "fit", model, "--gpu", "H100-80GB", "--gpus", 1, "--seq", seq, "--lora-r", 8)
    assert code == 0, err
    assert f"LoRA r=8, targets {targets}, bf16 base (targets, base: default)" in out


def test_one_lora_rule_for_fit_and_plan(capsys):
    """A quantized base alone means QLoRA at the default rank, in both commands, and says so."""
    code, out, _ = run(capsys, "fit", "llama-3.1-8b", "--gpu", "RTX-4090", "--gpus", 1, "--lora-base", "nf4")
    assert "LoRA r=16 (nf4 base)" in out.splitlines()[0]
    assert "note: QLoRA r=16, targets q_proj,k_proj,v_proj,o_proj, nf4 base (rank, targets: default)" in out
    code, out, _ = run(capsys, "plan", "llama-3.1-8b", "--gpus", 1, "--lora-base", "nf4", "--strategy", "ddp")
    assert code == 0 and "LoRA r=16 on q_proj,k_proj,v_proj,o_proj (base nf4)" in out
    assert "note: QLoRA r=16" in out
    # The old spelling still works (a deprecated alias, listed in --help).
    code, out2, err = run(capsys, "plan", "llama-3.1-8b", "--gpus", 1, "--lora-base-dtype", "nf4", "--strategy", "ddp")
    assert code == 0 and out2 == out and not err
    code, _, err = run(capsys, "fit", "llama-3.1-8b", "--lora-r", 0)
    assert code == 2 and "--lora-r must be at least 1" in err


def test_every_suggestion_states_host_ram_and_lora_and_8bit_are_offered():
    result = fit(FitRequest.build(model=load_model_spec("llama-3.1-405b"), gpu="T4", gpus_per_node=1))
    assert result.best is None
    levers = result.suggestions[1:]
    assert all("host RAM" in s for s in levers), levers
    by_lever = {s.split(":")[0]: s for s in levers}
    assert {"LoRA", "QLoRA", "8-bit AdamW", "shorter sequence"} <= set(by_lever)
    assert "--optimizer adamw8bit" in by_lever["8-bit AdamW"] and "GiB per GPU" in by_lever["8-bit AdamW"]
    # The case: the shorter sequence fits the GPU only with terabytes of host RAM: flagged.
    assert "--seq 512" in by_lever["shorter sequence"] and "ABOVE the 64 GiB assumed" in by_lever["shorter sequence"]
    assert any("host RAM assumed 64 GiB per node" in n for n in result.notes)


def test_plans_beyond_the_assumed_host_ram_are_flagged_not_recommended():
    model = load_model_spec("llama-3.1-70b")
    result = fit(FitRequest.build(model=model, gpu="A100-80GB", gpus_per_node=1, seq_len=1024, global_batch=1))
    assert result.best is not None and "offload" in result.best.family
    assert result.best.host_bytes > 64 * 1024**3 * 2  # 70B's states do not fit a 160 GiB host
    assert any(n.startswith("WARNING: the best plan needs host RAM") and "ABOVE" in n for n in result.notes)
    # Given the host RAM, the same plan is rejected instead.
    limited = fit(FitRequest.build(model=model, gpu="A100-80GB", gpus_per_node=1, seq_len=1024, global_batch=1,
                                   host_memory_gib=160))
    assert limited.best is None or limited.best.host_bytes <= 160 * 1024**3
