"""Tensor parallel for derived specs (any transformers architecture): the config one rank runs
(spec/rank_config.py), checked against the model's own TP plan, and the estimate built on it
(estimate/derived_parallel.py). The real FSDP2 x TP steps are measured in tests/engines/test_tensor_parallel.py."""
from __future__ import annotations

import fnmatch
import json

import pytest

from shardfit.errors import ShardfitError
from shardfit.estimate import derived_parallel
from shardfit.spec import rank_config
from shardfit.spec.models import load_model_spec
from shardfit.spec.tiny import tiny_config

pytest.importorskip("torch")

SLICED = ("qwen3", "starcoder2", "cohere", "gemma3_text", "qwen3_moe", "granitemoe", "llama", "mistral")
TP = 2


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    folder = tmp_path_factory.mktemp("derived-tp")
    out = {}
    for arch in SLICED + ("gpt_neox", "deepseek_v3", "phi3", "olmo2", "falcon"):
        (folder / arch).mkdir()
        (folder / arch / "config.json").write_text(json.dumps(tiny_config(arch)))
        out[arch] = str(folder / arch)
    return out


def _derived(path: str):
    spec = load_model_spec(path)
    if not spec.derived:  # llama / mistral have hand-written rules: their derived twin
        from shardfit.estimate.derived import twin

        spec = twin(spec)
    return spec


