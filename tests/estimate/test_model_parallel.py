"""Per-rank estimates under tp / sp / cp / pp: Korthikanti et al. 2022 Table 2 and Megatron-LM's
theoretical memory on the paper's own model shapes, and the data-parallel estimator as the tp = cp = pp
= 1 case.

The oracles are written out here, from the sources, independently of estimate/korthikanti.py:
- Korthikanti, Casper, Lym, McAfee, Andersch, Shoeybi, Catanzaro, "Reducing Activation Recomputation
  in Large Transformer Models", arXiv 2205.05198, Table 2 (per layer) and sec. 4.2.3 (first stage);
  model shapes from its Table 3 (GPT-3 175B: 96 heads, h 12288, 96 layers, tp 8, pp 8; 530B: 128,
  20480, 105, tp 8, pp 35; 1T: 160, 25600, 128, tp 8, pp 64; s = 2048, V = 51200).
- Megatron-LM megatron/training/theoretical_memory_usage.py (NVIDIA/Megatron-LM main):
  compute_weight_and_optimizer_memory (dense, no MTP) and compute_activation_memory (the
  sequence-parallel + selective-recompute branch), reimplemented below for those inputs.
"""
from dataclasses import replace

import pytest

from shardfit.estimate.estimator import estimate
from shardfit.estimate.model_parallel import local_model, stage_estimates
from shardfit.estimate.sequence_parallel import sharded_norm_bytes
from shardfit.spec.models import analytic_spec, load_model_spec
from shardfit.spec.parallelism import Parallelism, resolve
from shardfit.spec.plan import Cluster, Plan, Training, parse_strategy

S, V = 2048, 51200
PAPER = {  # name: (heads, hidden, layers, tp, pp)
    "gpt3-175b": (96, 12288, 96, 8, 8),
    "mt-nlg-530b": (128, 20480, 105, 8, 35),
    "gpt-1t": (160, 25600, 128, 8, 64),
}


def gpt(name):
    a, h, layers, _, _ = PAPER[name]
    return analytic_spec({"model_type": "gpt2", "n_embd": h, "n_layer": layers, "n_head": a, "vocab_size": V,
                          "n_positions": S}, name, "test")


