"""The estimator's first step: the saved activations and the forward / backward working sets of a plan
(shared by every accounting mode), from the per-token profile in activations.py."""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from functools import lru_cache

from shardfit.estimate import activations as act
from shardfit.estimate import traced_step
from shardfit.estimate import traced_phases
from shardfit.estimate import chunked_loss as closs
from shardfit.estimate import selective as sel
from shardfit.estimate import temporaries
from shardfit.errors import ShardfitError
from shardfit.estimate.derived import evaluate, window_of
from shardfit.estimate.forward_timeline import inside_instants
from shardfit.estimate.result import Term
from shardfit.spec.plan import is_selective_ac, parse_activation_checkpointing


class Recorder:
    """What explain=True collects: every Term and the assumptions' notes."""
    __slots__ = ("terms", "notes")

    def __init__(self):
        self.terms: list[Term] = []
        self.notes: list[str] = []

    def term(self, name, value, formula, inputs, source):
        self.terms.append(Term(name=name, bytes=int(value), formula=formula, inputs=inputs, source=source))


@lru_cache(maxsize=64)
def checkpoint_every(text: str) -> int:
    return parse_activation_checkpointing(text)


@lru_cache(maxsize=64)
def selective_checkpointing(text: str) -> bool:
    return is_selective_ac(text)


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


def saved_activation_bytes(profile: act.Profile, tokens: int, seq: int, num_layers: int, checkpointed: int,
                           selective: tuple = (0.0, 0.0)) -> tuple:
    # Source: Korthikanti et al. 2022 sec. 4 (full recompute keeps the block input), adapted per block;
    # selective: what per-op SAC keeps besides the input (selective_kept).
    samples = tokens // max(seq, 1)
    per_block = (profile.block * tokens + profile.block_quad * tokens * seq + profile.block_per_position * seq
                 + profile.block_per_position_quad * seq * seq + profile.block_per_sample * samples)
    kept = profile.ckpt_input * tokens + selective[0] * tokens + selective[1] * tokens * seq
    blocks = (num_layers - checkpointed) * (per_block + profile.block_const) + checkpointed * kept
    if not checkpointed:
        blocks -= profile.first_block_discount * tokens
    head = (profile.head * tokens + profile.head_quad * tokens * seq + profile.per_position * seq
            + profile.head_per_position_quad * seq * seq + profile.head_per_sample * samples + profile.head_const)
    return int(blocks), int(head), int(per_block)


def autocast_weight_copy_bytes(profile: act.Profile, num_layers: int, checkpointed: int) -> int:
    # Source: torch.autocast's cast cache: 16-bit copies of the weights, held by the saved graph until
    # backward frees them; checkpointed blocks drop theirs after forward.
    return int((num_layers - checkpointed) * profile.weight_copies + profile.head_weight_copy)


