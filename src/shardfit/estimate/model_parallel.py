"""Per-rank estimates beyond data parallelism: tensor (+ sequence), context and pipeline parallel.

One rank of a tp x cp x pp layout trains a smaller model: its pipeline stage's layers, each linear a
1/tp slice (transformers' `base_model_tp_plan`: q/k/v, gate/up colwise, o/down rowwise; norms
replicated), the embedding on the first stage and the head on the last (vocab-parallel: V/tp rows
each; the logits V/tp too under loss_parallel, gathered otherwise), over seq/cp tokens per sequence, with its states sharded over the dp_shard x cp ranks that
hold the same slice (FSDP2 over torchtitan's dp_shard_cp mesh; Megatron's distributed optimizer
over dp x cp). So each stage is estimated as that rank-local plan by the data-parallel estimator
(the engine-calibrated activation profile keeps the replicated tensors at full width and slices the
rest: Korthikanti's 10 + 24/t split), then:
- sequence parallel: what the norms between the TP regions save and a checkpointed block's input are
  split over tp too (estimate/sequence_parallel.py; Korthikanti et al. 2022 Table 2's 34/t + 5as/(ht)
  under "ideal" accounting);
- pipeline: the rank holds `in_flight_microbatches` micro-batches of activations (1F1B: p - i on
  rank i; interleaved: p(1 + (p-1)/(pv)) on the first; GPipe: all m, with no gradients yet), a
  receive buffer per micro-batch and chunk (torch.distributed.pipelining keeps them across steps)
  and, on the last stage, the logits of each micro-batch in flight;
- context parallel: the ring's K/V chunks in flight (its own and the one arriving, double-buffered)
  and the fp32 partial output + log-sum-exp the ring accumulates;
- "ideal" accounting: activations are the paper's formulas (estimate/korthikanti.py) instead.
The reported estimate is the rank with the highest peak; `stage_estimates` gives every stage.
- expert parallel: the experts / ep on a rank, balanced routing (estimate/expert_parallel.py).
A derived spec's rank is the derived spec of the config that rank runs (estimate/derived_parallel.py:
tp, cp, pipeline stages and expert parallel).
Not modelled yet (issue 14): TP's own communication buffers, routing imbalance. No torch here.
"""
from __future__ import annotations

from dataclasses import replace
from functools import partial

from shardfit.estimate import derived_parallel
from shardfit.estimate import korthikanti as kor
from shardfit.estimate import tp_head
from shardfit.estimate.activations import checkpointed_blocks
from shardfit.estimate.expert_parallel import expert_weights, with_experts_sharded
from shardfit.estimate.result import Estimate, Term
from shardfit.estimate.sequence_parallel import sharded_norm_bytes
from shardfit.estimate.split_backward import kept_input_grads, split_instants
from shardfit.estimate.states import block_linears
from shardfit.spec.model_spec import ModelSpec
from shardfit.spec.parallelism import (SPLIT_BACKWARD_SCHEDULES, V_SCHEDULES, Layout, Parallelism, holds_edges,
                                       in_flight_microbatches, resolve, stage_layers)