def _rank_params_by_plan(path: str, tp: int) -> int:
    """One rank's parameters under the model's own TP plan, from the meta-built model: colwise
    weights and biases / tp (the vocab-parallel head and embedding rounded up), rowwise weights / tp,
    everything else whole."""
    from shardfit.spec.derive import build_hf_model
    from shardfit.spec.models import load_hf_config

    model = build_hf_model(load_hf_config(path), device="meta")
    plan = model._tp_plan
    total, seen = 0, set()
    for name, param in model.named_parameters():
        if id(param) in seen:
            continue
        seen.add(id(param))
        module, _, leaf = name.rpartition(".")
        style = next((s for pattern, s in plan.items() if fnmatch.fnmatchcase(module, pattern)
                      and module.count(".") == pattern.count(".")), None)
        n = param.numel()
        if style in ("colwise", "colwise_gather_output", "embedding_rowwise"):
            n = -(-param.shape[0] // tp) * (n // param.shape[0])
        elif style == "rowwise" and leaf == "weight":
            n //= tp
        total += n
    return total


@pytest.mark.parametrize("arch", SLICED)
def test_a_rank_holds_what_the_models_own_tp_plan_leaves_it(models, arch):
    spec = _derived(models[arch])
    for loss_parallel in (True, False):
        rank = derived_parallel.local_model(spec, TP, loss_parallel)
        assert rank.n_params == _rank_params_by_plan(models[arch], TP), (arch, loss_parallel)
        assert rank.num_heads == spec.num_heads // TP and rank.head_dim == spec.head_dim
        # The logits' width: the rank's vocabulary shard under a vocab-parallel loss, else gathered.
        assert rank.vocab_size == (-(-spec.vocab_size // TP) if loss_parallel else spec.vocab_size)
        assert rank.block_params < spec.block_params
    assert derived_parallel.local_model(spec, 1, True) is spec


@pytest.mark.parametrize("arch, why", [("gpt_neox", "does not build what its TP plan leaves"),
                                       ("deepseek_v3", "fewer parameters outside the linears"),
                                       ("phi3", "inside the blocks"), ("olmo2", "inside the blocks"),
                                       ("falcon", "has no tensor-parallel plan")])
def test_plans_a_sliced_config_cannot_reproduce_get_one_line(models, arch, why):
    spec = _derived(models[arch])
    with pytest.raises(ShardfitError, match=why):
        rank_config.check_plan(spec, TP)
        derived_parallel.local_model(spec, TP, True)


def test_the_sliced_spec_derives_again_from_its_source_when_the_cache_is_cleared(models, tmp_path, monkeypatch):
    from shardfit.estimate.estimator import estimate
    from shardfit.measure.worker import load_plan

    monkeypatch.setenv("SHARDFIT_CACHE_DIR", str(tmp_path / "cache"))
    spec = load_model_spec(models["qwen3"])
    plan = load_plan({"model": models["qwen3"], "strategy": {"kind": "fsdp2"},
                           "cluster": {"nodes": 1, "gpus_per_node": 4},
                           "training": {"micro_batch": 2, "seq_len": 64, "precision": "bf16"},
                           "parallelism": {"tp": TP}})
    first = estimate(plan, device="cpu").device_peak_bytes
    rank = derived_parallel.local_model(spec, TP, True)
    base, overrides = rank_config.decode_source(rank.source)
    assert base == spec.source and overrides["num_attention_heads"] == spec.num_heads // TP
    for entry in (tmp_path / "cache" / "specs").glob("*.json"):
        entry.unlink()
    from shardfit.estimate import activations

    activations._derived_profile.cache_clear()
    assert estimate(plan, device="cpu").device_peak_bytes == first


def test_tensor_parallel_shrinks_a_derived_rank_and_fit_searches_it(models):
    from shardfit.estimate.estimator import estimate
    from shardfit.fit.layouts import layouts
    from shardfit.measure.worker import load_plan
    from shardfit.spec.plan import Cluster

    def plan(tp):
        return load_plan({"model": models["qwen3"], "strategy": {"kind": "fsdp2"},
                               "cluster": {"nodes": 1, "gpus_per_node": 4},
                               "training": {"micro_batch": 4, "seq_len": 128, "precision": "bf16"},
                               "parallelism": {"tp": tp}})
    one, two = estimate(plan(1), device="cpu").phases, estimate(plan(2), device="cpu").phases
    assert two["backward"]["activations"] < one["backward"]["activations"]
    spec = load_model_spec(models["qwen3"])
    found = layouts(spec, Cluster(nodes=2, gpus_per_node=4), 128)
    # Two KV heads: tp 2 at most; two layers: no pipeline over 2 nodes (tp 1 alone is plain dp).
    assert [(p.tp, p.pp, p.cp, p.sequence_parallel) for p in found] == [(2, 1, 1, True)]
    assert not [p for p in layouts(load_model_spec(models["olmo2"]), Cluster(nodes=1, gpus_per_node=4), 128) if p.tp > 1]


@pytest.mark.parametrize("arch", ["qwen3", "gemma3_text"])
def test_pipeline_stages_split_the_layers_by_kind_and_hold_the_edges(models, arch):
    """Stage specs (estimate/derived_parallel.stage_model): the layers' kinds in model order, the
    embedding on the first stage, the head on the last (a tied head: its own copy there), so the
    stages' parameters sum to the model's (+ the copy)."""
    spec = _derived(models[arch])
    first = derived_parallel.stage_model(spec, spec, [0], True, False)
    last = derived_parallel.stage_model(spec, spec, [1], False, True)
    kinds = [kind for kind, run in spec.layer_kinds for _ in range(run)]
    assert [n for _, n, _ in first.block_kinds] == [int(k == kinds[0]) for k in range(len(spec.block_kinds))]
    assert [n for _, n, _ in last.block_kinds] == [int(k == kinds[1]) for k in range(len(spec.block_kinds))]
    copy = spec.vocab_size * spec.hidden_size if spec.tie_embeddings else 0
    assert first.n_params + last.n_params == spec.n_params + copy
    assert first.vocab_size == 0 and last.vocab_size == spec.vocab_size
    assert first.single_adam_peak >= 2 * spec.vocab_size * spec.hidden_size  # the embedding, on the first stage
    assert derived_parallel.rank_layer_indices(8, 2, 2, 0) == [0, 1, 4, 5]


@pytest.mark.parametrize("arch", ["qwen3_moe", "deepseek_v3", "granitemoe"])
def test_expert_parallel_splits_the_routed_experts_only(models, arch, tmp_path_factory):
    """A rank under ep holds num_experts / ep of every MoE block's routed experts (the `experts`
    tensors, one row per expert, as the meta-built model has them); the router, the shared experts and
    everything else stay whole. Its estimate keeps the unsharded rank's activations (balanced routing)."""
    from shardfit.estimate.estimator import estimate
    from shardfit.measure.worker import load_plan
    from shardfit.spec.derive import build_hf_model
    from shardfit.spec.models import load_hf_config

    if arch not in models:
        folder = tmp_path_factory.mktemp(arch)
        (folder / "config.json").write_text(json.dumps(tiny_config(arch)))
        models[arch] = str(folder)
    spec = load_model_spec(models[arch])
    model = build_hf_model(load_hf_config(models[arch]), device="meta")
    routed = sum(p.numel() for name, p in model.named_parameters()
                 if ".experts." in f".{name}" and "shared" not in name and p.shape[0] == spec.num_experts)
    assert routed and sum(n * x for (_, n, _), x in zip(spec.block_kinds, spec.kind_expert_params)) == routed
    for ep in (2, 4):
        rank = derived_parallel.expert_sharded(spec, ep)
        assert rank.n_params == spec.n_params - routed + routed // ep
        assert rank.num_experts == spec.num_experts // ep

    def plan(ep):
        return load_plan({"model": models[arch], "strategy": {"kind": "ddp"}, "cluster": {"nodes": 1, "gpus_per_node": 4},
                          "training": {"micro_batch": 2, "seq_len": 64, "precision": "fp32"},
                          "parallelism": {"ep": ep} if ep > 1 else {}})
    one, two = estimate(plan(1), device="cpu").phases, estimate(plan(2), device="cpu").phases
    assert two["load"]["params"] < one["load"]["params"] and two["load"]["optimizer"] < one["load"]["optimizer"]
    assert two["backward"]["activations"] == one["backward"]["activations"]