@dataclass(slots=True)
class Activations:
    """Bytes per rank; zero everywhere for a model without shapes (--params)."""
    regime: str
    tokens: int = 0
    profile: act.Profile | None = None
    checkpointed_blocks: int = 0
    kept_per_block: int = 0          # what selective checkpointing keeps of one checkpointed block
    block: int = 0                   # one un-checkpointed block's saved tensors
    blocks: int = 0                  # every block's saved tensors
    head: int = 0                    # embedding, final norm, loss inputs saved for backward
    before_head: int = 0             # of `head`, what exists before the head runs (0: bounded by blocks)
    loss_forward: int = 0            # logits and their upcast
    loss_inputs: int = 0
    loss_backward: int = 0
    loss_grads: int = 0              # the head's weight gradient during a chunked loss's backward
    attention_forward: int = 0       # materialised s^2 scores inside a block
    forward_work: int = 0            # a checkpointed block's forward working set
    backward_work: int = 0           # one block's gradient working set
    recompute: int = 0               # one block rebuilt in backward
    dequant: int = 0                 # QLoRA's dequantised weight
    weight_copies: int = 0           # autocast's cast cache in backward
    weight_copies_forward: int = 0   # ...and until forward ends
    traced_inside: list = field(default_factory=list)  # (activations, temporaries) inside the last block
    # The traced step's peak instants at full depth (estimate/backward_timeline.py); None: not traced
    traced_step: traced_step.TracedStep | None = None

    @property
    def last_block(self) -> int:
        """The last block's activations while backward runs through it (its input and what selective
        checkpointing kept, or its saved tensors) plus its recompute."""
        if self.profile is None:
            return 0
        inputs = self.profile.ckpt_input * self.tokens + self.kept_per_block if self.checkpointed_blocks else self.block
        return inputs + self.recompute

    def uncounted(self) -> Activations:
        """What an accounting that counts no activations keeps: only the checkpointed block inputs."""
        return replace(self, block=0, blocks=0, head=0, before_head=0, loss_forward=0, loss_inputs=0,
                       loss_backward=0, loss_grads=0, attention_forward=0, forward_work=0, backward_work=0,
                       recompute=0, weight_copies=0, weight_copies_forward=0, traced_inside=[], traced_step=None)


def activations_step(plan, device: str, record: Recorder | None) -> Activations:
    """The activations of a plan. They depend on the model, the strategy's kind, the training section
    and the device only, so fit's sweeps over strategy variants, cluster sizes and accumulation share
    them: without explain they are built once per such key. NOTE: the result may be shared between
    plans; nothing mutates an Activations after this (uncounted() returns a copy)."""
    if record is None:
        return _shared_activations(plan.model, plan.strategy.kind, plan.training, device)
    return _activations(plan.model, plan.strategy.kind, plan.training, device, record)


@lru_cache(maxsize=4096)
def _shared_activations(model, kind: str, training, device: str) -> Activations:
    return _activations(model, kind, training, device, None)


