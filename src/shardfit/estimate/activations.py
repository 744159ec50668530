"""Saved activations: the tensors autograd keeps from forward to backward, derived for the real block.

Start: Korthikanti et al. 2022 (arXiv 2205.05198), sbh*(34 + 5as/h) for a GPT layer. Adapted by reading
what HF transformers 5 blocks save (modeling_llama / mixtral / gpt2, integrations/sdpa_attention):
- RMSNorm upcasts to fp32: pow() and mul() save the fp32 input; the weight mul saves the normalised
  tensor (only when the weight trains). LayerNorm saves its input plus mean and rstd.
- A linear saves its input only when its weight trains (frozen LoRA bases do not); PEFT's LoRA
  saves a copy of the input cast to the fp32 adapter dtype plus the r-wide A output.
- SDPA/flash saves q, k, v (k/v at the KV-head width: HF passes enable_gqa), the output and an fp32
  logsumexp per head and row; the transposed output reuses the same storage. Eager attention saves
  q, k and v repeated to all heads, the fp32 softmax and its 16-bit copy (b*a*s^2 each), and a
  contiguous copy of the output.
- SwiGLU saves gate, silu(gate), up and their product; GPT-2's gelu_new saves four intermediates; MoE
  saves per routed token the gathered input, gate_up, act, product, expert output, fp32 router softmax.
- Under DDP autocast the residual stream stays fp32 and each linear saves its own 16-bit cast.
Bytes are per token (b*s) unless named per position; `quad` terms multiply by s once more."""
from __future__ import annotations

from functools import lru_cache

from shardfit.estimate.derived import load_coefficients, window_of
from shardfit.estimate.states import DTYPE_BYTES
from shardfit.estimate.states import block_linears as _linears
from shardfit.estimate import temporaries as tmp
from shardfit.estimate.states import lora_adapter_params

# regime: "fp32" (4-byte everything), "half" (module params 16-bit: FSDP MixedPrecision, DeepSpeed,
# pure bf16, LoRA on a 16-bit base), "autocast" (fp32 params under torch.autocast: DDP mixed).


class Profile:
    """Per-token activation coefficients for one (model, regime, attention, LoRA) combination."""
    __slots__ = ("block", "block_quad", "block_items", "head", "head_items", "ckpt_input",
                 "loss_fwd_temp", "loss_bwd_temp", "bwd_work", "bwd_work_quad", "attn_fwd_temp_quad",
                 "per_position", "dequant_temp", "weight_copies", "head_weight_copy", "block_const", "head_const",
                 "first_block_discount", "block_per_position", "block_per_position_quad", "block_per_sample",
                 "head_quad", "head_per_position_quad", "head_per_sample", "source", "forward_inside",
                 "head_after_embedding")

    def __init__(self):
        # Terms only traced profiles have (broadcast position tables and masks, per-sequence tensors).
        self.block_per_position = self.block_per_position_quad = self.block_per_sample = 0
        self.head_quad = self.head_per_position_quad = self.head_per_sample = 0
        self.source = "Korthikanti et al. 2022 adapted to the HF block (see activations.py)"
        self.forward_inside = None  # traced: the block kinds and their peak instants (forward_timeline.py)


def activation_profile(model, regime: str, attention: str, lora, device: str = "cuda",
                       frozen_linears_save: bool = False, seq: int = 0, adapters_half: bool = False) -> Profile:
    """frozen_linears_save: the frozen base linears keep their input anyway (DeepSpeed ZeRO-3 replaces
    F.linear with LinearFunctionForZeroStage3, whose setup_context saves input and weight whether or
    not the weight trains); hand-written families only. seq: a sequence longer than a derived model's
    sliding window runs other code (derived.window_of). adapters_half: the engine computes the adapters in
    16-bit (FSDP2's MixedPrecisionPolicy gathers them in param_dtype; DeepSpeed's bf16/fp16 mode casts the
    module), so peft's adapter path casts nothing to fp32 (step_activations.adapters_in_half)."""
    key_lora = None if lora is None else (lora.rank, tuple(lora.target_modules), lora.base_dtype)
    if key_lora is not None and frozen_linears_save and not model.derived:
        key_lora += ("linear-inputs-saved",)
    if key_lora is not None and adapters_half and not model.derived:
        key_lora += ("adapters-16bit",)
    if model.derived:
        return _derived_profile(model, regime, attention, key_lora, device, seq > (window_of(model) or seq))
    return _profile(model, regime, attention, key_lora, device)


