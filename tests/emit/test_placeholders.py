"""Emitted files never pass shardfit's placeholder schedule off as a choice (issue 19)."""
import json

from shardfit.emit import emit
from shardfit.spec.models import load_model_spec
from shardfit.spec.plan import Plan, Schedule, Strategy


def _plan(**schedule):
    return Plan(model=load_model_spec("llama-3.1-8b"), strategy=Strategy(kind="zero2"),
                schedule=Schedule(**schedule))


def test_default_schedule_is_marked_todo_in_every_text_file_and_said():
    plan = _plan()
    for fmt in ("deepspeed", "accelerate", "fsdp2", "hf-trainer", "lightning", "torchrun", "slurm"):
        if fmt == "fsdp2":
            plan_fmt = plan.with_changes(strategy=Strategy(kind="fsdp2"))
        else:
            plan_fmt = plan
        out = emit(plan_fmt, fmt)
        assert any(n.startswith("TODO(set me): learning rate 0.0003 and a 50-step cosine") for n in out.notes), fmt
        for name, text in out.files.items():
            if name.endswith(".json"):
                json.loads(text)  # JSON has no comments: still loadable, the note says it
            elif name != "hostfile":
                assert "# TODO(set me): learning rate 0.0003" in text.splitlines()[0 if not text.startswith("#!") else 1]


def test_a_chosen_schedule_is_written_as_is_without_todo():
    out = emit(_plan(lr=1e-5, steps=2000, warmup_steps=100), "deepspeed")
    assert not any("TODO" in n for n in out.notes) and "TODO" not in out.main
    config = json.loads(out.main)
    assert config["optimizer"]["params"]["lr"] == 1e-5
    assert config["scheduler"]["params"]["total_num_steps"] == 2000
    # Only the length chosen: the learning rate is still flagged.
    out = emit(_plan(steps=2000), "deepspeed")
    assert any(n.startswith("TODO(set me): learning rate 0.0003 are") for n in out.notes)
