"""Activation coefficients traced from the model's own code (estimate/derived.py) against what
autograd really saves in a real CPU forward, for architectures outside the hand-written families, and
against the hand-written profiles where both exist."""
import json

import pytest

from shardfit.estimate import estimate
from shardfit.estimate.activations import activation_profile
from shardfit.estimate.step_activations import saved_activation_bytes
from shardfit.spec.models import derived_spec, load_hf_config, load_model_spec
from shardfit.spec.plan import Cluster, Plan, Training, parse_strategy

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from shardfit.modeling import build_model  # noqa: E402
from shardfit.spec.tiny import tiny_config  # noqa: E402
from test_activations_measured import autograd_saved_bytes  # noqa: E402

# GQA/MQA, MoE with and without shared experts, multi-head latent attention, sliding-window and hybrid
# attention, parallel attention + MLP, LayerNorm and RMSNorm, tied and untied heads, Mamba layers.
ARCHITECTURES = ["qwen3", "phi3", "olmo2", "deepseek_v3", "gpt_neox", "falcon", "gemma3_text", "qwen3_moe",
                 "starcoder2", "granitemoe", "opt", "bloom", "cohere", "jamba"]
PRECISIONS = ["fp32", "bf16-pure", "bf16"]  # bf16 = DDP's autocast over fp32 weights


@pytest.fixture(scope="module")
def configs(tmp_path_factory):
    cache = tmp_path_factory.mktemp("spec-cache")
    patch = pytest.MonkeyPatch()
    patch.setenv("SHARDFIT_CACHE_DIR", str(cache))
    folder = tmp_path_factory.mktemp("configs")
    paths = {}
    for model_type in ARCHITECTURES:
        path = folder / f"{model_type}.json"
        path.write_text(json.dumps(tiny_config(model_type)))
        paths[model_type] = str(path)
    yield paths
    patch.undo()


def estimated_saved_bytes(spec, precision, b=2, s=64) -> int:
    plan = Plan(model=spec, strategy=parse_strategy("ddp"), cluster=Cluster(gpus_per_node=1),
                training=Training(micro_batch=b, seq_len=s, precision=precision))
    est = estimate(plan, device="cpu", explain=True)
    copies = next((t.bytes for t in est.terms if t.name == "temporaries.autocast_weight_copies"), 0)
    return est.term("activations.blocks").bytes + est.term("activations.head").bytes + copies


@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("model_type", ARCHITECTURES)
def test_traced_activations_equal_a_real_forward(configs, model_type, precision):
    if model_type == "jamba" and precision == "bf16":
        pytest.xfail("Mamba's slow path under CPU autocast: +4.7% (a cast the fake trace takes and the real step does not)")
    spec = load_model_spec(configs[model_type])
    assert spec.derived
    torch.manual_seed(0)
    model = build_model(configs[model_type], dtype="bf16" if precision == "bf16-pure" else "fp32")
    measured = autograd_saved_bytes(model, precision)
    predicted = estimated_saved_bytes(spec, precision)
    # Exact up to constant-size tensors; MoE models up to 0.5%: what the real grouped_mm step keeps of
    # the routing (sorted ids, per-expert counts) moves a little with the data (2 KiB of 1.1 MiB seen).
    tolerance = max(64, 0.005 * measured) if spec.num_experts else 64
    assert abs(predicted - measured) <= tolerance, (predicted, measured)


def test_traced_coefficients_scale_to_other_shapes(configs):
    """Traced at b <= 3 and short sequences; the polynomial holds at a batch and length never traced."""
    spec = load_model_spec(configs["qwen3"])
    torch.manual_seed(0)
    model = build_model(configs["qwen3"], dtype="fp32")
    assert abs(estimated_saved_bytes(spec, "fp32", b=5, s=200) - autograd_saved_bytes(model, "fp32", b=5, s=200)) <= 64


HAND_FAMILIES = ["tiny-llama", "tiny-mistral", "tiny-mixtral", "tiny-qwen2", "tiny-gemma2", "tiny-gpt2", "tiny-bert"]


@pytest.mark.parametrize("regime", ["fp32", "half", "autocast"])
@pytest.mark.parametrize("name", HAND_FAMILIES)
def test_hand_written_profiles_equal_the_traced_ones(name, regime, tmp_path, monkeypatch):
    monkeypatch.setenv("SHARDFIT_CACHE_DIR", str(tmp_path))
    hand = load_model_spec(name)
    derived = derived_spec(load_hf_config(name), name, name)
    totals = []
    for spec in (hand, derived):
        profile = activation_profile(spec, regime, "sdpa", None, "cpu")
        blocks, head, _ = saved_activation_bytes(profile, 2 * 64, 64, spec.num_layers, 0)
        totals.append(blocks + head + spec.num_layers * profile.weight_copies + profile.head_weight_copy)
    assert abs(totals[0] - totals[1]) <= 64, totals


