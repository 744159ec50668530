"""estimate(plan) -> Estimate: per-rank bytes by phase and category, composed from the term functions
in states.py, activations.py, temporaries.py and overhead.py.

Accounting modes:
- "real" (default): what the engines really allocate (fp32 master/grad partitions, buckets, gathered
  units, DeepSpeed's persistent buffers, the loss upcast, CUDA context...).
- "ideal": the ZeRO paper's model-state formulas (2P + 2P + K*P/N ...), no buffers, no overhead.
- "deepspeed": DeepSpeed's own estimator functions for zero2/zero3 (ideal for the other strategies).

Hot path: with explain=False nothing but integers is built, so `fit` can evaluate tens of thousands
of plans per second. explain=True also records every Term with its formula, inputs and source.
"""
from __future__ import annotations

from functools import lru_cache

from shardfit.errors import ShardfitError
from shardfit.estimate import activations as act
from shardfit.estimate import chunked_loss as closs
from shardfit.estimate import buffers as bufs
from shardfit.estimate import overhead as ovh
from shardfit.estimate import lora_sharding as lsh
from shardfit.estimate import model_parallel as mpar
from shardfit.estimate import states as sts
from shardfit.estimate import temporaries as tmp
from shardfit.estimate import selective as sel
from shardfit.estimate.accounting import deepspeed_estimator_states, ideal_states
from shardfit.estimate.buffers import Buffers
from shardfit.estimate.derived import evaluate
from shardfit.estimate.forward_timeline import inside_instants
from shardfit.estimate.result import Estimate, Term
from shardfit.spec.kernels import OPTIMIZER_IMPLS
from shardfit.spec.plan import is_selective_ac, parse_activation_checkpointing

ACCOUNTING = ("real", "ideal", "deepspeed")
CHECKPOINT_MODES = ("sharded", "full")
DEVICES = ("cuda", "cpu")


@lru_cache(maxsize=64)
def _every(text: str) -> int:
    return parse_activation_checkpointing(text)


@lru_cache(maxsize=64)
def _selective(text: str) -> bool:
    return is_selective_ac(text)


@lru_cache(maxsize=512)
def _model_facts(model, lora_key):
    """Trained params, frozen-base bytes and Adafactor's factored ratio: fixed for a model + LoRA."""
    if lora_key is None:
        return model.n_params, 0, sts.adafactor_ratio(model)
    rank, targets, base_dtype = lora_key
    unknown = sts.lora_unknown_targets(model, targets)
    if unknown:
        names = sorted({name for name, *_ in sts.model_linears(model)})
        raise ShardfitError(f"LoRA target '{unknown[0]}' is not a linear of {model.name}: use some of {', '.join(names)} or all-linear")
    trained = sts.lora_adapter_params(model, rank, targets)
    return trained, sts.frozen_base_bytes(model, base_dtype), 1.0


def precision_regime(precision: str, kind: str, lora) -> str:
    if precision == "fp32":
        return "fp32"
    # Source: peft prepare_model_for_kbit_training upcasts a QLoRA model's unquantized weights to fp32,
    # so single and DDP run it under torch.autocast like an fp32 model (bitsandbytes' layers compute in
    # bnb_4bit_compute_dtype inside); FSDP2's MixedPrecision casts it to 16-bit like any model.
    if lora is not None and lora.base_dtype in ("int8", "nf4") and kind in ("ddp", "single") and precision != "bf16-pure":
        return "autocast"
    # DDP and single keep fp32 parameters and run the forward under torch.autocast; the sharding
    # engines cast the parameters themselves (FSDP MixedPrecision, DeepSpeed's 16-bit model).
    if precision == "bf16-pure" or kind not in ("ddp", "single") or (lora is not None and lora.base_dtype != "fp32"):
        return "half"
    return "autocast"