@lru_cache(maxsize=256)
def _derived_profile(model, regime, attention, lora, device, beyond_window=False) -> Profile:
    """Coefficients traced from the model's own forward (estimate/derived.py, cached on disk), with
    the temporaries the trace does not see (loss, backward working set) from the shapes, as below.
    NOTE: the trace runs CPU kernels; only dropout masks differ on CUDA (bool there)."""
    c = load_coefficients(model, regime, attention, lora, beyond_window)
    counts = [count for _, count, _ in model.block_kinds]
    layers = max(sum(counts), 1)

    def mean(term):
        return sum(n * kind[term] for n, kind in zip(counts, c["kinds"])) / layers

    p = Profile()
    p.source = "traced forward of the model's own code at its real widths (estimate/derived.py)"
    p.block, p.block_quad = mean("per_token"), mean("per_token_s")
    p.block_per_position, p.block_per_position_quad = mean("per_position"), mean("per_position_s")
    p.block_per_sample, p.block_const = mean("per_sample"), mean("const")
    p.block_items = tuple((f"{name} x{n}", kind["per_token"], kind["per_token_s"])
                          for (name, n, _), kind in zip(model.block_kinds, c["kinds"]))
    # A pipeline stage without the head (vocab_size 0: estimate/derived_parallel.stage_model) has no
    # final norm, logits or loss, but the schedule keeps its output (the residual stream it sends) for
    # the backward; every stage builds its own masks and rotary tables (engines/pipeline.py).
    post = c["post"] if model.vocab_size else {**dict.fromkeys(c["post"], 0.0),
                                               "per_token": (2 if regime == "half" else 4) * model.hidden_size}
    parts = (c["pre"], post, c["first_extra"])
    p.head = sum(part["per_token"] for part in parts)
    # Labels "embedding.*" mark what exists before the head runs (the estimator's a_pre_head).
    p.head_items = (("embedding.and_first_block_extra", c["pre"]["per_token"] + c["first_extra"]["per_token"], 0.0),
                    ("head.norm_logits_loss", post["per_token"], 0.0))
    p.head_quad = sum(part["per_token_s"] for part in parts)
    p.per_position = sum(part["per_position"] for part in parts)
    p.head_per_position_quad = sum(part["per_position_s"] for part in parts)
    p.head_per_sample = sum(part["per_sample"] for part in parts)
    p.head_const = sum(part["const"] for part in parts)
    p.weight_copies = sum(n * w for n, w in zip(counts, c["weight_copies"]["kinds"])) / layers
    p.head_weight_copy = c["weight_copies"]["head"]
    p.first_block_discount = 0  # the trace measured block 0 as it is (first_extra)
    p.forward_inside = (tuple(c["kinds"]), tuple(c["forward_inside"])) if c.get("forward_inside") else None
    _shape_terms(p, model, regime, attention, lora)
    return p