@pytest.mark.parametrize("precision", ["fp32", "bf16-pure"])
def test_traced_activations_with_lora_equal_a_real_forward(configs, precision):
    """LoRA is traced with peft's own adapters: the frozen base saves less, the adapters more."""
    from shardfit.spec.plan import LoRA

    peft = pytest.importorskip("peft")
    lora = LoRA(rank=8, target_modules=("q_proj", "v_proj"), base_dtype="fp32" if precision == "fp32" else "bf16")
    spec = load_model_spec(configs["qwen3"])
    torch.manual_seed(0)
    model = build_model(configs["qwen3"], dtype="bf16" if precision == "bf16-pure" else "fp32")
    model = peft.get_peft_model(model, peft.LoraConfig(r=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0))
    measured = autograd_saved_bytes(model, precision)
    plan = Plan(model=spec, strategy=parse_strategy("ddp"), cluster=Cluster(gpus_per_node=1),
                training=Training(micro_batch=2, seq_len=64, precision=precision, lora=lora))
    est = estimate(plan, device="cpu", explain=True)
    predicted = est.term("activations.blocks").bytes + est.term("activations.head").bytes
    assert abs(predicted - measured) <= 64, (predicted, measured)


SLIDING = {"qwen3": {"use_sliding_window": True, "max_window_layers": 1,
                     "layer_types": ["full_attention", "sliding_attention"]},  # one full, one sliding layer
           "gemma3_text": {}, "starcoder2": {}}


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
@pytest.mark.parametrize("model_type", sorted(SLIDING))
def test_sequences_longer_than_the_sliding_window(model_type, attention, tmp_path, monkeypatch):
    """A window of 300 lies above every traced length (64-256): a 384-token step builds the sliding
    mask and hands it to SDPA (instead of is_causal), which the trace below the window never saw;
    the coefficients traced beyond the window must equal that real forward, and those below it a
    200-token one."""
    from shardfit.estimate.derived import window_of

    monkeypatch.setenv("SHARDFIT_CACHE_DIR", str(tmp_path / "cache"))
    path = tmp_path / "config.json"
    path.write_text(json.dumps({**tiny_config(model_type), "sliding_window": 300, **SLIDING[model_type]}))
    spec = load_model_spec(str(path))
    assert spec.derived and window_of(spec) == 300
    torch.manual_seed(0)
    model = build_model(str(path), dtype="fp32", attn_implementation=attention)
    for s in (200, 384):
        plan = Plan(model=spec, strategy=parse_strategy("ddp"), cluster=Cluster(gpus_per_node=1),
                    training=Training(micro_batch=2, seq_len=s, precision="fp32", attention=attention))
        est = estimate(plan, device="cpu", explain=True)
        predicted = est.term("activations.blocks").bytes + est.term("activations.head").bytes
        measured = autograd_saved_bytes(model, "fp32", b=2, s=s)
        assert abs(predicted - measured) <= 64, (s, predicted, measured)


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("model_type", ["bloom", "opt"])
def test_forward_split_equals_a_real_step(configs, model_type, precision):
    """The forward phase's activations and temporaries as the tracker files them in a real one-process
    step. Bloom's fp32 forward peaks inside the last block's gelu (four b·s·I intermediates, ALiBi and
    the 4-D mask alive, the block's later saved tensors not yet made), which only the traced instants
    (estimate/forward_timeline.py) see; OPT's peaks at the loss."""
    import shardfit

    spec = load_model_spec(configs[model_type])
    plan = Plan(model=spec, strategy=parse_strategy("single"), cluster=Cluster(gpus_per_node=1),
                training=Training(micro_batch=2, seq_len=64, precision=precision))
    predicted = estimate(plan, device="cpu").phases["forward"]
    torch.manual_seed(0)
    model = build_model(configs[model_type], dtype="fp32")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=False)
    ids = torch.randint(0, spec.vocab_size, (2, 64))
    with shardfit.profile(model, optimizer) as prof:
        for _ in range(2):
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16"):
                loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    measured = prof.report().phases["forward"]
    for category in ("activations", "temporaries"):
        assert predicted[category] == pytest.approx(measured[category], rel=0.05), (category, predicted, measured)