def adapters_in_half(kind: str, regime: str, lora) -> bool:
    """Whether the engine hands peft 16-bit adapter weights at compute time: FSDP2's MixedPrecisionPolicy
    gathers every parameter (the fp32 adapters too) in param_dtype, DeepSpeed's bf16/fp16 mode casts the
    module. Then peft's adapter path saves no fp32 copy of its input (measured: tests/measure/
    test_engine_matrix.py LoRA rows in bf16). A quantized base keeps bitsandbytes' own casts."""
    return (lora is not None and regime == "half" and kind in ("fsdp2", "zero1", "zero2", "zero3")
            and lora.base_dtype not in ("int8", "nf4"))


def shard_degree(plan) -> int:
    """Ranks that share one copy of the sharded states."""
    s, c = plan.strategy, plan.cluster
    world = c.nodes * c.gpus_per_node
    if s.kind in ("single", "ddp"):
        return 1
    if s.kind == "fsdp":
        if s.sharding == "no_shard":
            return 1
        if s.sharding == "hybrid_shard":
            return s.shard_group_size or c.gpus_per_node
        return world
    if s.kind == "fsdp2":
        return s.shard_group(c.gpus_per_node) or world
    return world


def estimate(plan, *, accounting: str = "real", device: str = "cuda", checkpoint: str = "sharded",
             optimizer_impl: str | None = None, explain: bool = False) -> Estimate:
    """Per-rank device bytes by phase and category for a (validated) plan.

    device "cpu" drops the CUDA-only overhead and uses the CPU kernels' dtypes (dropout masks).
    optimizer_impl "auto": torch's CUDA default (foreach) for DDP/FSDP and FusedAdam for DeepSpeed on
    cuda; the single-tensor loop on cpu (what `shardfit train` runs: foreach=False everywhere).
    None: the plan's training.optimizer_impl."""
    optimizer_impl = optimizer_impl or plan.training.optimizer_impl
    if accounting not in ACCOUNTING:
        raise ShardfitError(f"accounting '{accounting}' is not known: use one of {', '.join(ACCOUNTING)}")
    if optimizer_impl not in OPTIMIZER_IMPLS:
        raise ShardfitError(f"optimizer_impl '{optimizer_impl}' is not known: use one of {', '.join(OPTIMIZER_IMPLS)}")
    if checkpoint not in CHECKPOINT_MODES:
        raise ShardfitError(f"checkpoint '{checkpoint}' is not known: use sharded or full")
    if not plan.parallelism.is_default:  # tp / cp / pp: per-rank local plans (estimate/model_parallel.py)
        return mpar.estimate_model_parallel(plan, estimate, accounting=accounting, device=device, checkpoint=checkpoint,
                                            optimizer_impl=optimizer_impl, explain=explain)
    model, s, t, c = plan.model, plan.strategy, plan.training, plan.cluster
    kind, precision, optimizer, lora = s.kind, t.precision, t.optimizer, t.lora
    world = c.nodes * c.gpus_per_node
    shard = shard_degree(plan)
    lora_key = None if lora is None else (lora.rank, tuple(lora.target_modules), lora.base_dtype)
    trained, frozen_bytes, factored = _model_facts(model, lora_key)
    if lora is not None and kind.startswith("zero") and precision in ("bf16", "fp16") and lora.base_dtype == "fp32":
        # DeepSpeed's bf16 / fp16 mode casts the whole module, the frozen fp32 base too (measured: engine matrix).
        frozen_bytes = sts.frozen_base_bytes(model, "bf16")
    if optimizer == "adamw8bit":
        factored = sts.eightbit_fraction(model, *(lora_key[:2] if lora_key else ()))
    terms: list | None = [] if explain else None
    loss_grads = 0  # the head's weight gradient during a chunked loss's backward
    notes: list | None = [] if explain else None

    def term(name, value, formula, inputs, source):
        terms.append(Term(name=name, bytes=int(value), formula=formula, inputs=inputs, source=source))

    # ---- activations (shared by every accounting mode) ----
    tokens, seq = t.micro_batch * t.seq_len, t.seq_len
    regime = precision_regime(precision, kind, lora)
    if model.has_shape:
        # FSDP1 LoRA: the frozen base weights are views of a FlatParameter that requires grad, so autograd
        # saves what a full fine-tune saves (estimate/lora_sharding.py); a quantized base is not flattened with it.
        acts_lora = None if kind == "fsdp" and lora is not None and lora.base_dtype not in ("nf4", "int8") else lora
        prof = act.activation_profile(model, regime, t.attention, acts_lora, device, kind == "zero3", seq=seq,
                                      adapters_half=adapters_in_half(kind, regime, lora))
        every = _every(t.activation_checkpointing)
        n_ckpt = act.checkpointed_blocks(model.num_layers, every)
        kept = (sel.selective_kept(model, regime, t.attention, acts_lora, device)
                if n_ckpt and _selective(t.activation_checkpointing) else (0.0, 0.0))
        a_blocks, a_head, a_block = act.saved_activation_bytes(prof, tokens, seq, model.num_layers, n_ckpt, kept)
        loss_fwd = tmp.loss_forward_bytes(tokens, prof.loss_fwd_temp)
        loss_inputs = tmp.loss_label_bytes(t.micro_batch, seq)
        if regime == "autocast":
            loss_inputs += tmp.autocast_head_input_bytes(tokens, model.hidden_size)
        attn_fwd = int(prof.attn_fwd_temp_quad * tokens * seq)
        loss_bwd = tmp.loss_backward_bytes(tokens, prof.loss_bwd_temp)
        bwd_work = tmp.activation_grad_bytes(tokens, seq, prof.bwd_work, prof.bwd_work_quad)
        # Recompute rebuilds one block's saved tensors in backward; under selective checkpointing the
        # ones the policy kept are replayed from its cache, not rebuilt (they are in a_blocks already).
        kept_block = int(kept[0] * tokens + kept[1] * tokens * seq)
        recompute = max(0, a_block - kept_block) if n_ckpt else 0
        # Activations that exist before the head runs: embedding indices, rotary tables / positions.
        a_pre_head = a_head - int(tokens * sum(per for label, per, _ in prof.head_items
                                               if not label.startswith("embedding.")))
        if t.loss == "chunked":  # the head + loss per row chunk (estimate/chunked_loss.py)
            a_head, loss_fwd, loss_inputs, loss_bwd, loss_grads = closs.chunked_loss_bytes(
                model, regime, kind, t.micro_batch, seq, t.loss_chunks, lora is None, a_head, term if explain else None)
        # A checkpointed block saves nothing in forward but still builds its working set there: the
        # residual stream, the normed input and the widest intermediates (SwiGLU: gate, up, act) --
        # the same tensors whose gradients make up its backward working set -- and, where attention
        # materialises scores (eager, or SDPA's math path under dropout), its s^2 tensors.
        fwd_work = 0
        # Traced instants inside the last block (derived specs, no checkpointing): its saved tensors so
        # far, and every other live forward tensor (Bloom's gelu intermediates, masks built once).
        traced_inside = [] if n_ckpt or prof.forward_inside is None else [
            (a_blocks + a_pre_head + int(delta), int(temps))
            for delta, temps in inside_instants(*prof.forward_inside, evaluate, t.micro_batch, seq)]
        if n_ckpt == model.num_layers:
            fwd_work = int(tokens * prof.bwd_work + tokens * seq * prof.block_quad)
        if not fwd_work:
            # Without it, inside the last block its own saved tensors are not all built yet: the
            # instant is already bounded by a_blocks alone.
            a_pre_head = 0
        dequant = prof.dequant_temp
        # The cast cache lives until autocast exits (end of forward); backward keeps only the saved ones.
        wcopy_fwd = act.autocast_weight_copy_bytes(prof, model.num_layers, 0)
        wcopy = act.autocast_weight_copy_bytes(prof, model.num_layers, n_ckpt)
    else:
        prof = None
        n_ckpt = kept_block = a_blocks = a_head = a_block = loss_fwd = loss_inputs = attn_fwd = loss_bwd = bwd_work = a_pre_head = 0
        traced_inside = []
        fwd_work = 0
        recompute = dequant = wcopy = wcopy_fwd = 0
    if explain and prof is not None:
        term("activations.block", a_block, "b*s*sum(block tensors) + b*s^2*sum(quadratic tensors)",
             {"b": t.micro_batch, "s": seq, "regime": regime, "attention": t.attention,
              "per_token": prof.block, "per_token_per_s": prof.block_quad,
              "tensors": {label: [per, quad] for label, per, quad in prof.block_items}},
             "Korthikanti et al. 2022 adapted to the HF block (see activations.py)")
        term("activations.blocks", a_blocks, "(L - n_ckpt)*block + n_ckpt*b*s*(ckpt_input + selective kept)",
             {"L": model.num_layers, "n_ckpt": n_ckpt, "ckpt_input_per_token": prof.ckpt_input,
              "selective_kept_per_token": kept[0]},
             "full recompute keeps only the block input (Korthikanti et al. sec. 5); per-op selective "
             "checkpointing also keeps every other matmul output and the attention output (shardfit/sac.py)")
        if t.loss == "standard":  # the chunked loss's terms: estimate/chunked_loss.py
            term("activations.head", a_head, "b*s*(final norm + log_softmax fp32 + labels) + rotary",
                 {"per_token": prof.head,
                  "tensors": {label: per for label, per, _ in prof.head_items}},
                 "transformers ForCausalLMLoss: fp32 log_softmax saved for backward")
            term("temporaries.logits_and_upcast", loss_fwd, "b*s*V*d + b*s*V*4 when logits are 16-bit",
                 {"V": model.vocab_size, "tokens": tokens}, "lm_head output + ForCausalLMLoss logits.float()")
            term("temporaries.loss_inputs", loss_inputs, "24*b*s + 8*b (+ b*s*h*4 under autocast)",
                 {"b": t.micro_batch, "s": seq, "regime": regime},
                 "ForCausalLMLoss padded/shifted int64 labels; the fp32 final-norm output an autocast model still holds")
            term("temporaries.loss_backward", loss_bwd, "2 * b*s*V*4", {"V": model.vocab_size, "tokens": tokens},
                 "nll_loss and log_softmax gradients in fp32")
        if wcopy_fwd:
            term("temporaries.autocast_weight_copies", wcopy_fwd, "2*(block linear weights)*L + 2*V*h",
                 {"L": model.num_layers, "n_ckpt": n_ckpt}, "torch.autocast weight cast cache, saved for backward")
        term("temporaries.activation_grads", bwd_work, "b*s*(2*res*h + d*max(3*I, 2q+2kv)) (+ eager s^2 grads)",
             {"per_token": prof.bwd_work, "per_token_per_s": prof.bwd_work_quad},
             "one block's backward working set")
    elif explain:
        notes.append("no model shapes (--params): activations are not counted")

    # ---- model states and buffers ----
    gather_bytes = 2 if precision != "fp32" else 4
    unit = model.block_params or model.largest_layer_params or model.n_params
    root = model.non_block_params if model.block_params else 0
    largest = model.largest_layer_params or unit
    # LoRA: FSDP gathers the frozen base in its stored dtype, unless MixedPrecision casts it to 16-bit
    # (a float base under bf16 / fp16; bitsandbytes' packed uint8 is gathered as it is).
    if lora is not None and model.n_params and frozen_bytes and (precision == "fp32" or lora.base_dtype in ("int8", "nf4")):
        gather_bytes = frozen_bytes / model.n_params
    lp = 4 if precision == "fp32" else 2
    host: dict[str, int] = {}
    nvme = grads_step = 0
    grads_opt = params_opt = None  # the optimizer phase's own figures, where an engine differs
    use_ds = accounting == "deepspeed" and kind in ("zero2", "zero3")
    if accounting == "ideal" or (accounting == "deepspeed" and not use_ds):
        params, grads_full, opt = ideal_states(plan, shard, trained, frozen_bytes, factored, lp, host, term, notes)
        grads_persist = grads_full
        buf = Buffers()
    elif use_ds:
        params, grads_full, opt, temps = deepspeed_estimator_states(plan, largest, host, term, notes)
        grads_persist = grads_full
        buf = Buffers(temps)
        a_blocks = a_head = a_block = loss_fwd = loss_inputs = attn_fwd = loss_bwd = bwd_work = recompute = loss_grads = 0
        traced_inside = []
        wcopy = wcopy_fwd = 0
        a_pre_head = fwd_work = 0
    else:
        persistent = sts.zero3_persistent_params(model, s.param_persistence_threshold) if kind == "zero3" else 0
        engine = "fsdp" if kind in ("fsdp", "fsdp2") else kind
        st = sts.model_states(engine, shard, world, precision, optimizer, trained, frozen_bytes, factored,
                              s.offload_optimizer, s.offload_params, persistent, largest, explain,
                              s.ddp_gradient_as_bucket_view)
        params, opt = st.params, st.optimizer
        grads_persist, grads_full, grads_step = st.grads_persistent, st.grads_full, st.grads_step
        grads_opt, params_opt = st.grads_optimizer, st.params_optimizer
        host.update(st.host)
        nvme = st.nvme
        if explain:
            for name, value, formula, inputs, source in st.terms:
                term(f"states.{name}", value, formula, inputs, source)
        impl = optimizer_impl
        if impl == "auto":
            impl = "single" if device == "cpu" else ("fused" if kind.startswith("zero") else "foreach")
        rec = term if explain else None
        if kind in ("fsdp", "fsdp2"):
            lora_unit = None if lora is None else lsh.fsdp_lora_states(st, kind, model, lora, trained, shard, precision)
            opt, grads_full = st.optimizer, st.grads_full
            buf = bufs.fsdp_buffers(kind, s, model, precision, shard, unit, root, largest, gather_bytes, st, impl,
                                    optimizer, checkpoint, rec, lora_unit, lora)
            if explain and s.offload_params:
                notes.append("FSDP CPU offload: sharded params, grads and optimizer live in pinned host RAM; "
                             "the step runs on CPU")
        elif kind == "ddp":
            buf = bufs.ddp_buffers(s, model, st, impl, optimizer, largest, rec)
        elif kind == "single":
            buf = bufs.single_buffers(model, st, impl, optimizer, largest)
        elif kind == "zero3":
            buf = bufs.zero3_buffers(s, model, trained, world, lp, largest, impl, optimizer, rec)
        else:
            buf = bufs.zero12_buffers(s, st, trained, world, lp, largest, impl, optimizer, host, rec)
        if explain:
            term("temporaries.optimizer_step", buf.opt - buf.rest,
                 "foreach AdamW: trained_on_rank*state_bytes; single-tensor: (2*largest + previous)*state_bytes; fused: 0",
                 {"optimizer": optimizer, "impl": impl, "trained_on_rank": st.trained_per_rank},
                 "torch.optim _multi_tensor_adamw / _single_tensor_adamw; DeepSpeed step buffers")
        if dequant:
            for name in ("fwd_block", "fwd_loss", "start", "inside", "reduce", "last", "end"):
                setattr(buf, name, getattr(buf, name) + dequant)
            if explain:
                term("temporaries.qlora_dequant", dequant,
                     "nf4: W*compute_bytes + 4*W/64; int8: W*input_bytes (W: widest block linear)",
                     {"base": lora.base_dtype, "regime": regime},
                     "bitsandbytes gemm_4bit / MatMul4Bit.backward dequantize_4bit; MatMul8bitFp / MatMul8bitLt CB*SCB")
    if checkpoint == "full":
        host["checkpoint_consolidation"] = int(model.n_params * (4 + sts.optimizer_state_bytes_per_param(
            optimizer, 4, factored))) if lora is None else int(trained * 16 + frozen_bytes)
    # ---- phases ----
    if grads_opt is None:
        grads_opt = grads_full + grads_step
    if params_opt is None:
        params_opt = params
    if t.grad_accum > 1:
        # Gradients accumulate across micro-steps: the next forward runs with them allocated.
        grads_persist = max(grads_persist, grads_full)
    # Forward peaks at the loss (every activation + the logits) or inside the last block (its
    # gathered units / eager scores and, when checkpointed, its working set; no head activations
    # yet), whichever is larger.
    acts_f, fwd_temps = a_blocks + a_head, buf.fwd_loss + loss_fwd + loss_inputs + wcopy_fwd
    inside = (a_blocks + a_pre_head, buf.fwd_block + attn_fwd + wcopy_fwd + fwd_work)
    for candidate in [inside] + [(acts, buf.fwd_block + wcopy_fwd + temps) for acts, temps in traced_inside]:
        if sum(candidate) > acts_f + fwd_temps:
            acts_f, fwd_temps = candidate
    forward = {"params": params, "grads": grads_persist, "optimizer": opt,
               "activations": acts_f, "temporaries": fwd_temps}
    # Backward peaks at its start (all activations + loss gradients), inside the first block it
    # reaches (a recomputed block + one block's gradient working set), inside the last block (nearly
    # every gradient + that block's activations) or at its end (all gradients); the largest wins.
    acts_b, grads_b, temps_b = a_blocks + a_head, grads_persist + loss_grads, buf.start + loss_bwd + wcopy
    last_acts = ((prof.ckpt_input * tokens + kept_block if n_ckpt else a_block) + recompute
                 if prof is not None else 0)
    done = 1.0 - (model.block_params + model.vocab_size * model.hidden_size) / model.n_params \
        if model.has_shape and model.n_params else 0.0
    grads_last = grads_persist + int((grads_full - grads_persist) * max(done, 0.0))
    grads_reduced, acts_reduced = grads_persist, a_blocks
    if buf.grads_early is not None:  # allocated whole at the first reduction
        grads_reduced = grads_last = buf.grads_early
        # ...which comes only once reduce_bucket_size gradient elements exist: the head's, then those of
        # the last blocks, whose backward has already freed their activations (DeepSpeed ZeRO-1/2).
        if model.has_shape and model.block_params and model.num_layers:
            head = model.vocab_size * model.hidden_size
            blocks_done = min(model.num_layers, -(-max(0, s.reduce_bucket_size - head) // model.block_params))
            acts_reduced = int(a_blocks * (1 - blocks_done / model.num_layers))
    head_grad = buf.head_grad
    head_late = head_grad if buf.head_grad_late is None else buf.head_grad_late
    for cand in ((a_blocks + recompute, grads_persist + head_grad, buf.inside + bwd_work + wcopy),
                 (acts_reduced, grads_reduced + head_grad, buf.reduce + wcopy),
                 (last_acts, grads_last + head_late, buf.last + bwd_work),
                 (0, grads_full + head_late + buf.end_grads, buf.end)):
        if cand[0] + cand[1] + cand[2] > acts_b + grads_b + temps_b:
            acts_b, grads_b, temps_b = cand
    backward = {"params": params, "grads": grads_b, "optimizer": opt, "activations": acts_b, "temporaries": temps_b}
    rest = max(grads_persist, buf.grads_rest)
    phases = {
        "load": {"params": params, "grads": rest, "optimizer": opt, "activations": 0, "temporaries": buf.rest},
        "forward": forward,
        "backward": backward,
        "optimizer": {"params": params_opt, "grads": grads_opt, "optimizer": opt, "activations": 0,
                      "temporaries": buf.opt},
        "checkpoint": {"params": params, "grads": rest, "optimizer": opt, "activations": 0, "temporaries": buf.ckpt},
    }
    peak = params + opt + max(rest + buf.rest, grads_persist + acts_f + fwd_temps, grads_b + acts_b + temps_b,
                              grads_opt + buf.opt + params_opt - params, rest + buf.ckpt)
    if device == "cuda" and accounting == "real":
        hybrid = shard not in (1, world)
        overhead = {"cuda_context": ovh.cuda_context_bytes(),
                    "nccl": ovh.nccl_buffer_bytes(world, c.nodes, 2 if hybrid else 1),
                    "allocator_margin": ovh.allocator_margin_bytes(peak)}
    else:
        overhead = {"cuda_context": 0, "nccl": 0, "allocator_margin": 0}
    if explain:
        term("overhead.cuda_context", overhead["cuda_context"], "constant", {}, "CUDA context + cuBLAS workspace")
        term("overhead.nccl", overhead["nccl"], "per communicator (more across nodes)",
             {"world": world, "nodes": c.nodes}, "NCCL channel buffers")
        term("overhead.allocator_margin", overhead["allocator_margin"], f"{ovh.ALLOCATOR_MARGIN:g} * tensor peak",
             {"tensor_peak": peak}, "caching-allocator fragmentation")
        notes.extend(_assumptions(plan, regime, shard, accounting, device, checkpoint))
    warnings = ()
    if kind in ("fsdp", "fsdp2") and not model.block_params and accounting == "real" and shard > 1:
        warnings += ("FSDP without a block size wraps the whole model as one unit: every rank gathers all of it; "
                     "give --largest-layer or a model with shapes",)
    if c.host_memory_gib and host:
        per_node = sum(host.values()) * c.gpus_per_node
        if per_node > c.host_memory_gib * 1024**3:
            warnings += (f"host RAM: {per_node / 1024**3:.1f} GiB per node needed, {c.host_memory_gib:g} GiB available",)
    return Estimate(strategy=s.label, phases=phases, overhead=overhead, host=host, nvme_bytes=int(nvme),
                    terms=tuple(terms) if explain else (), assumptions=tuple(notes) if explain else (),
                    warnings=warnings)


def _assumptions(plan, regime, shard, accounting, device, checkpoint) -> list[str]:
    s, t = plan.strategy, plan.training
    out = [f"per rank; {plan.cluster.nodes}x{plan.cluster.gpus_per_node} ranks; states sharded over {shard}",
           f"activation dtype regime '{regime}' ({t.precision}, {s.kind})",
           f"micro-batch {t.micro_batch} x seq {t.seq_len}, activation checkpointing {t.activation_checkpointing}, "
           f"attention {t.attention}",
           f"checkpoint save: {checkpoint}; device: {device}; accounting: {accounting}",
           "loop does `loss = model(**batch).loss`: the logits are freed before backward" if t.loss == "standard" else
           f"chunked loss: head + cross-entropy in {t.loss_chunks} row chunks, logits recomputed in backward"]
    m = plan.model
    if m.derived:
        out.append(f"{m.model_class}: no hand-written rules; spec from a meta-device build, saved activations "
                   f"traced from its forward on fake tensors (CPU kernels), cached by config ({m.config_hash})")
    if m.num_experts:
        out.append(f"MoE: {m.experts_per_token} of {m.num_experts} experts per token; saved tensors count b*s*top_k "
                   f"routed rows (routing-independent); the backward working set assumes balanced routing")
    if _selective(t.activation_checkpointing):
        out.append("selective checkpointing: torchtitan's per-op policy (attention and every other mm kept; shardfit/sac.py)")
    if t.lora is not None:
        out.append(f"LoRA r={t.lora.rank} on {','.join(t.lora.target_modules)}: adapters fp32, base "
                   f"{t.lora.base_dtype} frozen")
        if t.lora.base_dtype in ("nf4", "int8"):
            out.append("QLoRA as peft sets it up: prepare_model_for_kbit_training keeps embeddings, norms and head in "
                       "fp32; its default gradient checkpointing is not assumed (the plan's activation_checkpointing is)")
    if s.kind == "single":
        out.append("single: one device, no wrapper: no reducer buckets, no collectives; grads live from backward "
                   "to zero_grad(set_to_none=True)")
    if s.kind == "ddp" and plan.cluster.world_size == 1 and not s.ddp_gradient_as_bucket_view:
        out.append("ddp on one GPU still allocates the reducer's flat bucket copy of every gradient: "
                   "strategy single trains the same way without it")
    if s.kind in ("zero1", "zero2", "zero3"):
        out.append("DeepSpeed: 16-bit params + fp32 master + fp32 grad partition at step; FusedAdam (no step scratch)")
    return out