def paper_plan(name, *, sp=False, attention="eager", ac="none", pp=None, microbatches=None, strategy="ddp"):
    a, h, layers, tp, paper_pp = PAPER[name]
    pp = paper_pp if pp is None else pp
    m = microbatches or pp
    gpus = tp * pp  # one data-parallel replica
    nodes = max(1, gpus // 8)
    return Plan(model=gpt(name), strategy=parse_strategy(strategy),
                training=Training(micro_batch=1, seq_len=S, grad_accum=m, attention=attention,
                                  activation_checkpointing=ac, precision="bf16"),
                cluster=Cluster(nodes=nodes, gpus_per_node=gpus // nodes),
                parallelism=Parallelism(tp=tp, pp=pp, sequence_parallel=sp))


# ---- oracles, from the paper's text ----
def table2_layer(s, b, h, a, t, row):
    return {
        "tp": s * b * h * (10 + 24 / t + 5 * a * s / (h * t)),
        "tp+sp": s * b * h * (34 / t + 5 * a * s / (h * t)),
        "tp+selective": s * b * h * (10 + 24 / t),
        "tp+sp+selective": s * b * h * (34 / t),
        "full": 2 * s * b * h,
    }[row]


def first_stage_paper(s, b, h, a, layers, t, p, row):
    """Sec. 4.2.3: L layers' worth on the first stage (p micro-batches of L/p layers) + the embedding
    dropout mask for p micro-batches; the output layer only without a pipeline."""
    total = table2_layer(s, b, h, a, t, row) * layers + s * b * h * p / t
    if p == 1:
        total += 4 * s * b * h / t * (1 + V / h)
    return total


# ---- Megatron-LM theoretical_memory_usage.py, reimplemented for a dense GPT ----
def megatron_weights_and_optimizer(h, layers, a, ffn, vocab, tp, pp, dp, *, distributed_optimizer=False,
                                   norm_size=2, kv_groups=None, swiglu=False, untied=False):
    groups = kv_groups or a
    gated = 3 / 2 if swiglu else 1
    self_attn = 2 * h * h * (1 + groups / a)  # query projection size == hidden
    layer = 2 * h * (ffn * gated + norm_size) + self_attn
    embedding = h * vocab
    block = layer * layers + norm_size * h
    shard = (block / pp + embedding) / tp
    if untied and pp == 1:
        shard += embedding / tp
    per_param = 6 + 12 / dp if distributed_optimizer else 18
    return shard, shard * per_param


def megatron_activations_sp_selective(s, b, h, ffn, layers, vocab, tp, pp, microbatches=None):
    act = s * b * h * (18 + 4 * ffn / h) * layers
    act += 8 * s * b * pp  # input token ids, pp micro-batches in flight
    act += s * b * h * pp  # embedding dropout
    if pp > 1 and microbatches is not None:
        act *= min(1, microbatches / pp)
    if pp == 1:
        act += s * b * h * 4 * (1 + vocab / h)
    return act / tp


def first_rank(plan, **options):
    stage, layers, est = stage_estimates(plan, estimate, accounting="ideal", device="cuda", checkpoint="sharded",
                                         optimizer_impl="auto")[0]
    assert stage == 0
    return layers, est


def activations(est):
    return est.phases["backward"]["activations"]


@pytest.mark.parametrize("name", list(PAPER))
@pytest.mark.parametrize("row,sp,attention,ac", [
    ("tp", False, "eager", "none"), ("tp+sp", True, "eager", "none"),
    ("tp+selective", False, "sdpa", "none"), ("tp+sp+selective", True, "sdpa", "none"),
    ("full", False, "eager", "full"),
])
def test_first_stage_activations_reproduce_korthikanti_table_2(name, row, sp, attention, ac):
    a, h, layers, tp, pp = PAPER[name]
    _, est = first_rank(paper_plan(name, sp=sp, attention=attention, ac=ac))
    expected = first_stage_paper(S, 1, h, a, layers, tp, pp, row)
    assert activations(est) == pytest.approx(expected, rel=1e-6)


def test_table_2_figures_for_gpt3_175b():
    """The per-layer figures themselves (GiB), tp = 8, s = 2048, b = 1: what sec. 4 reports as the
    5x reduction from sequence parallel + selective recompute."""
    a, h, _, t, _ = PAPER["gpt3-175b"]
    rows = {row: table2_layer(S, 1, h, a, t, row) / 2**30 for row in ("tp", "tp+sp", "tp+selective", "tp+sp+selective")}
    no_parallel = S * h * (34 + 5 * a * S / h) / 2**30
    assert rows["tp"] == pytest.approx(0.5391, abs=1e-4)
    assert rows["tp+sp+selective"] == pytest.approx(0.0996, abs=1e-4)
    # 10 + 3 + 5*96*2048/(12288*8) = 23 sbh against 34/8 = 4.25 sbh: the paper's "5x".
    assert rows["tp"] / rows["tp+sp+selective"] == pytest.approx(23 / 4.25)
    assert no_parallel / 8 / rows["tp+sp+selective"] == pytest.approx(rows["tp+sp"] / rows["tp+sp+selective"])


@pytest.mark.parametrize("name", list(PAPER))
def test_activations_match_megatron_theoretical_memory(name):
    """Megatron's SP + selective branch counts the int64 token ids (8sbp) too; the paper and we do not."""
    a, h, layers, tp, pp = PAPER[name]
    for micro in (pp, max(1, pp // 2)):
        _, est = first_rank(paper_plan(name, sp=True, attention="sdpa", microbatches=micro))
        megatron = megatron_activations_sp_selective(S, 1, h, 4 * h, layers, V, tp, pp, micro)
        token_ids = 8 * S * pp * min(1, micro / pp) / tp
        assert activations(est) + token_ids == pytest.approx(megatron, rel=1e-9)
    one = paper_plan(name, sp=True, attention="sdpa", pp=1)
    one = replace(one, cluster=Cluster(nodes=1, gpus_per_node=tp))
    _, est = first_rank(one)
    assert activations(est) + 8 * S / tp == pytest.approx(megatron_activations_sp_selective(S, 1, h, 4 * h, layers, V, tp, 1),
                                                          rel=1e-9)


@pytest.mark.parametrize("name", list(PAPER))
def test_first_stage_parameters_match_megatron(name):
    """Megatron's count leaves out the linears' biases and the learned position embedding (replicated,
    first stage) and divides the norms and the final norm (1/pp of it) by tp; GPT-2's shapes have them
    all. With those named, the counts are equal."""
    a, h, layers, tp, pp = PAPER[name]
    plan = paper_plan(name)
    l0, est = first_rank(plan)
    ours = local_model(plan.model, resolve(plan), l0, True, pp == 1).n_params
    megatron, megatron_bytes = megatron_weights_and_optimizer(h, layers, a, 4 * h, V, tp, pp, dp=1)
    # Ours per layer: the weights and the colwise biases (c_attn 3h, c_fc 4h) / tp, the rowwise biases
    # (2h) and the LayerNorms (4h) whole; Megatron: (weights + 4h) / tp.
    biases_and_norms = l0 * (7 * h / tp + 6 * h - 4 * h / tp)
    final_norm = 2 * h / pp / tp  # Megatron spreads it over the stages; ours is on the last
    assert ours == pytest.approx(megatron + biases_and_norms + S * h - final_norm, rel=1e-12)
    # Bytes: Megatron keeps fp32 gradients (18 = 2 + 4 + 12 per parameter); the ZeRO paper's 16 has bf16 ones.
    states = sum(est.phases["optimizer"][c] for c in ("params", "grads", "optimizer"))
    assert states == pytest.approx(ours * 16, rel=1e-9)
    assert megatron_bytes == pytest.approx(megatron * 18)


def test_llama_405b_tp8_parameters_match_megatron():
    """Llama 3.1 405B, tp 8, no pipeline (SwiGLU, RMSNorm, GQA 8 groups, untied): equal up to Megatron's
    vocabulary padding (to a multiple of 128 x tp) and its norms / tp."""
    m = load_model_spec("llama-3.1-405b")
    plan = Plan(model=m, strategy=parse_strategy("fsdp2"), cluster=Cluster(nodes=1, gpus_per_node=8),
                parallelism=Parallelism(tp=8))
    ours = local_model(m, resolve(plan), m.num_layers, True, True).n_params
    padded = -(-m.vocab_size // 1024) * 1024
    megatron, _ = megatron_weights_and_optimizer(m.hidden_size, m.num_layers, m.num_heads, m.intermediate_size,
                                                 padded, 8, 1, 1, norm_size=1, kv_groups=m.num_kv_heads,
                                                 swiglu=True, untied=True)
    h = m.hidden_size
    vocab_gap = 2 * (padded - 8 * -(-m.vocab_size // 8)) * h / 8
    norms_gap = (2 * m.num_layers + 1) * h * (1 - 1 / 8)
    assert ours == pytest.approx(megatron - vocab_gap + norms_gap, rel=1e-12)


def test_explicit_default_layout_equals_the_data_parallel_estimate():
    """dp_shard given as the strategy derives it: not the default section, so the model-parallel path
    runs with tp = cp = pp = 1 and must give today's estimate, phase by phase."""
    m = load_model_spec("llama-3.1-8b")
    base = Plan(model=m, strategy=parse_strategy("fsdp2"), training=Training(seq_len=4096),
                cluster=Cluster(nodes=2, gpus_per_node=8))
    explicit = replace(base, parallelism=Parallelism(dp_shard=16))
    assert estimate(explicit).phases == estimate(base).phases
    hsdp = replace(base, strategy=parse_strategy("fsdp2:hybrid"))
    assert estimate(replace(hsdp, parallelism=Parallelism(dp_shard=8))).phases == estimate(hsdp).phases


def test_tensor_sequence_context_and_pipeline_parallel_shrink_their_categories():
    m = load_model_spec("llama-3.1-70b")
    base = Plan(model=m, strategy=parse_strategy("fsdp2"), training=Training(seq_len=8192, grad_accum=8),
                cluster=Cluster(nodes=8, gpus_per_node=8))
    plain = estimate(replace(base, parallelism=Parallelism(dp_shard=64)))
    tp = estimate(replace(base, parallelism=Parallelism(tp=8)))
    sp = estimate(replace(base, parallelism=Parallelism(tp=8, sequence_parallel=True)))
    cp = estimate(replace(base, parallelism=Parallelism(tp=4, cp=2, sequence_parallel=True)))
    pp = estimate(replace(base, parallelism=Parallelism(tp=8, pp=4, sequence_parallel=True)))
    act = [e.category_peak("activations") for e in (plain, tp, sp)]
    # TP alone leaves the norms, residual and the QKV / MLP inputs at full width (Korthikanti's 10sbh);
    # torch's sequence parallel splits what the norms between the regions save (7/8 of it is gone),
    # while the attention and MLP keep their all-gathered inputs (Megatron re-gathers them).
    assert act[0] / 8 < act[1] < act[0] / 2
    sharded = estimate(replace(base, parallelism=Parallelism(tp=8, sequence_parallel=True)),
                       explain=True).term("parallel.sp_sharded").bytes
    per_layer, final_norm, extra = sharded_norm_bytes(m, "half")
    assert extra == 0  # Llama's attention and MLP read different norms' outputs
    assert sharded == int(8192 * (m.num_layers * per_layer + final_norm) * (1 - 1 / 8))
    assert act[2] == pytest.approx(act[1] - sharded, rel=0.01)
    # States: each rank holds 1/tp of the linears, sharded over dp = 8 instead of 64: the same bytes
    # per rank up to the replicated norms.
    assert tp.phases["load"]["optimizer"] == pytest.approx(plain.phases["load"]["optimizer"], rel=0.01)
    # CP: half the tokens per rank, the ring's K/V chunks in the temporaries.
    assert cp.category_peak("activations") < sp.category_peak("activations") * 1.1
    assert any(t.name == "parallel.cp_ring" and t.bytes > 0 for t in estimate(
        replace(base, parallelism=Parallelism(tp=4, cp=2, sequence_parallel=True)), explain=True).terms)
    # PP: the first rank keeps p = 4 micro-batches of its 20 layers (80 layers' worth); a quarter of
    # the layers' states, sharded over dp = 2 instead of 8: the same bytes per rank, up to the embedding.
    stages = stage_estimates(replace(base, parallelism=Parallelism(tp=8, pp=4, sequence_parallel=True)), estimate,
                             accounting="real", device="cuda", checkpoint="sharded", optimizer_impl="auto")
    first, last = stages[0][2], stages[-1][2]
    assert first.phases["load"]["optimizer"] == pytest.approx(tp.phases["load"]["optimizer"], rel=0.05)
    assert first.category_peak("activations") == pytest.approx(sp.category_peak("activations"), rel=0.1)
    assert last.category_peak("activations") < first.category_peak("activations") / 3
    assert pp.device_peak_bytes == max(e.device_peak_bytes for _, _, e in stages)


def _pipeline_plan(pp: int, schedule: str = "1f1b", sp: bool = False) -> Plan:
    return Plan(model=load_model_spec("tiny-llama"), strategy=parse_strategy("ddp"),
                cluster=Cluster(nodes=1, gpus_per_node=pp * (2 if sp else 1)),
                training=Training(micro_batch=2, grad_accum=4, seq_len=64, precision="fp32"),
                parallelism=Parallelism(pp=pp, pp_schedule=schedule, tp=2 if sp else 1, sequence_parallel=sp,
                                        loss_parallel=False))


def test_pipeline_receive_buffers_one_per_microbatch_and_direction():
    from shardfit.estimate.model_parallel import pipeline_buffers

    plan = _pipeline_plan(4)
    layout, m = resolve(plan), 4
    boundary = 2 * 64 * plan.model.hidden_size * 4  # b x s x h x fp32
    first, middle, last = (pipeline_buffers(plan, layout, i == 0, i == 3, 4) for i in (0, 1, 3))
    assert first == last == m * boundary and middle == 2 * m * boundary  # activations in, gradients in
    assert pipeline_buffers(_pipeline_plan(1), resolve(_pipeline_plan(1)), True, True, 4) == 0
    sp = _pipeline_plan(2, sp=True)
    assert pipeline_buffers(sp, resolve(sp), True, False, 4) == m * boundary // 2  # SP: a 1/tp slice crosses
    # Kept in the optimizer step too (allocated once, reused every step): 4 more micro-batches, 4 more each way.
    more = plan.with_changes(parallelism=replace(plan.parallelism, pp_microbatches=8))
    four, eight = (stage_estimates(p, estimate, device="cpu", accounting="real")[1][2] for p in (plan, more))
    assert eight.phases["optimizer"]["temporaries"] - four.phases["optimizer"]["temporaries"] == middle


def test_gpipe_peaks_before_gradients_exist_and_holds_the_logits_on_the_last_stage():
    one_f, gpipe = (stage_estimates(_pipeline_plan(2, s), estimate, device="cpu", accounting="real") for s in ("1f1b", "gpipe"))
    for (_, _, a), (_, _, b) in zip(one_f, gpipe):
        assert b.phases["backward"]["grads"] == 0 < a.phases["backward"]["grads"]
        assert b.phases["optimizer"]["grads"] == a.phases["optimizer"]["grads"]
    logits = 2 * 64 * 320 * 4
    # Last stage: 1 micro-batch in flight under 1F1B, all 4 under GPipe, each with its logits kept.
    extra = gpipe[1][2].phases["backward"]["activations"] - one_f[1][2].phases["backward"]["activations"]
    per_micro = one_f[1][2].phases["backward"]["activations"] - logits
    assert extra == 3 * (per_micro + logits)


def test_zero_bubble_ranks_hold_their_own_waiting_microbatches():
    """ZB1P on 4 stages of one layer each: the middle ranks hold the same layers and the same micro-batches
    alive, but rank i waits on min(i + 1, m) weight gradients, each keeping one micro-batch's op-output
    gradients (estimate/split_backward.py): each rank is its own estimate, not a cached neighbour's."""
    from shardfit.estimate.split_backward import weight_grad_inputs

    plan = _pipeline_plan(4, "zero-bubble")
    stages = stage_estimates(plan, estimate, accounting="real", device="cpu", explain=True)
    held = [est.term("parallel.weight_grad_inputs").bytes for _, _, est in stages]
    one = weight_grad_inputs(plan.model, 1, False, False, 2 * 64, 4, 1)
    assert held[1:3] == [2 * one, 3 * one]  # ranks 1 and 2: same layers, same key before; 2 and 3 waiting
    assert held[0] == 2 * 64 * plan.model.hidden_size * 4  # the first stage keeps only the received gradient
    backward = [est.phases["backward"]["temporaries"] for _, _, est in stages]
    assert backward[2] - backward[1] == one
