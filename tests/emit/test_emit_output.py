"""`shardfit emit ... -o PATH`: where the files go. One-file formats write the file PATH names (or
their own file name inside an existing folder); several-file formats always treat PATH as a folder.
Files emit names itself are never replaced without --force; every refusal is one line and writes
nothing; every file written is one `wrote PATH` line."""
import os

import pytest

from shardfit.cli import main
from shardfit.commands.emit import OUTPUT_HELP
from shardfit.emit import FORMATS, emit
from shardfit.errors import ShardfitError
from shardfit.spec.models import load_model_spec
from shardfit.spec.plan import Cluster, Plan, Schedule, parse_strategy
from shardfit.spec.planfile import dump_plan


@pytest.fixture
def plan_path(tmp_path):
    # A chosen schedule: these tests are about where files go (placeholders: test_placeholders.py).
    plan = Plan(model=load_model_spec("tiny-llama"), strategy=parse_strategy("zero2"), cluster=Cluster(gpus_per_node=2),
                schedule=Schedule(lr=1e-4, steps=200))
    return dump_plan(plan, tmp_path / "plan.yaml")


def run(capsys, *argv):
    rc = main(["emit", *map(str, argv)])
    captured = capsys.readouterr()
    return rc, [line for line in captured.err.splitlines() if line.strip()]


def one_line_error(rc, err):
    assert rc == 2 and len(err) == 1 and err[0].startswith("shardfit: error: "), err
    return err[0]


def test_several_files_go_into_a_folder_even_with_a_file_like_name(plan_path, tmp_path, capsys):
    target = tmp_path / "launch.sh"
    rc, err = run(capsys, plan_path, "-f", "deepspeed-launcher", "-o", target)
    assert rc == 0 and target.is_dir()
    assert sorted(p.name for p in target.iterdir()) == ["hostfile", "run_deepspeed.sh"]
    assert err == [f"wrote {target / 'run_deepspeed.sh'}", f"wrote {target / 'hostfile'}"]


def test_several_files_refuse_a_regular_file(plan_path, tmp_path, capsys):
    target = tmp_path / "launch.sh"
    target.write_text("mine\n")
    line = one_line_error(*run(capsys, plan_path, "-f", "deepspeed-launcher", "-o", target))
    assert "writes 2 files (run_deepspeed.sh, hostfile)" in line and "names a folder" in line and str(target) in line
    assert target.read_text() == "mine\n" and sorted(p.name for p in tmp_path.iterdir()) == ["launch.sh", "plan.yaml"]


def test_files_in_a_folder_are_kept_unless_force(plan_path, tmp_path, capsys):
    out = tmp_path / "out"
    out.mkdir()
    (out / "hostfile").write_text("gpu-a slots=8\n")  # edited by hand after an earlier emit
    line = one_line_error(*run(capsys, plan_path, "-f", "deepspeed-launcher", "-o", out))
    assert "already holds hostfile" in line and "--force" in line and "nothing was written" in line
    assert (out / "hostfile").read_text() == "gpu-a slots=8\n" and not (out / "run_deepspeed.sh").exists()
    rc, err = run(capsys, plan_path, "-f", "deepspeed-launcher", "-o", out, "--force")
    assert rc == 0 and len(err) == 2 and (out / "hostfile").read_text() == "localhost slots=2\n"


def test_one_file_into_an_existing_folder_uses_its_own_name(plan_path, tmp_path, capsys):
    out = tmp_path / "configs"
    out.mkdir()
    rc, err = run(capsys, plan_path, "-f", "deepspeed", "-o", out)
    assert rc == 0 and err == [f"wrote {out / 'ds_config.json'}"] and (out / "ds_config.json").is_file()
    line = one_line_error(*run(capsys, plan_path, "-f", "deepspeed", "-o", out))
    assert "already holds ds_config.json" in line and "--force" in line
    assert run(capsys, plan_path, "-f", "deepspeed", "-o", out, "--force")[0] == 0


def test_one_file_named_by_the_user_is_replaced(plan_path, tmp_path, capsys):
    target = tmp_path / "ds.json"
    target.write_text("old\n")
    rc, err = run(capsys, plan_path, "-f", "deepspeed", "-o", target)  # the quickstart's rerun
    assert rc == 0 and err == [f"wrote {target}"] and target.read_text().startswith("{")


def test_a_path_ending_in_slash_is_a_folder(plan_path, tmp_path, capsys):
    rc, err = run(capsys, plan_path, "-f", "slurm", "-o", f"{tmp_path / 'new'}/")
    assert rc == 0 and (tmp_path / "new" / "train.sbatch").is_file() and len(err) == 1
    (tmp_path / "afile").write_text("x")
    line = one_line_error(*run(capsys, plan_path, "-f", "slurm", "-o", f"{tmp_path / 'afile'}/"))
    assert "names a folder" in line and (tmp_path / "afile").read_text() == "x"


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs a FIFO")
def test_a_special_file_is_never_replaced(plan_path, tmp_path, capsys):
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    line = one_line_error(*run(capsys, plan_path, "-f", "deepspeed", "-o", fifo))
    assert "not a regular file" in line and not fifo.is_file() and fifo.exists()


def test_help_names_every_several_file_format(capsys):
    """The help says which formats make -o a folder: computed here from what each format emits."""
    plans = [Plan(model=load_model_spec("tiny-llama"), strategy=parse_strategy(s)) for s in ("zero2", "fsdp2")]
    several = set()
    for name in FORMATS:
        for plan in plans:
            try:
                if len(emit(plan, name).files) > 1:
                    several.add(name)
            except ShardfitError:
                continue  # e.g. a DeepSpeed format for the FSDP plan
    assert several == {"deepspeed-launcher"}
    assert all(name in OUTPUT_HELP for name in several) and "folder" in OUTPUT_HELP and "--force" in OUTPUT_HELP
    with pytest.raises(SystemExit):
        main(["emit", "--help"])
    assert "--force" in capsys.readouterr().out
