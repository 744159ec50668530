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
from shardfit.estimate import overhead as ovh
from shardfit.estimate import states as sts
from shardfit.estimate import temporaries as tmp
from shardfit.estimate.deepspeed_reference import zero2_model_states, zero3_model_states
from shardfit.estimate.result import Estimate, Term

ACCOUNTING = ("real", "ideal", "deepspeed")
OPTIMIZER_IMPLS = ("auto", "foreach", "single", "fused")
CHECKPOINT_MODES = ("sharded", "full")
DEVICES = ("cuda", "cpu")


@lru_cache(maxsize=64)
def _every(text: str) -> int:
    from shardfit.spec.plan import parse_activation_checkpointing
    return parse_activation_checkpointing(text)


@lru_cache(maxsize=512)
def _model_facts(model, lora_key):
    """Trained params, frozen-base bytes and Adafactor's factored ratio: fixed for a model + LoRA."""
    if lora_key is None:
        return model.n_params, 0, sts.adafactor_ratio(model)
    rank, targets, base_dtype = lora_key
    unknown = sts.lora_unknown_targets(model, targets)
    if unknown:
        names = sorted({name for name, *_ in sts.block_linears(model)})
        raise ShardfitError(f"LoRA target '{unknown[0]}' is not a linear of {model.name}: use some of {', '.join(names)} or all-linear")
    trained = sts.lora_adapter_params(model, rank, targets)
    return trained, sts.frozen_base_bytes(model, base_dtype), 1.0


def _regime(precision: str, kind: str, lora) -> str:
    if precision == "fp32":
        return "fp32"
    if precision == "bf16-pure" or kind != "ddp" or (lora is not None and lora.base_dtype != "fp32"):
        return "half"
    return "autocast"


def shard_degree(plan) -> int:
    """Ranks that share one copy of the sharded states."""
    s, c = plan.strategy, plan.cluster
    world = c.nodes * c.gpus_per_node
    if s.kind == "ddp":
        return 1
    if s.kind == "fsdp":
        if s.sharding == "no_shard":
            return 1
        if s.sharding == "hybrid_shard":
            return s.shard_group_size or c.gpus_per_node
        return world
    if s.kind == "fsdp2":
        return s.shard_group_size or world
    return world


