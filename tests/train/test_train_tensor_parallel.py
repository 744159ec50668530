"""`shardfit train` under FSDP2 x TP: 4 CPU ranks on a 2 x 2 (dp, tp) mesh train the same steps as
2-rank data-parallel FSDP2 (the TP group reads one batch, the loss and tokens count it once), its
DCP checkpoint resumes on 2 ranks without TP, and its export is the data-parallel run's model."""
from __future__ import annotations

import pytest
from launch import run_losses, run_records, shardfit

pytest.importorskip("torch")
pytestmark = [pytest.mark.multirank, pytest.mark.slow]

COMMON = ("--strategy", "fsdp2", "--steps", "4", "--seq", "64", "--micro-batch", "2", "--lr", "3e-3",
          "--save-every", "2", "--keep", "3", "--eval-every", "4", "--no-progress")


def test_tensor_parallel_trains_resumes_on_another_mesh_and_exports(tmp_path):
    import torch
    from safetensors.torch import load_file

    tp_run, dp_run, resumed = tmp_path / "tp", tmp_path / "dp", tmp_path / "resumed"
    result = shardfit("train", *COMMON, "--nproc", "4", "--tp", "2", "--out", str(tp_run),
                      "--export", str(tp_run / "export"), timeout=600)
    shardfit("train", *COMMON, "--nproc", "2", "--out", str(dp_run), "--export", str(dp_run / "export"), timeout=400)
    tp_losses, dp_losses = run_losses(tp_run), run_losses(dp_run)
    assert sorted(tp_losses) == [1, 2, 3, 4], result.stdout
    for step, loss in dp_losses.items():
        assert tp_losses[step] == pytest.approx(loss, rel=1e-4), (step, tp_losses, dp_losses)
    tp_records, dp_records = run_records(tp_run), run_records(dp_run)
    assert [r["tokens"] for r in tp_records] == [r["tokens"] for r in dp_records]  # each batch once, not per TP rank
    for tp_record, dp_record in zip(tp_records, dp_records):  # the clipping norm counts every element once
        assert tp_record["grad_norm"] == pytest.approx(dp_record["grad_norm"], rel=1e-4), (tp_record, dp_record)
    assert tp_records[-1]["val_loss"] == pytest.approx(dp_records[-1]["val_loss"], rel=1e-4)

    # The 2 x 2 mesh's step-2 checkpoint, resumed on 2 ranks with no TP: DCP reshards weights and moments.
    again = shardfit("train", *COMMON, "--nproc", "2", "--tp", "1", "--out", str(resumed),
                     "--resume", str(tp_run / "checkpoints" / "step-2"), timeout=400)
    assert "resumed from" in again.stdout and "at step 2" in again.stdout
    for step, loss in run_losses(resumed).items():
        assert step > 2 and loss == pytest.approx(tp_losses[step], rel=1e-4), (step, loss, tp_losses)

    tp_weights = load_file(str(next((tp_run / "export").glob("*.safetensors"))))
    dp_weights = load_file(str(next((dp_run / "export").glob("*.safetensors"))))
    assert tp_weights.keys() == dp_weights.keys()
    for name, tensor in dp_weights.items():
        assert tp_weights[name].shape == tensor.shape, name  # gathered whole, not one TP shard
        torch.testing.assert_close(tp_weights[name], tensor, rtol=1e-3, atol=1e-4, msg=name)


def test_tensor_parallel_needs_fsdp2_and_a_degree_that_divides_the_ranks(tmp_path):
    for args, words in ((("--strategy", "ddp", "--tp", "2", "--nproc", "2"), "runs under fsdp2"),
                        (("--strategy", "fsdp2", "--tp", "3", "--nproc", "2"), "does not divide")):
        result = shardfit("train", *args, "--steps", "1", "--out", str(tmp_path / "x"), check=False)
        assert result.returncode != 0 and words in result.stderr, result.stderr
        assert "Traceback" not in result.stderr
