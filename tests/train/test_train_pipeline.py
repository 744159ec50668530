"""`shardfit train --pp`: the pipeline engine (torch.distributed.pipelining, 1F1B over the step's
micro-batches) in the real loop. A 2-stage run on 2 ranks trains the same steps as one process
accumulating the same micro-batches; pp 2 x dp 2 under FSDP2 on 4 ranks the same as 2-rank DDP; their
DCP checkpoints, keyed by the whole model's names, resume without a pipeline and the other way round;
the export gathers every stage's tensors into the one-process run's model; the ZB-V schedule (a V of
2 chunks per rank) trains the same steps."""
from __future__ import annotations

import pytest
from launch import run_losses, run_records, shardfit

pytest.importorskip("torch")
pytestmark = [pytest.mark.multirank, pytest.mark.slow]

COMMON = ("--steps", "4", "--seq", "64", "--micro-batch", "2", "--grad-accum", "4", "--lr", "3e-3",
          "--save-every", "2", "--keep", "3", "--eval-every", "4", "--no-progress")


def _same_run(got, want):
    got_records, want_records = run_records(got), run_records(want)
    assert [r["step"] for r in got_records] == [1, 2, 3, 4]
    for a, b in zip(got_records, want_records):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5), (a, b)
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-5), (a, b)  # every element counted once
        assert a["tokens"] == b["tokens"], (a, b)  # a pipeline's batch counted once, not per stage
    assert got_records[-1]["val_loss"] == pytest.approx(want_records[-1]["val_loss"], rel=1e-5)


def _same_weights(got, want, rtol=1e-4, atol=1e-6):
    import torch
    from safetensors.torch import load_file

    a = load_file(str(next((got / "export").glob("*.safetensors"))))
    b = load_file(str(next((want / "export").glob("*.safetensors"))))
    assert a.keys() == b.keys()
    for name, tensor in b.items():
        torch.testing.assert_close(a[name], tensor, rtol=rtol, atol=atol, msg=name)


def test_two_stages_train_like_one_process_and_checkpoints_cross_layouts(tmp_path):
    pp, one = tmp_path / "pp", tmp_path / "one"
    result = shardfit("train", *COMMON, "--strategy", "ddp", "--pp", "2", "--nproc", "2", "--out", str(pp),
                      "--export", str(pp / "export"), timeout=300)
    assert "no sample" in result.stdout  # no rank holds the whole model to generate
    shardfit("train", *COMMON, "--strategy", "single", "--nproc", "1", "--out", str(one),
             "--export", str(one / "export"), timeout=300)
    _same_run(pp, one)
    _same_weights(pp, one)
    # The pipeline's step-2 checkpoint, resumed in one process without a pipeline, and the one-process
    # checkpoint resumed in 2 stages: DCP matches the tensors by the whole model's names.
    for checkpoint, args, out in ((pp, ("--strategy", "single", "--pp", "1", "--nproc", "1"), tmp_path / "a"),
                                  (one, ("--strategy", "ddp", "--pp", "2", "--nproc", "2"), tmp_path / "b")):
        again = shardfit("train", *COMMON, *args, "--out", str(out), "--resume",
                         str(checkpoint / "checkpoints" / "step-2"), timeout=300)
        assert "resumed from" in again.stdout and "at step 2" in again.stdout
        want = run_losses(one)
        for step, loss in run_losses(out).items():
            assert step > 2 and loss == pytest.approx(want[step], rel=1e-5), (out.name, step, loss, want)


def test_a_v_schedule_trains_like_one_process_and_exports_the_head_from_rank_0(tmp_path):
    """ZB-V: each backward split into input and weight gradients, 2 chunks per rank in a V, so rank 0
    holds the embedding and the head (the loss, the held-out loss and the export's head come from it)."""
    zbv, one = tmp_path / "zbv", tmp_path / "one"
    # A held-out loss mid-run too (step 2): torch's ZB-V cannot run forward only, the engine runs its
    # forward actions alone, and training must go on unchanged after it.
    shardfit("train", *COMMON, "--eval-every", "2", "--strategy", "ddp", "--pp", "2", "--pp-schedule", "zbv",
             "--nproc", "2", "--out", str(zbv), "--export", str(zbv / "export"), timeout=300)
    shardfit("train", *COMMON, "--eval-every", "2", "--strategy", "single", "--nproc", "1", "--out", str(one),
             "--export", str(one / "export"), timeout=300)
    _same_run(zbv, one)
    _same_weights(zbv, one)


def test_tensor_and_sequence_parallel_stages_under_zbv_train_like_one_process(tmp_path):
    """pp 2 x tp 2 on 4 ranks under ZB-V: each stage's linears split by the model's TP plan, its norms on
    sequence shards (a stage sends its tp rank's shard of the hidden states), the logits vocab-sharded
    into torch's loss_parallel on rank 0 (which holds the head in the V)."""
    common = ("model: tiny-llama\ntraining: {precision: fp32, activation_checkpointing: none}\n"
              "schedule: {warmup_steps: 0}\n")
    plan, single = tmp_path / "plan.yaml", tmp_path / "single.yaml"
    plan.write_text(common + "strategy: {kind: ddp}\ncluster: {nodes: 1, gpus_per_node: 4}\nparallelism: "
                    "{pp: 2, tp: 2, sequence_parallel: true, pp_schedule: zbv, pp_virtual_stages: 2}\n")
    single.write_text(common + "strategy: {kind: single}\ncluster: {nodes: 1, gpus_per_node: 1}\n")
    staged, one = tmp_path / "staged", tmp_path / "one"
    shardfit("train", str(plan), *COMMON, "--nproc", "4", "--out", str(staged), "--export", str(staged / "export"),
             timeout=400)
    shardfit("train", str(single), *COMMON, "--nproc", "1", "--out", str(one), "--export", str(one / "export"),
             timeout=300)
    _same_run(staged, one)
    # TP's split matmuls sum in another order: test_train_tensor_parallel.py's tolerance.
    _same_weights(staged, one, rtol=1e-3, atol=1e-4)


def test_fsdp2_stages_with_data_parallel_train_like_ddp(tmp_path):
    pp, ddp = tmp_path / "pp", tmp_path / "ddp"
    shardfit("train", *COMMON, "--strategy", "fsdp2", "--pp", "2", "--nproc", "4", "--out", str(pp),
             "--export", str(pp / "export"), timeout=400)
    shardfit("train", *COMMON, "--strategy", "ddp", "--nproc", "2", "--out", str(ddp),
             "--export", str(ddp / "export"), timeout=300)
    _same_run(pp, ddp)
    _same_weights(pp, ddp)


def test_pipeline_training_refuses_what_it_cannot_run(tmp_path):
    for args, words in ((("--strategy", "zero2", "--pp", "2", "--nproc", "2"), "does not compose"),
                        (("--strategy", "ddp", "--pp", "2", "--nproc", "3"), "does not divide"),
                        (("--strategy", "ddp", "--pp", "2", "--nproc", "2", "--grad-accum", "2", "--ac", "full"),
                         "--ac none"),
                        # torch's Schedule1F1B refuses fewer micro-batches than stages: one line, before any rank.
                        (("--strategy", "ddp", "--pp", "2", "--nproc", "2"), "at least as many micro-batches")):
        result = shardfit("train", *args, "--steps", "1", "--out", str(tmp_path / "x"), check=False, timeout=120)
        assert result.returncode != 0 and words in result.stderr, (args, result.stderr[-2000:])
        assert "Traceback" not in result.stderr