def _activations(model, kind: str, training, device: str, record: Recorder | None) -> Activations:
    lora = training.lora
    regime = precision_regime(training.precision, kind, lora)
    if not model.has_shape:
        if record:
            record.notes.append("no model shapes (--params): activations are not counted")
        return Activations(regime=regime)
    tokens, seq = training.micro_batch * training.seq_len, training.seq_len
    # FSDP1 LoRA: the frozen base weights are views of a FlatParameter that requires grad, so autograd
    # saves what a full fine-tune saves (estimate/lora_sharding.py); a quantized base is not flattened with it.
    acts_lora = None if kind == "fsdp" and lora is not None and lora.base_dtype not in ("nf4", "int8") else lora
    profile = act.activation_profile(model, regime, training.attention, acts_lora, device, kind == "zero3", seq=seq,
                                     adapters_half=adapters_in_half(kind, regime, lora))
    checkpointed = act.checkpointed_blocks(model.num_layers, checkpoint_every(training.activation_checkpointing))
    kept = (sel.selective_kept(model, regime, training.attention, acts_lora, device)
            if checkpointed and selective_checkpointing(training.activation_checkpointing) else (0.0, 0.0))
    blocks, head, block = saved_activation_bytes(profile, tokens, seq, model.num_layers, checkpointed, kept)
    out = Activations(regime=regime, tokens=tokens, profile=profile, checkpointed_blocks=checkpointed,
                      block=block, blocks=blocks, head=head)
    out.loss_forward = temporaries.loss_forward_bytes(tokens, profile.loss_fwd_temp)
    out.loss_inputs = temporaries.loss_label_bytes(training.micro_batch, seq)
    if regime == "autocast":
        out.loss_inputs += temporaries.autocast_head_input_bytes(tokens, model.hidden_size)
    out.attention_forward = int(profile.attn_fwd_temp_quad * tokens * seq)
    out.loss_backward = temporaries.loss_backward_bytes(tokens, profile.loss_bwd_temp)
    out.backward_work = temporaries.activation_grad_bytes(tokens, seq, profile.bwd_work, profile.bwd_work_quad)
    # Recompute rebuilds one block's saved tensors in backward; under selective checkpointing the
    # ones the policy kept are replayed from its cache, not rebuilt (they are in `blocks` already).
    out.kept_per_block = int(kept[0] * tokens + kept[1] * tokens * seq)
    out.recompute = max(0, block - out.kept_per_block) if checkpointed else 0
    # Activations that exist before the head runs: embedding indices, rotary tables / positions.
    before_head = head - int(tokens * profile.head_after_embedding)
    if training.loss == "chunked":  # the head + loss per row chunk (estimate/chunked_loss.py)
        out.head, out.loss_forward, out.loss_inputs, out.loss_backward, out.loss_grads = closs.chunked_loss_bytes(
            model, regime, kind, training.micro_batch, seq, training.loss_chunks, lora is None, head,
            record.term if record else None)
    # Traced instants inside the last block (derived specs, no checkpointing): its saved tensors so
    # far, and every other live forward tensor (Bloom's gelu intermediates, masks built once).
    if not checkpointed and profile.forward_inside is not None:
        out.traced_inside = [(blocks + before_head + int(delta), int(temps)) for delta, temps
                             in inside_instants(*profile.forward_inside, evaluate, training.micro_batch, seq)]
    # A checkpointed block saves nothing in forward but still builds its working set there: the
    # residual stream, the normed input and the widest intermediates (SwiGLU: gate, up, act) --
    # the same tensors whose gradients make up its backward working set -- and, where attention
    # materialises scores (eager, or SDPA's math path under dropout), its s^2 tensors.
    if checkpointed == model.num_layers:
        out.forward_work = int(tokens * profile.bwd_work + tokens * seq * profile.block_quad)
    # Without it, inside the last block its own saved tensors are not all built yet: the instant is
    # already bounded by `blocks` alone.
    out.before_head = before_head if out.forward_work else 0
    out.dequant = profile.dequant_temp
    # The cast cache lives until autocast exits (end of forward); backward keeps only the saved ones.
    out.weight_copies_forward = autocast_weight_copy_bytes(profile, model.num_layers, 0)
    out.weight_copies = autocast_weight_copy_bytes(profile, model.num_layers, checkpointed)
    if traced_phases.traced_kinds(kind):
        out.traced_step = _traced_step(model, kind, training, regime, acts_lora, out, record)
    if record:
        _record_activations(record, model, training, out, kept)
    return out


def _traced_step(model, kind: str, training, regime: str, lora, acts: Activations,
                 record: Recorder | None) -> traced_step.TracedStep | None:
    """The traced backward and forward instants of a derived spec at the plan's shape
    (estimate/backward_timeline.py); None where they do not apply (hand-written families, the chunked
    loss, per-layer checkpointing, a quantized base, LoRA under a sharding engine, whose frozen
    weights it keeps differently: estimate/lora_sharding.py) or cannot be had (a cache miss without torch, a
    model fake tensors cannot run)."""
    if not model.derived or training.loss != "standard" or (lora is not None and lora.base_dtype != "fp32"):
        return None
    if not model.vocab_size:  # a pipeline stage without the head: the traced step runs the whole model
        return None
    if lora is not None and kind not in traced_phases.ONE_DEVICE:
        return None
    layers = model.num_layers
    if acts.checkpointed_blocks == 0:
        mode = "none"
    elif acts.checkpointed_blocks == layers:
        mode = "selective" if selective_checkpointing(training.activation_checkpointing) else "full"
    else:
        return None
    profile, seq = acts.profile, training.seq_len
    # What one block not yet reached holds: its saved tensors, or its checkpointed input (+ what SAC keeps).
    ahead = acts.block if mode == "none" else int(profile.ckpt_input * acts.tokens + acts.kept_per_block)
    # autocast's cast cache keeps every block's 16-bit weights until forward ends; backward still holds
    # those a block saved (none when it is checkpointed).
    casts = int(profile.weight_copies) if regime == "autocast" else 0
    key_lora = None if lora is None else (lora.rank, tuple(lora.target_modules), lora.base_dtype)
    try:
        step = traced_step.full_depth_instants(model, regime, training.attention, key_lora, mode,
                                                     seq > (window_of(model) or seq), training.micro_batch, seq,
                                                     ahead, casts if mode == "none" else 0, casts)
        if record:
            record.notes.append(f"forward and backward peaks: the largest of {len(step.forward)} + "
                                f"{len(step.backward)} instants of the model's own step traced under "
                                f"checkpointing {mode} (estimate/backward_timeline.py), placed per engine")
        return step
    except (ImportError, ShardfitError) as exc:
        if record:
            record.notes.append(f"forward and backward peaks from the assumed instants (the step trace is "
                                f"unavailable: {exc})")
        return None