from shardfit.spec.plan import Cluster, Strategy, is_selective_ac, parse_activation_checkpointing


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def local_model(model: ModelSpec, layout: Layout, layers: int, first: bool, last: bool, tp: int | None = None,
                ep: int = 1) -> ModelSpec:
    """The model one rank trains: `layers` blocks sliced over tp, the embedding if first, the final norm
    and head if last. tp overrides the layout's (1: the unsliced stage, for sequence parallel). ep: the
    rank's num_experts / ep experts of each MoE block (sliced over tp too: Megatron's default expert
    tensor parallelism is the model's tp)."""
    t = layout.tp if tp is None else tp
    h, vocab = model.hidden_size, model.vocab_size
    linear_weights = sum(i * o * n for _, i, o, n in block_linears(model))
    colwise_bias = _colwise_biases(model, model.block_params - linear_weights)
    block = model.block_params - linear_weights - colwise_bias + (linear_weights + colwise_bias) // t
    if ep > 1:
        block -= expert_weights(model) // t - expert_weights(model) // (t * ep)
    embedding = vocab * h
    norm = h * (2 if model.norm == "layernorm" else 1)
    untied_head = 0 if model.tie_embeddings else embedding
    other = max(0, model.non_block_params - embedding - untied_head - norm)  # position embeddings, ...
    shard_rows = _ceil_div(vocab, t) * h  # Megatron pads the vocabulary to a multiple of tp
    emb_local = shard_rows
    non_block = 0
    if first:
        non_block += emb_local + other
    if last:
        non_block += norm
        # The head is colwise in both plans; tied, the last stage holds its own copy (Megatron) unless
        # the first stage is the same rank.
        if not (model.tie_embeddings and first):
            non_block += shard_rows
    # The largest single tensor (single-tensor AdamW's scratch): a sliced linear or a vocab shard.
    largest = max([o * i // t for _, i, o, n in block_linears(model)] + [shard_rows if (first or last) else 0, 1])
    local_vocab = (_ceil_div(vocab, t) if layout.loss_parallel else vocab) if last else 0
    return replace(model, name=f"{model.name}[rank]", n_params=layers * block + non_block, num_layers=layers,
                   num_experts=model.num_experts // ep,
                   num_heads=model.num_heads // t, num_kv_heads=(model.num_kv_heads or model.num_heads) // t,
                   head_dim=model.head_dim or h // max(model.num_heads, 1),
                   intermediate_size=model.intermediate_size // t if model.intermediate_size else 0,
                   vocab_size=local_vocab, block_params=block, non_block_params=non_block,
                   largest_layer_params=largest)


def _colwise_biases(model: ModelSpec, outside_weights: int) -> int:
    """The biases a colwise linear shards with its weight (those of rowwise linears, h wide, stay
    whole): q/k/v (Qwen2, Llama attention_bias), gate/up (mlp_bias), GPT-2's c_attn / c_fc, BERT's
    query/key/value / intermediate. `outside_weights`: a block's parameters other than its weights."""
    h, hd = model.hidden_size, model.head_dim or model.hidden_size // max(model.num_heads, 1)
    inter = model.intermediate_size or 4 * h
    norms = 4 * h if model.norm == "layernorm" else (4 if model.family == "gemma2" else 2) * h
    biases = max(0, outside_weights - norms)
    if model.family in ("gpt2", "bert"):
        return min(biases, 3 * h + inter)
    qkv = (model.num_heads + 2 * (model.num_kv_heads or model.num_heads)) * hd
    colwise = qkv if biases >= qkv else 0
    if biases - colwise >= 2 * inter:
        colwise += 2 * inter
    return colwise


def local_plan(plan, layout: Layout, model: ModelSpec):
    """The data-parallel plan whose estimate is this rank's: dp x cp ranks share its states, sharded
    over dp_shard x cp; seq_len / cp tokens per sequence."""
    c, s = plan.cluster, plan.strategy
    ranks, shard = layout.dp * layout.cp, layout.dp_shard * layout.cp
    nodes = c.nodes if ranks % c.nodes == 0 else 1
    cluster = Cluster(nodes=nodes, gpus_per_node=ranks // nodes, gpu=c.gpu, host_memory_gib=c.host_memory_gib)
    if s.kind == "fsdp2" and layout.tp > 1:
        s = replace(s, embedding_units="root")  # what engines/fsdp2.py wraps under TP (spec/fsdp_units.py)
    if s.kind == "fsdp2" and 1 < shard < ranks:
        s = replace(s, sharding="hybrid_shard", shard_group_size=shard)
    elif s.kind == "fsdp2":
        s = replace(s, sharding="full_shard", shard_group_size=None)
    if s.kind == "ddp" and ranks == 1:
        # One rank per stage (or per TP group): no replica to reduce with, so no wrapper and no reducer
        # bucket (engines/pipeline.py runs the stage bare), which is `single`.
        s = Strategy(kind="single")
    training = replace(plan.training, seq_len=plan.training.seq_len // layout.cp)
    return replace(plan, model=model, cluster=cluster, strategy=s, training=training, parallelism=Parallelism())


def _act_terms(est: Estimate) -> int:
    """One micro-batch's saved activations (blocks + head) from an explained estimate."""
    return est.term("activations.blocks").bytes + est.term("activations.head").bytes


def _paper_activations(plan, layout: Layout, layers: int, first: bool, last: bool) -> float:
    """Korthikanti et al.'s bytes for one micro-batch through this rank's layers (ideal accounting)."""
    m, t = plan.model, plan.training
    s, b = t.seq_len // layout.cp, t.micro_batch
    every = parse_activation_checkpointing(t.activation_checkpointing)
    full = 0 if is_selective_ac(t.activation_checkpointing) else checkpointed_blocks(layers, every)
    # Flash attention (sdpa) never stores the s^2 scores: the paper's selective-recompute saving.
    kept = "selective" if (t.attention == "sdpa" or is_selective_ac(t.activation_checkpointing)) else "none"
    args = (s, b, m.hidden_size, m.num_heads, layout.tp)
    total = kor.layer_activation_bytes(*args, sp=layout.sequence_parallel, recompute=kept,
                                       ffn=m.intermediate_size or None) * (layers - full)
    total += kor.layer_activation_bytes(*args, sp=layout.sequence_parallel, recompute="full") * full
    if first:
        total += s * b * m.hidden_size / layout.tp  # embedding dropout mask
    if last:
        total += 4 * s * b * m.hidden_size / layout.tp * (1 + m.vocab_size / m.hidden_size)
    return total


def pipeline_buffers(plan, layout: Layout, first: bool, last: bool, d: int, stage: int = 0) -> int:
    """Receive buffers of one pipeline rank, bytes (0 without a pipeline). torch.distributed.pipelining
    allocates a receive buffer per micro-batch and per stage chunk, once, and keeps it across steps:
    the boundary activation on every chunk but the model's first, its gradient on every chunk but the
    model's last. NOTE: step() would also keep every micro-batch's output (the logits) on the last
    stage until the next step (m*b*s*V*d) for its return value; shardfit's engine passes
    return_outputs=False, so that is not counted. Measured on tiny-llama, pp=2, m=4, 1F1B and GPipe,
    2 CPU ranks (tests/engines/test_pipeline.py)."""
    if layout.pp == 1:
        return 0
    t = plan.training
    tokens = t.micro_batch * (t.seq_len // layout.cp)
    boundary = tokens * plan.model.hidden_size * d // (layout.tp if layout.sequence_parallel else 1)
    buffers = layout.microbatches * (2 * layout.virtual - first - last) * boundary
    return buffers + kept_input_grads(layout, stage, boundary)


def _stage(plan, layout: Layout, rank_estimate, stage: int, layers: int, options: dict, explain: bool) -> Estimate:
    model, t = plan.model, plan.training
    first, last = holds_edges(stage, layout.pp, layout.virtual, layout.schedule)
    rank_model, est = rank_estimate(layers, first, last, None)
    if layout.ep > 1:
        _, sharded = rank_estimate(layers, first, last, None, layout.ep)
        est = with_experts_sharded(plan, layout, est, sharded, t.micro_batch * (t.seq_len // layout.cp),
                                    4 if t.precision == "fp32" else 2)
    one = _act_terms(est)
    in_flight = in_flight_microbatches(layout, stage)
    paper = options["accounting"] == "ideal"
    d = 4 if t.precision == "fp32" else 2
    b, s = t.micro_batch, t.seq_len // layout.cp
    # The residual stream's dtype: fp32 under autocast (the adds promote), the parameters' under
    # FSDP's mixed precision. What crosses a stage boundary (the p2p buffers) is that stream.
    res = 4 if (t.precision == "fp32" or (plan.strategy.kind in ("ddp", "single") and t.precision != "bf16-pure")) else 2
    # torch's sequence parallel (engines/sequence_parallel.py): what the norms between the TP regions
    # save, and a checkpointed block's input (the residual stream), are sequence shards; the rest of
    # the TP rank's activations stay (the colwise inputs are the all-gathered sequence, as big as the
    # norm outputs they replace; SAC's kept rowwise outputs are the partial sums before the
    # reduce-scatter). estimate/sequence_parallel.py. Per micro-batch, bytes.
    sp_saved = 0
    if layout.sequence_parallel and not paper:
        per_layer, final_norm, extra = sharded_norm_bytes(rank_model, est.term("activations.block").inputs["regime"])
        selective = is_selective_ac(t.activation_checkpointing)
        kept = layers if selective else checkpointed_blocks(layers, parse_activation_checkpointing(t.activation_checkpointing))
        per_token = (layers - kept) * per_layer + kept * res * model.hidden_size + (final_norm if last else 0)
        # Owners that share one normed input under TP alone each keep their own gathered copy under SP.
        sp_saved = int(b * s * (per_token * (1 - 1 / layout.tp) - (layers - kept) * extra * res * model.hidden_size))
    per_micro = _paper_activations(plan, layout, layers, first, last) if paper else one - sp_saved
    # A zero-bubble schedule's instants (estimate/split_backward.py): phase -> (micro-batches alive,
    # bytes waiting for their W, activations their input-gradient pass freed).
    head = est.term("activations.head").bytes if last and layout.pp > 1 and not paper else 0
    split = split_instants(layout, stage, rank_model, layers, first, last, b * s, d, per_micro, head,
                           model.vocab_size)
    p2p = pipeline_buffers(plan, layout, first, last, res, stage)
    # The last stage's output (the logits) of each micro-batch in flight, which the stage keeps in its
    # forward cache to run that micro-batch's backward from the loss; the rank-local data-parallel
    # profile frees the logits at the loss. Measured: +2% over on tiny-llama under 1F1B and GPipe.
    head_in_flight = 1 if layout.schedule in V_SCHEDULES else in_flight
    kept_logits = (int(head_in_flight * b * s * model.vocab_size * d) // (layout.tp if layout.loss_parallel else 1)
                   if last and layout.pp > 1 else 0)
    # torch's DTensor TP of the vocab-parallel embedding (RowwiseParallel over the rows, replicated
    # ids) gives its weight a Replicate gradient of the full V x h (the embedding backward's sharding
    # strategy), beside the Shard(0) parameter: without an FSDP wrapper to reduce-scatter it, that
    # gradient stays whole until the step. Measured (pp 2 x tp 2, 4 CPU ranks): 81,920 B for a
    # 40,960-B shard, stage 0, every phase with gradients.
    # (Megatron's own vocab-parallel embedding keeps its gradient local: not under "ideal" accounting.)
    embedding_grad = 0
    if first and layout.tp > 1 and options["accounting"] != "ideal" and local_plan(plan, layout, rank_model).strategy.kind in ("single", "ddp"):
        grad_d = 2 if t.precision.endswith("-pure") else 4
        embedding_grad = (model.vocab_size - _ceil_div(model.vocab_size, layout.tp)) * model.hidden_size * grad_d
    kvd = (model.num_kv_heads or model.num_heads) // layout.tp * (model.head_dim or model.hidden_size // model.num_heads)
    qd = model.num_heads // layout.tp * (model.head_dim or model.hidden_size // model.num_heads)
    # Ring attention: K and V chunks of s/cp tokens, the rank's own and the arriving one (double
    # buffer), and the fp32 partial output + log-sum-exp merged after every step.
    ring = (4 * b * s * kvd * d + b * s * (qd + model.num_heads // layout.tp) * 4) if layout.cp > 1 else 0
    # Measured (FSDP2 x TP, 4 CPU ranks): the embedding's all-reduced output (RowwiseParallel's
    # Partial -> Replicate) is held by the functional collective's wrapper, which the tracker sees as
    # a temporary although block 0 saves it.
    embedding_out = b * s * model.hidden_size * res if first and layout.tp > 1 and not paper else 0
    vocab_scratch = tp_head.loss_parallel_scratch(model.vocab_size, layout, b * s) if last and not paper else 0
    scratch_phases = tp_head.scratch_phases(t.activation_checkpointing)
    # FSDP2 under a pipeline: torch.distributed.pipelining skips resharding after backward and the
    # gradient reduce-scatter on every micro-batch but the last (stage.py, backward_maybe_with_nosync),
    # so the stage's unsharded gradients live from the first backward to the step. FSDP2 accumulates
    # them in the reduce dtype (fp32 in shardfit's engines) when it differs from the parameters'
    # (FSDPParam.to_accumulated_grad_if_needed): fp32 under bf16 too. Measured (pp 2 x dp 2, bf16):
    # 451,584 B of fp32 accumulated gradients on stage 0, which the tracker files as temporaries.
    held = rank_model.n_params * 4 if (layout.pp > 1 and plan.strategy.kind == "fsdp2"
                                       and layout.dp_shard * layout.cp > 1 and layout.microbatches > 1) else 0
    # GPipe runs every forward before the first backward: its peak is at that backward, with all m
    # micro-batches' activations and no gradient allocated yet (the step before freed them:
    # zero_grad(set_to_none)), unless the gradients outweigh the m - 1 micro-batches freed by then.
    # Measured (tests/engines/test_pipeline.py): 0 and 45,056 B of 451,584 B of gradients at that peak.
    no_grads = layout.pp > 1 and layout.schedule == "gpipe" and per_micro * (in_flight - 1) >= est.phases["backward"]["grads"]
    # With the reshard and reduce-scatter deferred, every unit of the stage stays gathered from its
    # first forward to the last micro-batch's backward and no gradient is reduced before then: the
    # stage runs like an unwrapped replica whose parameters are gathered copies. Its forward and
    # backward split is DDP's with the gathered stage (params x param dtype) in place of the
    # reducer's bucket. Measured (pp 2 x dp 2, fp32): FSDP2's temporaries equal DDP's to 4 B.
    # In bf16 FSDP2 casts the gathered parameters (no autocast: bf16 residuals and no weight copies),
    # which is the unwrapped stage in pure bf16: its temporaries, with the gathered bf16 stage in place
    # of the bucket; the activations stay FSDP2's own (within 4.4% measured, where the pure-bf16
    # replica's are not). Measured (pp 2 x dp 2, bf16): grads + temporaries within 3.5% per phase.
    replica = None
    if held and t.precision in ("fp32", "bf16"):
        _, ddp = rank_estimate(layers, first, last, None, 1, "ddp", None if t.precision == "fp32" else "bf16-pure")
        gathered = rank_model.n_params * d - ddp.term("temporaries.ddp_buckets").bytes
        replica = {name: {"activations": (ddp if t.precision == "fp32" else est).phases[name]["activations"],
                          "temporaries": ddp.phases[name]["temporaries"] + gathered}
                   for name in ("forward", "backward")}
    phases = {}
    for name, cats in est.phases.items():
        cats = dict(cats)
        if replica and name in replica:
            cats.update(replica[name])
        if name in ("forward", "backward") and no_grads:
            cats["grads"] = 0
        if name in ("forward", "backward") and held:
            # Until the last micro-batch's reduce-scatter the stage's gradients are only these unsharded
            # ones (the sharded ones of the step before were set to None; the unit's own unsharded grads
            # are the same buffers). Measured (pp 2 x dp 2): 451,584 B in both phases, = held.
            cats["grads"] = held
        if name in ("forward", "backward", "optimizer"):  # allocated by the first step, kept for the next
            cats["temporaries"] += p2p
            if cats["grads"]:
                cats["grads"] += embedding_grad
        if name in ("forward", "backward"):
            cats["activations"] += kept_logits
        if name in ("forward", "backward"):
            alive, waiting, freed = split.get(name, (in_flight, 0, 0))
            if paper:
                cats["activations"] = int(per_micro * alive)
            else:
                cats["activations"] = int(max(0, cats["activations"] - sp_saved) + per_micro * (alive - 1) - freed)
            moved = min(embedding_out, cats["activations"])
            cats["activations"] -= moved
            cats["temporaries"] += ring + moved + waiting + (vocab_scratch if name in scratch_phases else 0)
        phases[name] = cats
    if vocab_scratch and layout.pp == 1 and t.activation_checkpointing == "none":
        phases["backward"] = tp_head.loss_parallel_backward(phases["forward"], model.vocab_size, layout, b * s, d)
    if last and layout.tp > 1 and not layout.loss_parallel and not paper:
        phases["forward"] = tp_head.logits_gather_instant(est, phases["forward"], rank_model, b * s, d, layout.tp,
                                                          int(kept_logits // max(in_flight, 1)), sp_saved)
    notes = (f"layout {layout.describe()}: pipeline rank {stage} of {layout.pp} holds {layers} layers"
             f"{' + embedding' if first else ''}{' + head' if last else ''}, {in_flight:g} micro-batch(es) of "
             f"activations in flight ({layout.schedule if layout.pp > 1 else 'no pipeline'})",
             f"each linear 1/{layout.tp} (colwise q/k/v/gate/up, rowwise o/down), norms replicated; "
             f"vocab-parallel embedding, {'vocab-parallel loss' if layout.loss_parallel else 'gathered logits (colwise_gather_output)'}; "
             f"states sharded over dp_shard x cp = {layout.dp_shard * layout.cp} ranks",
             "not modelled: TP/CP/PP collectives' own buffers beyond the ring and p2p ones")
    extra = ()
    if explain:
        extra = (Term(name="parallel.activations_per_microbatch", bytes=int(per_micro),
                      formula="Korthikanti Table 2 (ideal) | rank-local profile - SP-sharded norms",
                      inputs={"sp_sharded": sp_saved, "in_flight": in_flight, "layers": layers},
                      source="Korthikanti et al. 2022 sec. 4; Narayanan et al. 2021 (1F1B)"),
                 Term(name="parallel.p2p_buffers", bytes=p2p, formula="m*(2v - first - last)*b*(s/cp)*h*d (/t under SP)",
                      inputs={"microbatches": layout.microbatches, "virtual": layout.virtual},
                      source="torch.distributed.pipelining stage.py: a receive buffer per micro-batch and chunk"),
                 Term(name="parallel.loss_parallel_scratch", bytes=vocab_scratch, formula="last stage: b*(s/cp)*(V/t)*4",
                      source="torch.distributed.tensor.parallel loss_parallel: the log-softmax in steps over the shard"),
                 Term(name="parallel.weight_grad_inputs", bytes=split.get("backward", (0, 0))[1],
                      formula="waiting chunk micro-batches x b*(s/cp)*(block op-output widths + head)*d",
                      source="torch.distributed.pipelining _backward.py: stage_backward_input keeps them for W"),
                 Term(name="parallel.pp_kept_logits", bytes=kept_logits, formula="last stage: in_flight*b*(s/cp)*V*d",
                      inputs={"in_flight": in_flight}, source="torch.distributed.pipelining stage.py fwd_cache"),
                 Term(name="parallel.sp_sharded", bytes=sp_saved,
                      formula="(1 - 1/tp)*b*(s/cp)*(norms' saved bytes per layer not recomputed + h*d per checkpointed "
                              "block + the final norm's)",
                      inputs={"layers": layers, "tp": layout.tp},
                      source="torch SequenceParallel on the norms between the TP regions (estimate/sequence_parallel.py)"),
                 Term(name="parallel.tp_embedding_grad", bytes=embedding_grad,
                      formula="first stage, tp > 1, no FSDP: (V - V/tp)*h*grad dtype",
                      inputs={"tp": layout.tp}, source="torch DTensor embedding backward: a Replicate V x h gradient"),
                 Term(name="parallel.pp_unsharded_grads", bytes=held, formula="stage params * d (fsdp2, pp > 1)",
                      inputs={"microbatches": layout.microbatches},
                      source="torch.distributed.pipelining stage.py: no reshard / grad sync before the last micro-batch"),
                 Term(name="parallel.cp_ring", bytes=ring, formula="4*b*(s/cp)*kv_dim*d + b*(s/cp)*(q_dim + heads)*4",
                      inputs={"cp": layout.cp}, source="ring attention (Liu et al. 2023), torch context_parallel"))
    return replace(est, phases=phases, strategy=plan.strategy.label, terms=est.terms + extra,
                   assumptions=notes + est.assumptions)


def stage_estimates(plan, estimate_fn, **options) -> list[tuple[int, int, Estimate]]:
    """[(pipeline rank, its layers, its Estimate)] for every rank of the plan's layout."""
    model = plan.model
    layout = resolve(plan)
    if model.derived:
        derived_parallel.check_layout(model, layout)
    layers = stage_layers(model.num_layers, layout.pp, layout.virtual, layout.schedule)
    explain = options.pop("explain", False)
    seen: dict = {}
    local: dict = {}

    def rank_estimate(count: int, first: bool, last: bool, tp: int | None, ep: int = 1, kind: str | None = None,
                      precision: str | None = None, stage: int = 0):
        # NOTE: stages that differ only in the micro-batches they hold in flight train the same
        # rank-local plan: it is built and estimated once (fit estimates hundreds of layouts). A derived
        # spec's stages may hold different layer kinds: keyed by stage.
        key = (count, first, last, tp, ep, kind, precision, stage if model.derived else 0)
        if key not in local:
            if model.derived:  # the config a rank runs, derived and traced (estimate/derived_parallel.py)
                rank_model = derived_parallel.local_model(model, layout.tp if tp is None else tp, layout.loss_parallel)
                indices = derived_parallel.rank_layer_indices(model.num_layers, layout.pp, layout.virtual, stage,
                                                              layout.schedule)
                rank_model = derived_parallel.stage_model(model, rank_model, indices, first, last)
                if ep > 1:
                    rank_model = derived_parallel.expert_sharded(rank_model, ep)
            else:
                rank_model = local_model(model, layout, count, first, last, tp=tp, ep=ep)
            rank_plan = local_plan(plan, layout, rank_model)
            if kind is not None:
                rank_plan = replace(rank_plan, strategy=Strategy(kind=kind))
            if precision is not None:
                rank_plan = replace(rank_plan, training=replace(rank_plan.training, precision=precision))
            local[key] = rank_model, estimate_fn(rank_plan, explain=True, **options)
        return local[key]

    out = []
    for stage, count in enumerate(layers):
        in_flight = in_flight_microbatches(layout, stage)
        key = (count, *holds_edges(stage, layout.pp, layout.virtual, layout.schedule), in_flight)
        if model.derived or layout.schedule in SPLIT_BACKWARD_SCHEDULES:
            key += (stage,)  # a zero-bubble rank's waiting micro-batches depend on its index too
        if key not in seen:
            seen[key] = _stage(plan, layout, partial(rank_estimate, stage=stage), stage, count, options, explain)
        out.append((stage, count, seen[key]))
    return out


def estimate_model_parallel(plan, estimate_fn, **options) -> Estimate:
    """The estimate of the plan's most loaded rank (highest device peak over pipeline ranks)."""
    explain = options.get("explain", False)
    stages = stage_estimates(plan, estimate_fn, **options)
    stage, layers, worst = max(stages, key=lambda item: item[2].device_peak_bytes)
    peaks = ", ".join(f"{s}:{e.device_peak_bytes / 2**30:.1f}" for s, _, e in stages)
    note = f"most loaded pipeline rank: {stage} (device peak GiB per rank {peaks})"
    if not explain:
        return replace(worst, terms=(), assumptions=())
    return replace(worst, assumptions=(note,) + worst.assumptions)
