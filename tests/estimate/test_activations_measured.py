"""The analytic activation term against what autograd really saves, on real tiny HF models on CPU.

Counts the distinct storages packed by autograd during one forward (parameters excluded): exactly
what estimate()'s forward-phase activations claim (the logits themselves are a forward temporary).
"""
import json

import pytest

from shardfit.estimate import estimate
from shardfit.spec.models import PRESETS_DIR, load_model_spec
from shardfit.spec.plan import Cluster, LoRA, Plan, Training, parse_strategy

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")


def saved_bytes(name, precision, attention, b=2, s=64, lora=None) -> int:
    cfg = json.loads((PRESETS_DIR / f"{name}.json").read_text())
    config = transformers.AutoConfig.for_model(**cfg)
    config.use_cache = False
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation=attention)
    if precision == "bf16-pure":
        model = model.to(torch.bfloat16)
    if lora is not None:
        peft = pytest.importorskip("peft")
        model = peft.get_peft_model(model, peft.LoraConfig(r=lora.rank, target_modules=list(lora.target_modules),
                                                           lora_dropout=0.0))
    return autograd_saved_bytes(model, precision, b, s)


def autograd_saved_bytes(model, precision, b=2, s=64) -> int:
    """Distinct storages autograd saves in one forward with labels (parameters excluded)."""
    model.train()
    owned = {t.untyped_storage().data_ptr() for t in (*model.parameters(), *model.buffers())}
    seen: dict[int, int] = {}

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in owned:
            seen[storage.data_ptr()] = storage.nbytes()
        return t

    ids = torch.randint(0, model.config.get_text_config().vocab_size, (b, s))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16"):
            loss = model(input_ids=ids, labels=ids).loss  # the output (logits) is dropped, as in training
    assert loss.requires_grad
    return sum(seen.values())


def estimated(name, precision, attention, b=2, s=64, lora=None) -> int:
    training = Training(micro_batch=b, seq_len=s, precision=precision, attention=attention, lora=lora)
    plan = Plan(model=load_model_spec(name), strategy=parse_strategy("ddp"), training=training,
                cluster=Cluster(gpus_per_node=1))
    est = estimate(plan, device="cpu", explain=True)
    # autograd also saves autocast's 16-bit weight copies; the estimate files them as temporaries.
    copies = next((t.bytes for t in est.terms if t.name == "temporaries.autocast_weight_copies"), 0)
    return est.term("activations.blocks").bytes + est.term("activations.head").bytes + copies


CASES = [
    ("tiny-llama", "fp32", "sdpa"), ("tiny-llama", "fp32", "eager"), ("tiny-llama", "bf16-pure", "sdpa"),
    ("tiny-llama", "bf16", "sdpa"),  # DDP autocast: fp32 residual, per-linear casts, cached weight copies
    ("tiny-mistral", "bf16-pure", "eager"), ("tiny-qwen2", "fp32", "sdpa"),
    ("tiny-mixtral", "fp32", "sdpa"), ("tiny-mixtral", "bf16", "sdpa"),
    ("tiny-gemma2", "bf16-pure", "eager"),
    ("tiny-gpt2", "fp32", "sdpa"),  # dropout on CPU: math SDPA with fp32 scores and float masks
    ("tiny-gpt2", "bf16-pure", "eager"), ("tiny-gpt2", "bf16", "eager"),
]


@pytest.mark.parametrize("name,precision,attention", CASES)
def test_saved_activations_match_autograd(name, precision, attention):
    measured = saved_bytes(name, precision, attention)
    predicted = estimated(name, precision, attention)
    # Exact up to a few constant-size tensors (cross-entropy's total_weight, MoE expert counts).
    assert abs(predicted - measured) <= 64, (predicted, measured)


@pytest.mark.parametrize("precision", ["fp32", "bf16-pure"])
def test_lora_saved_activations_match_autograd(precision):
    lora = LoRA(rank=8, target_modules=("q_proj", "v_proj"), base_dtype="fp32" if precision == "fp32" else "bf16")
    measured = saved_bytes("tiny-llama", precision, "sdpa", lora=lora)
    predicted = estimated("tiny-llama", precision, "sdpa", lora=lora)
    assert abs(predicted - measured) <= 16, (predicted, measured)


def test_eager_grows_with_the_square_of_the_sequence():
    short = saved_bytes("tiny-llama", "fp32", "eager", b=1, s=32) - saved_bytes("tiny-llama", "fp32", "sdpa", b=1, s=32)
    long = saved_bytes("tiny-llama", "fp32", "eager", b=1, s=128) - saved_bytes("tiny-llama", "fp32", "sdpa", b=1, s=128)
    assert long > 10 * short  # s^2: 4x the sequence, ~16x the extra
    assert estimated("tiny-llama", "fp32", "eager", 1, 128) - estimated("tiny-llama", "fp32", "sdpa", 1, 128) == long