def _record_activations(record: Recorder, model, training, acts: Activations, kept) -> None:
    profile, term = acts.profile, record.term
    term("activations.block", acts.block, "b*s*sum(block tensors) + b*s^2*sum(quadratic tensors)",
         {"b": training.micro_batch, "s": training.seq_len, "regime": acts.regime, "attention": training.attention,
          "per_token": profile.block, "per_token_per_s": profile.block_quad,
          "tensors": {label: [per, quad] for label, per, quad in profile.block_items}},
         "Korthikanti et al. 2022 adapted to the HF block (see activations.py)")
    term("activations.blocks", acts.blocks, "(L - n_ckpt)*block + n_ckpt*b*s*(ckpt_input + selective kept)",
         {"L": model.num_layers, "n_ckpt": acts.checkpointed_blocks, "ckpt_input_per_token": profile.ckpt_input,
          "selective_kept_per_token": kept[0]},
         "full recompute keeps only the block input (Korthikanti et al. sec. 5); per-op selective "
         "checkpointing also keeps every other matmul output and the attention output (shardfit/sac.py)")
    if training.loss == "standard":  # the chunked loss's terms: estimate/chunked_loss.py
        term("activations.head", acts.head, "b*s*(final norm + log_softmax fp32 + labels) + rotary",
             {"per_token": profile.head,
              "tensors": {label: per for label, per, _ in profile.head_items}},
             "transformers ForCausalLMLoss: fp32 log_softmax saved for backward")
        term("temporaries.logits_and_upcast", acts.loss_forward, "b*s*V*d + b*s*V*4 when logits are 16-bit",
             {"V": model.vocab_size, "tokens": acts.tokens}, "lm_head output + ForCausalLMLoss logits.float()")
        term("temporaries.loss_inputs", acts.loss_inputs, "24*b*s + 8*b (+ b*s*h*4 under autocast)",
             {"b": training.micro_batch, "s": training.seq_len, "regime": acts.regime},
             "ForCausalLMLoss padded/shifted int64 labels; the fp32 final-norm output an autocast model still holds")
        term("temporaries.loss_backward", acts.loss_backward, "2 * b*s*V*4", {"V": model.vocab_size, "tokens": acts.tokens},
             "nll_loss and log_softmax gradients in fp32")
    if acts.weight_copies_forward:
        term("temporaries.autocast_weight_copies", acts.weight_copies_forward, "2*(block linear weights)*L + 2*V*h",
             {"L": model.num_layers, "n_ckpt": acts.checkpointed_blocks}, "torch.autocast weight cast cache, saved for backward")
    term("temporaries.activation_grads", acts.backward_work, "b*s*(2*res*h + d*max(3*I, 2q+2kv)) (+ eager s^2 grads)",
         {"per_token": profile.bwd_work, "per_token_per_s": profile.bwd_work_quad},
         "one block's backward working set")