def estimate(plan, *, accounting: str = "real", device: str = "cuda", checkpoint: str = "sharded",
             optimizer_impl: str = "auto", explain: bool = False) -> Estimate:
    """Per-rank device bytes by phase and category for a (validated) plan.

    device "cpu" drops the CUDA-only overhead and uses the CPU kernels' dtypes (dropout masks).
    optimizer_impl "auto": torch's CUDA default (foreach) for DDP/FSDP and FusedAdam for DeepSpeed on
    cuda; the single-tensor loop on cpu (what `shardfit train` runs: foreach=False everywhere)."""
    if accounting not in ACCOUNTING:
        raise ShardfitError(f"accounting '{accounting}' is not known: use one of {', '.join(ACCOUNTING)}")
    if optimizer_impl not in OPTIMIZER_IMPLS:
        raise ShardfitError(f"optimizer_impl '{optimizer_impl}' is not known: use one of {', '.join(OPTIMIZER_IMPLS)}")
    if checkpoint not in CHECKPOINT_MODES:
        raise ShardfitError(f"checkpoint '{checkpoint}' is not known: use sharded or full")
    model, s, t, c = plan.model, plan.strategy, plan.training, plan.cluster
    kind, precision, optimizer, lora = s.kind, t.precision, t.optimizer, t.lora
    world = c.nodes * c.gpus_per_node
    shard = shard_degree(plan)
    lora_key = None if lora is None else (lora.rank, tuple(lora.target_modules), lora.base_dtype)
    trained, frozen_bytes, factored = _model_facts(model, lora_key)
    terms: list | None = [] if explain else None
    notes: list | None = [] if explain else None

    def term(name, value, formula, inputs, source):
        terms.append(Term(name=name, bytes=int(value), formula=formula, inputs=inputs, source=source))

    # ---- activations (shared by every accounting mode) ----
    tokens, seq = t.micro_batch * t.seq_len, t.seq_len
    regime = _regime(precision, kind, lora)
    if model.has_shape:
        prof = act.activation_profile(model, regime, t.attention, lora, device)
        every = _every(t.activation_checkpointing)
        n_ckpt = act.checkpointed_blocks(model.num_layers, every)
        a_blocks, a_head, a_block = act.saved_activation_bytes(prof, tokens, seq, model.num_layers, n_ckpt)
        loss_fwd = tmp.loss_forward_bytes(tokens, prof.loss_fwd_temp)
        attn_fwd = int(prof.attn_fwd_temp_quad * tokens * seq)
        loss_bwd = tmp.loss_backward_bytes(tokens, prof.loss_bwd_temp)
        bwd_work = tmp.activation_grad_bytes(tokens, seq, prof.bwd_work, prof.bwd_work_quad)
        recompute = a_block if n_ckpt else 0
        dequant = prof.dequant_temp
        # The cast cache lives until autocast exits (end of forward); backward keeps only the saved ones.
        wcopy_fwd = act.autocast_weight_copy_bytes(prof, model.num_layers, 0)
        wcopy = act.autocast_weight_copy_bytes(prof, model.num_layers, n_ckpt)
    else:
        prof = None
        n_ckpt = a_blocks = a_head = a_block = loss_fwd = attn_fwd = loss_bwd = bwd_work = 0
        recompute = dequant = wcopy = wcopy_fwd = 0
    if explain and prof is not None:
        term("activations.block", a_block, "b*s*sum(block tensors) + b*s^2*sum(quadratic tensors)",
             {"b": t.micro_batch, "s": seq, "regime": regime, "attention": t.attention,
              "per_token": prof.block, "per_token_per_s": prof.block_quad,
              "tensors": {label: [per, quad] for label, per, quad in prof.block_items}},
             "Korthikanti et al. 2022 adapted to the HF block (see activations.py)")
        term("activations.blocks", a_blocks, "(L - n_ckpt)*block + n_ckpt*b*s*ckpt_input",
             {"L": model.num_layers, "n_ckpt": n_ckpt, "ckpt_input_per_token": prof.ckpt_input},
             "full recompute keeps only the block input (Korthikanti et al. sec. 5)")
        term("activations.head", a_head, "b*s*(final norm + log_softmax fp32 + labels) + rotary",
             {"per_token": prof.head,
              "tensors": {label: per for label, per, _ in prof.head_items}},
             "transformers ForCausalLMLoss: fp32 log_softmax saved for backward")
        term("temporaries.logits_and_upcast", loss_fwd, "b*s*V*d + b*s*V*4 when logits are 16-bit",
             {"V": model.vocab_size, "tokens": tokens}, "lm_head output + ForCausalLMLoss logits.float()")
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
    if lora is not None and model.n_params:
        gather_bytes = frozen_bytes / model.n_params if frozen_bytes else gather_bytes
    lp = 4 if precision == "fp32" else 2
    host: dict[str, int] = {}
    nvme = 0
    persist_t = fwd_t = bwd_t = opt_t = ckpt_t = bwd_end_extra = grads_rest = 0
    fwd_loss_t = fwd_block_t = t_start = t_inside = t_reduce = t_end = t_last = None  # None: fwd_t / bwd_t
    grads_early = None  # grads once backward reaches the blocks, where an engine allocates them at once
    head_grad = 0
    grads_opt = params_opt = None  # the optimizer phase's own figures, where an engine differs
    grads_persist = grads_full = grads_step = 0
    use_ds = accounting == "deepspeed" and kind in ("zero2", "zero3")
    if accounting == "ideal" or (accounting == "deepspeed" and not use_ds):
        stage = {"ddp": 0, "zero1": 1, "zero2": 2, "zero3": 3}.get(kind, 3)
        if kind == "fsdp" and s.sharding == "shard_grad_op":
            stage = 2
        if kind == "fsdp" and s.sharding == "no_shard":
            stage = 0
        params, grads_full, opt, k = sts.ideal_states(stage, shard if stage else 1, precision, optimizer,
                                                      trained, factored)
        params += int(frozen_bytes / (shard if stage >= 3 else 1))
        if s.offload_optimizer or (s.offload_params and kind in ("fsdp", "fsdp2")):
            host["offloaded_optimizer"] = opt
            opt = 0
        grads_persist = grads_full
        if explain:
            term("ideal.model_states", params + grads_full + opt,
                 "params 2P(/N at stage 3) + grads 2P(/N at stage>=2) + K*P(/N at stage>=1)",
                 {"stage": stage, "N": shard, "P": trained, "K": k, "lp": lp},
                 "ZeRO paper (Rajbhandari et al. 2020) sec. 5, Figure 1")
            notes.append(f"ideal accounting: ZeRO stage {stage} formulas; no buffers, no runtime overhead")
    elif use_ds:
        n = model.n_params
        per_node = c.gpus_per_node
        if kind == "zero2":
            cpu_mem, gpu_mem = zero2_model_states(n, per_node, c.nodes, cpu_offload=bool(s.offload_optimizer))
            params, temps = 2 * n, 0
        else:
            cpu_mem, gpu_mem, temps = zero3_model_states(n, largest, per_node, c.nodes,
                                                         cpu_offload=bool(s.offload_optimizer),
                                                         cpu_offload_params=bool(s.offload_params))
            params = int(2 * n / world) if (s.offload_optimizer and not s.offload_params) else 0
        opt = 0 if s.offload_optimizer else int(12 * n / world)
        grads_full = gpu_mem - params - temps - opt
        grads_persist = grads_full
        persist_t = temps
        fwd_t = bwd_t = opt_t = ckpt_t = temps
        host["deepspeed_estimate"] = int(cpu_mem / per_node)
        a_blocks = a_head = a_block = loss_fwd = attn_fwd = loss_bwd = bwd_work = recompute = wcopy = wcopy_fwd = 0
        if explain:
            term("deepspeed.model_states", gpu_mem,
                 "zero2: 2P + 18P/N; zero3: 4*largest + 18P/N (offload: 2P/N or 0)",
                 {"P": n, "largest_layer": largest, "gpus_per_node": per_node, "nodes": c.nodes,
                  "offload_optimizer": s.offload_optimizer, "offload_params": s.offload_params},
                 "DeepSpeed estimate_zero{2,3}_model_states_mem_needs")
            term("deepspeed.cpu_per_node", cpu_mem, "DeepSpeed's cpu figure (1.5 buffer factor)", {}, "DeepSpeed")
            notes.append("deepspeed accounting: DeepSpeed's own estimator (no activations, buckets or overhead)")
    else:
        persistent = sts.zero3_persistent_params(model, s.param_persistence_threshold) if kind == "zero3" else 0
        engine = "fsdp" if kind in ("fsdp", "fsdp2") else kind
        st = sts.model_states(engine, shard, world, precision, optimizer, trained, frozen_bytes, factored,
                              s.offload_optimizer, s.offload_params, persistent, largest, explain,
                              s.ddp_gradient_as_bucket_view)
        params, opt = st.params, st.optimizer
        grads_persist, grads_full, grads_step = st.grads_persistent, st.grads_full, st.grads_step
        if st.grads_optimizer is not None:
            grads_opt = st.grads_optimizer
        if st.params_optimizer is not None:
            params_opt = st.params_optimizer
        host.update(st.host)
        nvme = st.nvme
        if explain:
            for name, value, formula, inputs, source in st.terms:
                term(f"states.{name}", value, formula, inputs, source)
        impl = optimizer_impl
        if impl == "auto":
            impl = "single" if device == "cpu" else ("fused" if kind.startswith("zero") else "foreach")
        if kind in ("fsdp", "fsdp2"):
            reshard = (s.sharding != "shard_grad_op") if kind == "fsdp" else s.reshard_after_forward
            root_b = tmp.root_unit_bytes(root, gather_bytes)
            if kind == "fsdp" and s.sharding == "no_shard" and precision == "fp32":
                units_b = 0  # no gather, no low-precision copy: the full fp32 params are used in place
            elif reshard:
                units_b = tmp.gathered_unit_bytes(unit, gather_bytes, 2)
            else:
                units_b = tmp.all_units_gathered_bytes(model.n_params - root, gather_bytes)
            grad_b = tmp.unsharded_grad_bytes(unit, gather_bytes)
            root_grad_b = tmp.unsharded_grad_bytes(root, gather_bytes)
            # The root's head grad exists from the start of backward, its embedding grad only at the end.
            embed = 0 if model.tie_embeddings or not root else min(root, model.vocab_size * model.hidden_size)
            bwd_end_extra = tmp.unsharded_grad_bytes(embed, gather_bytes)
            root_grad_b -= bwd_end_extra
            # shardfit's engines reduce in fp32 under MixedPrecision (reduce_dtype=float32).
            reduce_b = 4 if precision in ("bf16", "fp16", "fp32") else 2
            rs_b = tmp.reduce_scatter_bytes(unit, shard, reduce_b, kind == "fsdp2" or reduce_b != gather_bytes)
            one_unit = tmp.gathered_unit_bytes(unit, gather_bytes, 1) if units_b else 0
            kept = 0 if reshard else units_b  # every unit stays gathered from forward to backward
            # At the loss, resharded blocks are freed (FSDP2 still holds one); backward starts with one
            # unit prefetched; inside a block two units, its full grad and the reduce-scatter buffers.
            fwd_block_t = root_b + units_b
            fwd_loss_t = root_b + (kept or (one_unit if kind == "fsdp2" else 0))
            fwd_t = fwd_block_t
            t_start = root_b + (kept or one_unit)
            # Inside a block: two units and the activation grads; once its backward is done, the
            # unit's full grad and the reduce-scatter buffers (the activation grads are gone by then).
            t_inside = root_b + units_b
            t_last = root_b + one_unit  # nothing left to prefetch at the last block
            t_reduce = root_b + units_b + grad_b + rs_b
            # The head's grad is a .grad of the root's (unsharded) params from the start of backward;
            # the root reshards before its reduce-scatter: its full grad + the reduce buffers remain.
            head_grad = root_grad_b
            t_end = tmp.reduce_scatter_bytes(root, shard, reduce_b, True)
            bwd_t = t_reduce
            if kind == "fsdp" and not s.offload_params:
                grads_rest = st.grads_full  # FSDP1 frees the flat sharded grad only at the next forward
            opt_t = tmp.optimizer_step_temp_bytes(optimizer, impl, st.trained_per_rank, st.state_bytes,
                                                  (largest if kind == "fsdp2" else unit) // shard + 1)
            ckpt_t = tmp.checkpoint_save_bytes(checkpoint, max(unit, root), st.state_bytes)
            if explain:
                term("temporaries.fsdp_root_unit", root_b, "non_block_params*gather_bytes",
                     {"non_block_params": root, "gather_bytes": gather_bytes},
                     "FSDP keeps the root (embeddings, head) gathered from forward to backward")
                term("temporaries.fsdp_gathered_units", units_b,
                     "2*unit*gather_bytes" if reshard else "(P - root)*gather_bytes",
                     {"unit": unit, "gather_bytes": gather_bytes, "reshard_after_forward": reshard},
                     "FSDP all-gather of the current unit plus the prefetched one")
                term("temporaries.fsdp_unsharded_grads", grad_b + root_grad_b + bwd_end_extra,
                     "(unit + root)*gather_bytes (the embedding's part only at the end of backward)",
                     {"unit": unit, "root": root, "embedding": embed}, "FSDP backward: full grads before reduce-scatter")
                term("temporaries.fsdp_reduce_scatter", rs_b, "unit/S*(reduce + sharded grad bytes)",
                     {"unit": unit, "S": shard}, "FSDP reduce-scatter output and its cast")
                if s.offload_params:
                    notes.append("FSDP CPU offload: sharded params, grads and optimizer live in pinned host RAM; the step runs on CPU")
        elif kind == "ddp":
            view = s.ddp_gradient_as_bucket_view
            bucket = tmp.ddp_bucket_bytes(st.grads_full, bucket_view=view)
            persist_t = bucket
            opt_t = tmp.optimizer_step_temp_bytes(optimizer, impl, st.trained_per_rank, st.state_bytes, largest)
            fwd_t, bwd_t, ckpt_t = bucket, bucket, bucket
            opt_t += bucket
            if explain:
                term("temporaries.ddp_buckets", bucket, "grad bytes (0 with gradient_as_bucket_view)",
                     {"gradient_as_bucket_view": view, "bucket_cap_mb": s.ddp_bucket_cap_mb},
                     "torch DDP Reducer: flat buckets covering every gradient, allocated at wrap time")
        else:
            part = trained / world
            if kind == "zero3":
                bucket = tmp.zero3_ipg_bucket_bytes(s.reduce_bucket_size, lp)
                # Persistent params are never gathered: only the others are fetched module by module.
                largest_np, gatherable = sts.zero3_gathered_bounds(model, s.param_persistence_threshold)
                if not model.has_shape:
                    largest_np, gatherable = largest, model.n_params
                live = min(tmp.zero3_live_param_bytes(largest_np, s.prefetch_bucket_size, s.max_live_parameters, lp),
                           gatherable * lp)
                mod_grad = tmp.zero3_module_grad_bytes(largest_np, lp)
                persist_t = bucket
                fwd_t = bucket + live
                bwd_t = bucket + live + mod_grad
                if not s.offload_optimizer:
                    sub = min(int(part), sts.ZERO3_SUB_GROUP_SIZE)
                    opt_t = tmp.optimizer_step_temp_bytes(optimizer, impl, sub, 4, sub)
                if explain:
                    term("temporaries.zero3_ipg_bucket", bucket, "reduce_bucket_size*lp",
                         {"reduce_bucket_size": s.reduce_bucket_size, "lp": lp}, "deepspeed stage3.py __init__")
                    term("temporaries.zero3_live_params", live, "min(largest + prefetch_bucket, max_live)*lp",
                         {"largest": largest, "prefetch_bucket_size": s.prefetch_bucket_size,
                          "max_live_parameters": s.max_live_parameters, "lp": lp},
                         "deepspeed PartitionedParameterCoordinator")
                    term("temporaries.zero3_module_grad", mod_grad, "largest*lp", {"largest": largest},
                         "full 16-bit grad of the gathered module")
            else:
                bucket = tmp.zero12_ipg_bucket_bytes(s.reduce_bucket_size, lp, s.overlap_comm)
                bwd_t = bucket
                opt_t = 0
                # The buckets and the flat grad partition appear at the first gradient hook, i.e.
                # after the loss's backward, and the partition is allocated whole.
                t_start = persist_t
                grads_early = st.grads_full
                if not s.offload_optimizer:
                    # One flat fp32 partition is the optimizer's only "parameter".
                    opt_t += tmp.optimizer_step_temp_bytes(optimizer, impl, int(part), 4, int(part))
                if s.offload_optimizer:
                    gbuf = tmp.zero_offload_grad_buffer_bytes(largest, lp)
                    persist_t = gbuf
                    host["offload_grad_buffer_pinned"] = int(largest * 4)
                    if explain:
                        term("temporaries.zero_offload_grad_buffer", gbuf, "largest_param*lp",
                             {"largest_param": largest}, "stage_1_and_2.py temp_grad_buffer_for_gpu_offload")
                if explain:
                    term("temporaries.zero_ipg_buckets", bucket, "reduce_bucket_size*lp*(2 if overlap_comm)",
                         {"reduce_bucket_size": s.reduce_bucket_size, "lp": lp, "overlap_comm": s.overlap_comm},
                         "deepspeed stage_1_and_2.py setup_buckets()")
            fwd_t = max(fwd_t, persist_t)
            bwd_t = max(bwd_t, persist_t) if kind == "zero3" else bwd_t + persist_t
            opt_t += persist_t
            ckpt_t = persist_t
        if explain:
            term("temporaries.optimizer_step", opt_t - persist_t,
                 "foreach AdamW: trained_on_rank*state_bytes; single-tensor: 2*largest*state_bytes; fused: 0",
                 {"optimizer": optimizer, "impl": impl, "trained_on_rank": st.trained_per_rank},
                 "torch.optim _multi_tensor_adamw / _single_tensor_adamw; DeepSpeed step buffers")
        if dequant:
            fwd_t += dequant
            bwd_t += dequant
            if explain:
                term("temporaries.qlora_dequant", dequant, "2*h*max(q, I)", {},
                     "bitsandbytes dequantizes one 4/8-bit weight to 16-bit per matmul")
    if checkpoint == "full":
        host["checkpoint_consolidation"] = int(model.n_params * (4 + sts.optimizer_state_bytes_per_param(
            optimizer, 4, factored))) if lora is None else int(trained * 16 + frozen_bytes)
    # ---- phases ----
    if grads_opt is None:
        grads_opt = grads_full + grads_step
    if params_opt is None:
        params_opt = params
    base = params + opt
    if t.grad_accum > 1:
        # Gradients accumulate across micro-steps: the next forward runs with them allocated.
        grads_persist = max(grads_persist, grads_full)
    if fwd_loss_t is None:
        fwd_loss_t = fwd_block_t = fwd_t
    if t_start is None:
        t_start = bwd_t
    if t_inside is None:
        t_inside = t_reduce = t_end = bwd_t
    if t_last is None:
        t_last = t_inside
    # Forward peaks at the loss (every activation + the logits) or inside the last block (its
    # gathered units / eager scores, without the head's activations), whichever is larger.
    acts_f, fwd_temps = a_blocks + a_head, fwd_loss_t + loss_fwd + wcopy_fwd
    if a_blocks + fwd_block_t + attn_fwd + wcopy_fwd > acts_f + fwd_temps:
        acts_f, fwd_temps = a_blocks, fwd_block_t + attn_fwd + wcopy_fwd
    forward = {"params": params, "grads": grads_persist, "optimizer": opt,
               "activations": acts_f, "temporaries": fwd_temps}
    # Backward peaks at its start (all activations + loss gradients), inside the first block it
    # reaches (a recomputed block + one block's gradient working set), inside the last block (nearly
    # every gradient + that block's activations) or at its end (all gradients); the largest wins.
    acts_b, grads_b, temps_b = a_blocks + a_head, grads_persist, t_start + loss_bwd + wcopy
    last_acts = (prof.ckpt_input * tokens if n_ckpt else a_block) + recompute if prof is not None else 0
    done = 1.0 - (model.block_params + model.vocab_size * model.hidden_size) / model.n_params \
        if model.has_shape and model.n_params else 0.0
    grads_last = grads_persist + int((grads_full - grads_persist) * max(done, 0.0))
    grads_first = grads_persist
    if grads_early is not None:
        grads_first = grads_last = grads_early
    for cand in ((a_blocks + recompute, grads_first + head_grad, t_inside + bwd_work + wcopy),
                 (a_blocks, grads_first + head_grad, t_reduce + wcopy),
                 (last_acts, grads_last + head_grad, t_last + bwd_work),
                 (0, grads_full + head_grad + bwd_end_extra, t_end)):
        if cand[0] + cand[1] + cand[2] > acts_b + grads_b + temps_b:
            acts_b, grads_b, temps_b = cand
    backward = {"params": params, "grads": grads_b, "optimizer": opt, "activations": acts_b, "temporaries": temps_b}
    phases = {
        "load": {"params": params, "grads": max(grads_persist, grads_rest), "optimizer": opt, "activations": 0,
                 "temporaries": persist_t},
        "forward": forward,
        "backward": backward,
        "optimizer": {"params": params_opt, "grads": grads_opt, "optimizer": opt, "activations": 0,
                      "temporaries": opt_t},
        "checkpoint": {"params": params, "grads": max(grads_persist, grads_rest), "optimizer": opt, "activations": 0,
                       "temporaries": ckpt_t},
    }
    states_sum = params + opt
    rest = max(grads_persist, grads_rest)
    peak = states_sum + max(rest + persist_t, grads_persist + acts_f + fwd_temps,
                            grads_b + acts_b + temps_b, grads_opt + opt_t + params_opt - params, rest + ckpt_t)
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
        notes.extend(_assumptions(plan, regime, shard, accounting, device, checkpoint, base))
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


def _assumptions(plan, regime, shard, accounting, device, checkpoint, base) -> list[str]:
    s, t = plan.strategy, plan.training
    out = [f"per rank; {plan.cluster.nodes}x{plan.cluster.gpus_per_node} ranks; states sharded over {shard}",
           f"activation dtype regime '{regime}' ({t.precision}, {s.kind})",
           f"micro-batch {t.micro_batch} x seq {t.seq_len}, activation checkpointing {t.activation_checkpointing}, "
           f"attention {t.attention}",
           f"checkpoint save: {checkpoint}; device: {device}; accounting: {accounting}",
           "loop does `loss = model(**batch).loss`: the logits are freed before backward"]
    if t.lora is not None:
        out.append(f"LoRA r={t.lora.rank} on {','.join(t.lora.target_modules)}: adapters fp32, base "
                   f"{t.lora.base_dtype} frozen")
    if s.kind in ("zero1", "zero2", "zero3"):
        out.append("DeepSpeed: 16-bit params + fp32 master + fp32 grad partition at step; FusedAdam (no step scratch)")
    return out