def _shape_terms(p: Profile, model, regime: str, attention: str, lora) -> None:
    """The temporaries no saved tensor shows, from the spec's shapes: logits and their fp32 upcast,
    the loss gradients, one block's backward working set, eager attention's scores, the checkpointed
    block input, QLoRA's dequantized weight."""
    h, heads = model.hidden_size, max(model.num_heads, 1)
    hd = model.head_dim or h // heads
    qd, kvd = heads * hd, (model.num_kv_heads or heads) * hd
    inter = model.intermediate_size or 4 * h
    vocab = model.vocab_size
    d = 4 if regime == "fp32" else 2
    res = 2 if regime == "half" else 4
    p.ckpt_input = res * h
    # `loss = model(**batch).loss` (HF Trainer, shardfit train) drops the output: the logits live only
    # while the loss is computed, next to their fp32 upcast when they are 16-bit.
    p.loss_fwd_temp = d * vocab + (4 * vocab if d != 4 else 0)
    p.loss_bwd_temp = 8 * vocab
    # One block's backward working set: grads of the residual stream and of the widest intermediates.
    width = inter * (max(model.experts_per_token, 1) if model.num_experts else 1)
    # e.g. SwiGLU backward holds the grads of product, act and up (3 x I) next to the residual grads.
    p.bwd_work = 2 * res * h + d * max(3 * width, 2 * qd + 2 * kvd)
    p.bwd_work_quad = (4 + d) * heads if attention == "eager" else 0
    p.attn_fwd_temp_quad = 2 * d * heads if attention == "eager" else 0
    p.dequant_temp = tmp.qlora_dequant_bytes(model, regime, lora[2]) if lora is not None else 0
    # Per token, the head tensors that do not exist before the head runs (labels "embedding.*" do):
    # summed once here rather than on every estimate.
    p.head_after_embedding = sum(per for label, per, _ in p.head_items if not label.startswith("embedding."))


