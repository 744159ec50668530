"""Where the traced step's parts begin and end, and what a trace runs (estimate/backward_timeline.py).

- The blocks' gradients in the trace are exactly the blocks' parameters: what runs between the
  embedding and the first block (OPT's input projection and learned positions, Bloom's embedding norm)
  belongs to the embedding's part, whose gradients FSDP keeps unsharded in its root until the end of
  backward (they used to be counted as the first block's, sharded at once and multiplied by the layers
  the reduced copy lacks).
- A trace runs torch's own linear even where DeepSpeed ZeRO-3's zero.Init has replaced
  torch.nn.functional.linear process-wide (the profiler's workers derive specs after the engine is up):
  the cached spec must not depend on the process that derived it.
- On gloo (device "cpu") every FSDP reduce-scatter holds one more full-size copy of its input.
"""
from __future__ import annotations

import json

import pytest

from shardfit.spec.tiny import tiny_config

torch = pytest.importorskip("torch")


def _spec(tmp_path, monkeypatch, arch: str):
    from shardfit.spec.models import load_model_spec

    monkeypatch.setenv("SHARDFIT_CACHE_DIR", str(tmp_path / "cache"))
    folder = tmp_path / arch
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(tiny_config(arch)))
    return load_model_spec(str(folder))


@pytest.mark.parametrize("arch", ["opt", "bloom", "qwen3"])
def test_the_blocks_gradients_are_the_blocks_parameters(tmp_path, monkeypatch, arch):
    from shardfit.estimate.backward_timeline import load_backward

    spec = _spec(tmp_path, monkeypatch, arch)
    traced = load_backward(spec, "fp32", "sdpa", None, "none")
    # Every parameter has one fp32 gradient, made in the part it belongs to: each traced block makes
    # its own parameters' (the reduced copy's blocks, all of one kind here), the head's and the
    # embedding's parts the rest (embeddings, positions, projections, final norm; a tied head once).
    assert traced["block_grads"] == [4 * spec.block_params] * len(traced["reduced_kinds"]), traced["block_grads"]
    assert traced["head_grads"] + traced["embedding_grads"] == 4 * spec.non_block_params


def test_a_trace_runs_torchs_linear_whatever_is_installed():
    import torch.nn.functional as functional

    from shardfit.estimate.fake_tensors import torch_linear

    calls = []

    def engine_linear(*args, **kwargs):  # what zero.Init installs in its place (an autograd Function)
        calls.append(1)
        return torch._C._nn.linear(*args, **kwargs)

    installed = functional.linear
    functional.linear = engine_linear
    try:
        with torch_linear():
            assert functional.linear is torch._C._nn.linear
            torch.nn.Linear(4, 4)(torch.ones(2, 4))
        assert functional.linear is engine_linear and not calls
    finally:
        functional.linear = installed


def test_gloo_reduce_scatter_copies_its_input(tmp_path, monkeypatch):
    from shardfit.estimate.estimator import estimate
    from shardfit.measure.run import load_plan

    spec_dir = tmp_path / "opt"
    _spec(tmp_path, monkeypatch, "opt")
    for kind in ("fsdp", "fsdp2"):
        plan = load_plan({"model": str(spec_dir), "strategy": {"kind": kind},
                          "cluster": {"nodes": 1, "gpus_per_node": 2},
                          "training": {"micro_batch": 2, "seq_len": 64, "precision": "bf16"}})
        parts = {device: _fsdp_parts(plan, device) for device in ("cpu", "cuda")}
        unit = plan.model.block_params
        assert parts["cpu"].unit_reduce - parts["cuda"].unit_reduce == 4 * unit  # fp32 reduction
        assert parts["cpu"].end_reduce - parts["cuda"].end_reduce == 4 * plan.model.non_block_params
        # The output shard is a gradient: one rank's share of the unit in the reduction dtype.
        assert parts["cpu"].unit_shard == parts["cuda"].unit_shard == 4 * unit // 2
        assert estimate(plan, device="cpu").phases["backward"]["grads"] > 0


def _fsdp_parts(plan, device: str):
    from shardfit.estimate.estimator import shard_degree
    from shardfit.estimate.step_activations import activations_step
    from shardfit.estimate.step_states import model_facts, states_and_buffers

    states = states_and_buffers(plan, activations_step(plan, device, None), model_facts(plan), shard_degree(plan),
                                accounting="real", device=device, optimizer_impl="auto", checkpoint="sharded",
                                record=None)
    return states.buffers.fsdp
