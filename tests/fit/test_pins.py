"""fit takes plan's LoRA flags and searches with them, and pins any knob it searches (--ac, --micro-batch,
--strategy) to search only the rest; a pin that makes nothing fit is one line naming it. In-process."""
import json

import pytest

from shardfit.cli import main
from shardfit.estimate.estimator import estimate
from shardfit.spec.plan import LoRA

BASE = ["fit", "llama-3.1-8b", "--gpus", "8", "--gpu", "A100-40GB", "--seq", "4096", "--data-parallel-only"]


def run(capsys, *argv):
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def _json(capsys, *argv):
    code, out, err = run(capsys, *argv, "--json")
    assert code == 0, err
    return json.loads(out)


def test_lora_targets_are_searched_with(capsys):
    attention = _json(capsys, "fit", "llama-3.1-70b", "--gpus", "8", "--seq", "4096", "--lora-targets", "q_proj,v_proj")
    linear = _json(capsys, "fit", "llama-3.1-70b", "--gpus", "8", "--seq", "4096", "--lora-targets", "all-linear")
    assert attention["plan"]["training"]["lora"]["target_modules"] == ["q_proj", "v_proj"]
    assert linear["plan"]["training"]["lora"]["target_modules"] == ["all-linear"]
    # The targets change what is trained, hence memory: the same plan with all-linear adapters costs more.
    from shardfit.spec.planfile import plan_from_dict
    from shardfit.spec.models import model_spec_for

    plan = plan_from_dict(attention["plan"], resolve_model=model_spec_for)
    wide = plan.with_changes(training={"lora": LoRA(rank=16, alpha=32, target_modules=("all-linear",))})
    assert estimate(wide).device_peak_bytes > estimate(plan).device_peak_bytes
    code, _, err = run(capsys, "fit", "gpt2-xl", "--gpus", "1", "--lora-targets", "q_proj")
    assert code == 2 and err.count("\n") == 1 and "q_proj" in err


@pytest.mark.parametrize("flag,value,field", [("--ac", "selective", "activation_checkpointing"),
                                              ("--micro-batch", 1, "micro_batch")])
def test_a_pinned_knob_holds_for_every_plan_and_the_rest_is_searched(capsys, flag, value, field):
    free = _json(capsys, *BASE)
    doc = _json(capsys, *BASE, flag, value)
    assert free["best"][field] != value  # the pin changes the answer
    for row in [doc["best"], *doc["alternatives"]]:
        assert row[field] == value
    # The rest is still searched: several families fit with the pin, each at its own setting of the rest.
    assert len({row["family"] for row in [doc["best"], *doc["alternatives"]]}) > 1


def test_a_pinned_strategy_is_the_only_one_searched(capsys):
    doc = _json(capsys, *BASE, "--strategy", "fsdp2")
    assert doc["best"]["strategy"] == "fsdp2" and all(a["strategy"] == "fsdp2" for a in doc["alternatives"])
    assert doc["rejected"] == []
    # A strategy fit does not search on its own is searched when asked for.
    doc = _json(capsys, *BASE, "--strategy", "fsdp:no_shard", "--gpu", "H100-80GB", "--seq", "1024")
    assert doc["best"]["strategy"] == "fsdp:no_shard"


# --loss standard: the chunked loss would let micro-batch 4 fit under fsdp2 (AC full), and nothing else would
@pytest.mark.parametrize("pins,dropped", [(["--ac", "none"], "drop --ac"),
                                          (["--micro-batch", 4, "--strategy", "fsdp2", "--loss", "standard"],
                                           "drop --micro-batch")])
def test_a_pin_that_makes_nothing_fit_is_one_line(capsys, pins, dropped):
    code, out, err = run(capsys, *BASE, *pins)
    if pins[0] == "--ac":  # --ac none fits, with offload: pinning the strategy too makes nothing fit
        assert code == 0 and "offload" in json.loads(run(capsys, *BASE, *pins, "--json")[1])["best"]["strategy"]
        code, out, err = run(capsys, *BASE, *pins, "--strategy", "fsdp2")
    assert code == 2 and not out and err.count("\n") == 1, err
    assert "nothing fits with" in err and "pinned" in err and dropped in err and "fits with micro-batch" in err


@pytest.mark.parametrize("extra,message", [
    (["--micro-batch", 3], "--micro-batch 3 does not divide the 4 sequences per GPU"),
    (["--ac", "sometimes"], "every-N"),
    (["--strategy", "zero9"], "unknown strategy"),
    (["--strategy", "zero3", "--engine", "fsdp"], "leaves deepspeed out"),
    (["--strategy", "single"], "runs on one GPU"),
])
def test_bad_pins_are_one_line_errors(capsys, extra, message):
    code, out, err = run(capsys, *BASE, *extra)
    assert code == 2 and not out and err.count("\n") == 1 and message in err, err