@lru_cache(maxsize=512)
def _profile(model, regime, attention, lora, device) -> Profile:
    h, heads = model.hidden_size, max(model.num_heads, 1)
    kv_heads = model.num_kv_heads or heads
    hd = model.head_dim or h // heads
    qd, kvd = heads * hd, kv_heads * hd
    inter = model.intermediate_size or 4 * h
    vocab = model.vocab_size
    d = 4 if regime == "fp32" else 2  # matmul outputs
    res = 2 if regime == "half" else 4  # residual stream
    trains = lora is None
    linears_save = trains or (lora is not None and "linear-inputs-saved" in lora[3:])
    half_adapters = lora is not None and "adapters-16bit" in lora[3:]
    targets = set() if lora is None else set(lora[1])
    rank = 0 if lora is None else lora[0]
    # QLoRA: the frozen base linears are bitsandbytes layers (nf4 Linear4bit / int8 Linear8bitLt).
    quant = lora[2] if lora is not None and lora[2] in ("nf4", "int8") else None
    # Source: bitsandbytes Linear4bit.forward returns matmul_4bit(...).to(inp_dtype), and CUDA's
    # MatMul8bitLt int8_scaled_mm(dtype=A.dtype): under autocast they answer in the fp32 stream's
    # dtype; CPU's MatMul8bitFp runs F.linear, which autocast casts to 16-bit.
    mm = 4 if regime == "autocast" and (quant == "nf4" or (quant == "int8" and device == "cuda")) else d
    all_linear = "all-linear" in targets
    drop = model.dropout > 0
    if model.family == "gemma2":
        attention = "eager"  # transformers has no SDPA path for Gemma-2 (logit softcapping)
    # Dropout masks: CUDA's fused kernel keeps a bool mask; the CPU kernel a mask in the input dtype.
    mask = 1 if device == "cuda" else d
    mask_res = 1 if device == "cuda" else res
    layernorm = model.norm == "layernorm"
    items: list[tuple[str, float, float]] = []

    def add(label, per_token, quad=0.0):
        if per_token or quad:
            items.append((label, per_token, quad))

    def norm(prefix):
        """The norm's own saves; returns the dtype bytes of its output."""
        if layernorm:
            # native_layer_norm saves its input (the residual itself), mean and rstd (fp32).
            add(f"{prefix}.input", res * h)
            # CUDA keeps mean/rstd in fp32; the CPU kernel in the input dtype.
            add(f"{prefix}.mean_rstd", 8 if device == "cuda" else 2 * (4 if regime == "autocast" else res))
            return 4 if regime == "autocast" else d
        if regime == "half":
            add(f"{prefix}.input_fp32_copy", 4 * h)
        else:
            add(f"{prefix}.input", 4 * h)
        add(f"{prefix}.rsqrt", 4)
        if trains:
            # Gemma's norm multiplies by (1 + weight) in fp32; Llama's casts back first.
            add(f"{prefix}.normed", (2 if regime == "half" and family != "gemma2" else 4) * h)
        return 4 if regime == "autocast" else d

    def consumed(label, width, dtype, consumers, already_saved=False):
        """Bytes a tensor costs through the linears that read it."""
        shared = already_saved
        held = False
        for name in consumers:
            # PEFT all-linear skips the output layer; the MoE router is not an nn.Linear.
            targeted = (all_linear and name not in ("lm_head", "router")) or name in targets
            # Source: bitsandbytes MatMul8bitFp (CPU: ctx.A) / MatMul8bitLt (CUDA: ctx.tensors) keep their
            # input for a weight gradient a frozen base never takes, outside save_for_backward.
            held = held or (quant == "int8" and name not in ("lm_head", "router"))
            if linears_save:
                if regime == "autocast" and dtype == 4:
                    add(f"{label}.bf16_cast_for_{name}", 2 * width)
                else:
                    shared = True
                if targeted and not trains:
                    add(f"{name}.lora_A_out", dtype * rank)
            elif targeted and quant and regime == "autocast":
                # Source: peft lora/bnb.py Linear4bit/Linear8bitLt.forward: lora_A gets the fp32 input and
                # autocast casts it once per adapter (it caches weight casts only); A's output is 16-bit.
                add(f"{label}.bf16_cast_for_lora_{name}", 2 * width)
                add(f"{name}.lora_A_out", 2 * rank)
            elif targeted and half_adapters:
                # Source: peft lora Linear.forward _cast_input_dtype(x, lora_A.weight.dtype): a 16-bit adapter
                # weight takes the 16-bit input as it is, saved once for every adapter that reads it.
                shared = True
                add(f"{name}.lora_A_out", dtype * rank)
            elif targeted:
                if dtype == 4:
                    shared = True
                else:
                    add(f"{label}.fp32_cast_for_lora_{name}", 4 * width)
                add(f"{name}.lora_A_out", 4 * rank)
        if shared and not already_saved:
            add(label, dtype * width)
        elif held and not already_saved:
            add(f"{label}.held_by_int8_linear", dtype * width)

    family = model.family
    # Attention half. BERT is post-norm: no input norm, the q/k/v linears keep the last LayerNorm's output.
    out_dtype = (4 if regime == "autocast" else d) if family == "bert" else norm("input_norm")
    gpt_like = family in ("gpt2", "bert")
    # SDPA runs a fused kernel (flash / memory-efficient) except on CPU with attention dropout, where
    # it falls back to the math path that materialises the scores like eager attention does.
    fused = attention == "sdpa" and not (device == "cpu" and drop)
    if gpt_like:
        names = ["c_attn"] if family == "gpt2" else ["query", "key", "value"]
        consumed("ln_1.out" if family == "gpt2" else "block.input", h, out_dtype, names)
        if fused:
            add("attn.qkv", d * (qd + 2 * kvd))  # q, k, v are views of one projection output
        elif attention == "eager":
            add("attn.qkv_bmm_copies", d * 3 * qd)  # matmul reshapes the strided views into copies
    else:
        consumed("input_norm.out", h, out_dtype, ["q_proj", "k_proj", "v_proj"])
        if fused or attention == "eager":
            add("attn.q_rope", d * qd)
            kv_width = kvd if fused else qd  # eager repeat_kv copies k/v to every head
            add("attn.k_rope", d * kv_width)
            add("attn.v", d * kv_width)
    o_name = {"gpt2": "c_proj", "bert": "dense"}.get(family, "o_proj")
    if fused:
        add("attn.output", d * qd)
        add("attn.logsumexp", 4 * heads)
        consumed("attn.output", qd, d, [o_name], already_saved=True)
    elif attention == "sdpa":
        # CPU math path with dropout: q, k, v, scores, mask and dropped probabilities, all in fp32.
        add("attn.math_qkv_fp32", 4 * 3 * qd)
        add("attn.math_softmax_mask_dropped", 0, 3 * 4 * heads)
        add("attn.output_contiguous", d * qd)
        consumed("attn.output_contiguous", qd, d, [o_name], already_saved=True)
    else:
        if family == "gemma2":
            add("attn.softcap_tanh", 0, d * heads)
        # HF's Llama-family eager softmax is fp32; GPT-2/BERT's follows the input (fp32 under autocast).
        soft = 4 if (not gpt_like or regime == "autocast") else d
        add("attn.softmax", 0, soft * heads)
        if drop:
            add("attn.dropout_mask", 0, mask * heads)
            add("attn.dropout_out", 0, d * heads)
        elif soft != d:
            add("attn.probs_cast", 0, d * heads)
        add("attn.output_contiguous", d * qd)
        consumed("attn.output_contiguous", qd, d, [o_name], already_saved=True)
    if drop:
        add("attn.resid_dropout_mask", mask * h)
    # MLP half (BERT: post_attention_norm is BertSelfOutput's LayerNorm(dropout(dense) + input)).
    if family == "gemma2":
        norm("post_attention_norm")
        norm("pre_feedforward_norm")
        out_dtype = d if regime != "autocast" else 4
    else:
        out_dtype = norm("post_attention_norm")
    if model.num_experts:
        k, experts = max(model.experts_per_token, 1), model.num_experts
        consumed("post_norm.out", h, out_dtype, ["router"])
        add("moe.router_softmax", 4 * experts)
        add("moe.topk_index_values_sum", 12 * k + 4)
        # Experts take the gathered residual-dtype input; autocast leaves them in fp32 (not a linear).
        ed = 4 if regime == "autocast" else d
        if trains:
            add("moe.expert_input_gather", k * ed * h)
        add("moe.gate_up", k * ed * 2 * inter)
        add("moe.act", k * ed * inter)
        if trains:
            add("moe.act_x_up", k * ed * inter)
        add("moe.expert_out", k * ed * h)
        add("moe.routing_weights", 4 * k)
        add("moe.sort_and_scatter_index", 24 * k)
    elif model.mlp == "gelu":
        up = "c_fc" if family == "gpt2" else "dense"
        down = "c_proj" if family == "gpt2" else "dense"
        consumed("post_norm.out", h, out_dtype, [up])
        add("mlp.fc_out", mm * inter)
        if family == "gpt2":
            add("mlp.gelu_new_intermediates", 3 * mm * inter)  # tanh out, 0.5*x, 1+tanh
        consumed("mlp.act_out", inter, mm, [down])
    else:
        consumed("post_norm.out", h, out_dtype, ["gate_proj", "up_proj"])
        add("mlp.gate", mm * inter)
        add("mlp.act", mm * inter)
        add("mlp.up", mm * inter)
        consumed("mlp.act_x_up", inter, mm, ["down_proj"])
    if family in ("gemma2", "bert"):  # BERT: BertOutput's LayerNorm(dropout(dense) + attention output)
        norm("post_feedforward_norm" if family == "gemma2" else "output_norm")
    if drop:
        add("mlp.resid_dropout_mask", mask * h)

    block = sum(i[1] for i in items)
    block_quad = sum(i[2] for i in items)

    # Head: final norm, logits, loss; embedding indices; rotary tables per position.
    head_items: list[tuple[str, float, float]] = []
    block_items = tuple(items)
    items = head_items
    # NOTE: vocab 0 is a pipeline stage without the head (model_parallel.local_model): no final norm,
    # logits or loss there; the schedule keeps the stage's output (the residual stream it sends) for
    # that micro-batch's backward (torch.distributed.pipelining's fwd_cache).
    if not vocab:
        add("stage.output_kept", res * h)
    elif family != "bert":
        out_dtype = norm("final_norm")
        consumed("final_norm.out", h, out_dtype, ["lm_head"])
    else:
        _bert_mlm_head(add, consumed, h, d, device, regime)
    if trains:
        add("embedding.input_ids", 8)
    if family == "bert":
        norm("embedding.norm")  # BertEmbeddings' LayerNorm(word + position + token type)
    if drop:
        add("embedding.dropout_mask", mask_res * h)
    if family == "gemma2":
        add("logits.softcap_tanh", d * vocab)
    if family == "bert":  # BertForMaskedLM: CrossEntropyLoss on the logits as they are, labels unshifted
        add("loss.log_softmax", (4 if regime == "autocast" else d) * vocab)
    elif vocab:
        add("loss.log_softmax_fp32", 4 * vocab)
        add("loss.shifted_labels", 8)
    head = sum(i[1] for i in head_items)

    p = Profile()
    p.block, p.block_quad, p.block_items = block, block_quad, block_items
    p.head, p.head_items = head, tuple(head_items)
    _shape_terms(p, model, regime, attention, lora)
    # Rotary cos/sin (1, s, head_dim) in the hidden dtype; GPT-2's position ids (1, s) int64.
    p.per_position = 2 * hd * res if family not in ("gpt2", "bert") else 8
    # torch.autocast caches a 16-bit copy of every trainable weight it casts, and each linear saves it
    # for backward: a 16-bit copy of the model lives from forward to backward (not of checkpointed blocks).
    autocast_copies = regime == "autocast" and trains
    block_weights = sum(i * o * n for name, i, o, n in _linears(model)
                        if not (model.num_experts and name in ("gate_proj", "up_proj", "down_proj")))
    block_weights += h * model.num_experts  # the router
    p.weight_copies = 2 * block_weights if autocast_copies else 0
    p.head_weight_copy = 2 * (vocab * h + (h * h if family == "bert" else 0)) if autocast_copies else 0  # + MLM dense
    if quant and regime == "autocast":
        # Source: torch.autocast caches the 16-bit copies of the trainable adapters, which each LoRA
        # linear saves; the frozen fp32 head (peft's upcast) is cast per call and its copy saved for the
        # input gradient. bitsandbytes' layers are not cast.
        p.weight_copies = 2 * lora_adapter_params(model, rank, lora[1]) / max(model.num_layers, 1)
        p.head_weight_copy = 2 * vocab * h
    p.block_const = p.head_const = 0
    if family == "gemma2" and trains:
        # Gemma's norms save (1 + weight) in fp32: four per block, one final.
        p.block_const = 4 * 4 * h
        p.head_const = 4 * h
    # LoRA freezes the embedding: block 0's input needs no grad, so its first norm saves nothing.
    own = ("input_norm.input", "input_norm.input_fp32_copy", "input_norm.rsqrt", "input_norm.mean_rstd",
           "input_norm.out.held_by_int8_linear")
    p.first_block_discount = sum(per for label, per, _ in block_items if label in own) if lora else 0
    return p


def _bert_mlm_head(add, consumed, h: int, d: int, device: str, regime: str) -> None:
    """BertLMPredictionHead: dense, gelu, LayerNorm, decoder; CPU autocast leaves layer_norm 16-bit, CUDA's casts to fp32."""
    consumed("last_norm.out", h, 4 if regime == "autocast" else d, ["dense"])
    add("mlm.gelu_input", d * h)
    cuda_fp32 = device == "cuda" and regime == "autocast"
    add("mlm.norm_input", (4 if cuda_fp32 else d) * h)
    add("mlm.norm_mean_rstd", 8 if device == "cuda" else 2 * d)
    consumed("mlm.norm_out", h, 4 if cuda_fp32 else d, ["decoder"])


def checkpointed_blocks(num_layers: int, every: int) -> int:
    """Blocks wrapped by activation checkpointing: every N-th block (0 = none, 1 = all)."""
    if every <= 0:
        return 0
    return (num_layers + every - 1) // every


__all__ = ["Profile", "activation_profile", "checkpointed_blocks", "DTYPE_BYTES"]
