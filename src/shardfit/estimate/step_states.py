"""The estimator's second step: model states (params, grads, optimizer; device, host and NVMe) and the
engine's buffers at each moment, per accounting mode (see estimator.py)."""
from __future__ import annotations

from dataclasses import dataclass, field
from functools import lru_cache

from shardfit.errors import ShardfitError
from shardfit.estimate import buffers as bufs
from shardfit.estimate import lora_sharding as lsh
from shardfit.estimate import states as sts
from shardfit.estimate import zero_partitions
from shardfit.estimate.accounting import deepspeed_estimator_states, ideal_states
from shardfit.estimate.buffers import Buffers
from shardfit.estimate.step_activations import Activations, Recorder


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


@dataclass(frozen=True, slots=True)
class ModelFacts:
    trained: int        # parameters the optimizer steps
    frozen_bytes: int   # a LoRA model's frozen base, as the engine holds it
    factored: float     # optimizer state per trained param relative to full (Adafactor, 8-bit)


def model_facts(plan) -> ModelFacts:
    training = plan.training
    return _plan_facts(plan.model, training.lora, plan.strategy.is_deepspeed, training.precision, training.optimizer)


@lru_cache(maxsize=1024)
def _plan_facts(model, lora, deepspeed: bool, precision: str, optimizer: str) -> ModelFacts:
    """model_facts for what it reads of a plan: the same for every micro-batch, sequence and cluster."""
    lora_key = None if lora is None else (lora.rank, tuple(lora.target_modules), lora.base_dtype)
    trained, frozen_bytes, factored = _model_facts(model, lora_key)
    if lora is not None and deepspeed and precision in ("bf16", "fp16") and lora.base_dtype == "fp32":
        # DeepSpeed's bf16 / fp16 mode casts the whole module, the frozen fp32 base too (measured: engine matrix).
        frozen_bytes = sts.frozen_base_bytes(model, "bf16")
    if optimizer == "adamw8bit":
        factored = sts.eightbit_fraction(model, *(lora_key[:2] if lora_key else ()))
    return ModelFacts(trained, frozen_bytes, factored)


@dataclass(slots=True)
class States:
    params: int
    optimizer: int
    grads_persistent: int            # grads that outlive backward (accumulation, reducer views)
    grads_full: int                  # every grad at the end of backward
    buffers: Buffers
    grads_step: int = 0
    grads_optimizer: int | None = None   # the optimizer phase's own figures, where an engine differs
    params_optimizer: int | None = None
    host: dict[str, int] = field(default_factory=dict)
    nvme: int = 0
    counts_activations: bool = True  # False: DeepSpeed's own estimator counts none


def states_and_buffers(plan, acts: Activations, facts: ModelFacts, shard: int, *, accounting: str, device: str,
                       optimizer_impl: str, checkpoint: str, record: Recorder | None) -> States:
    model, training = plan.model, plan.training
    lp = 4 if training.precision == "fp32" else 2
    largest = model.largest_layer_params or model.block_params or model.n_params
    term, notes = (record.term, record.notes) if record else (None, None)
    host: dict[str, int] = {}
    use_ds = accounting == "deepspeed" and plan.strategy.kind in ("zero2", "zero3")
    if accounting == "ideal" or (accounting == "deepspeed" and not use_ds):
        params, grads, opt = ideal_states(plan, shard, facts.trained, facts.frozen_bytes, facts.factored, lp, host,
                                          term, notes)
        states = States(params, opt, grads, grads, Buffers(), host=host)
    elif use_ds:
        params, grads, opt, temps = deepspeed_estimator_states(plan, largest, host, term, notes)
        states = States(params, opt, grads, grads, Buffers(temps), host=host, counts_activations=False)
    else:
        states = _engine_states(plan, acts, facts, shard, lp, largest, device, optimizer_impl, checkpoint, record)
    if checkpoint == "full":
        states.host["checkpoint_consolidation"] = int(model.n_params * (4 + sts.optimizer_state_bytes_per_param(
            training.optimizer, 4, facts.factored))) if training.lora is None else int(facts.trained * 16 + facts.frozen_bytes)
    return states


def _engine_states(plan, acts, facts, shard, lp, largest, device, optimizer_impl, checkpoint, record) -> States:
    """What the engines really allocate ("real" accounting)."""
    model, strategy, training, lora = plan.model, plan.strategy, plan.training, plan.training.lora
    kind, precision, optimizer, world = strategy.kind, training.precision, training.optimizer, plan.cluster.world_size
    persistent = sts.zero3_persistent_params(model, strategy.param_persistence_threshold) if kind == "zero3" else 0
    engine = "fsdp" if kind in ("fsdp", "fsdp2") else kind
    st = sts.model_states(engine, shard, world, precision, optimizer, facts.trained, facts.frozen_bytes, facts.factored,
                          strategy.offload_optimizer, strategy.offload_params, persistent, largest, record is not None,
                          strategy.ddp_gradient_as_bucket_view)
    states = States(st.params, st.optimizer, st.grads_persistent, st.grads_full, Buffers(), grads_step=st.grads_step,
                    grads_optimizer=st.grads_optimizer, params_optimizer=st.params_optimizer, host=dict(st.host),
                    nvme=st.nvme)
    if record:
        for name, value, formula, inputs, source in st.terms:
            record.term(f"states.{name}", value, formula, inputs, source)
    impl = optimizer_impl
    if impl == "auto":
        impl = "single" if device == "cpu" else ("fused" if strategy.is_deepspeed else "foreach")
    term = record.term if record else None
    unit = model.block_params or model.largest_layer_params or model.n_params
    if kind in ("fsdp", "fsdp2"):
        lora_unit = None if lora is None else lsh.fsdp_lora_states(st, kind, model, lora, facts.trained, shard, precision)
        states.optimizer, states.grads_full = st.optimizer, st.grads_full
        root = model.non_block_params if model.block_params else 0
        states.buffers = bufs.fsdp_buffers(kind, strategy, model, precision, shard, unit, root, largest,
                                           _gather_bytes(plan, facts), st, impl, optimizer, checkpoint, term, lora_unit, lora,
                                           backend_copy=device == "cpu")
        if record and strategy.offload_params:
            record.notes.append("FSDP CPU offload: sharded params, grads and optimizer live in pinned host RAM; "
                                "the step runs on CPU")
    elif kind == "ddp":
        states.buffers = bufs.ddp_buffers(strategy, model, st, impl, optimizer, largest, term)
    elif kind == "single":
        states.buffers = bufs.single_buffers(model, st, impl, optimizer, largest)
    elif kind == "zero3":
        states.buffers = bufs.zero3_buffers(strategy, model, facts.trained, world, lp, largest, impl, optimizer, term,
                                            recomputes=training.activation_checkpointing != "none",
                                            backend_copy=device == "cpu")
    else:
        states.buffers = bufs.zero12_buffers(strategy, st, facts.trained, world, lp, largest, impl, optimizer,
                                             states.host, term)
        _zero12_layout(states, model, facts, st.grads_full, world, lp, term)
    buf = states.buffers
    if record:
        record.term("temporaries.optimizer_step", buf.opt - buf.rest,
                    "foreach AdamW: trained_on_rank*state_bytes; single-tensor: (2*largest + previous)*state_bytes; fused: 0",
                    {"optimizer": optimizer, "impl": impl, "trained_on_rank": st.trained_per_rank},
                    "torch.optim _multi_tensor_adamw / _single_tensor_adamw; DeepSpeed step buffers")
    if acts.dequant:
        for name in ("fwd_block", "fwd_loss", "start", "inside", "reduce", "last", "end"):
            setattr(buf, name, getattr(buf, name) + acts.dequant)
        if record:
            record.term("temporaries.qlora_dequant", acts.dequant,
                        "nf4: W*compute_bytes + 4*W/64; int8: W*input_bytes (W: widest block linear)",
                        {"base": lora.base_dtype, "regime": acts.regime},
                        "bitsandbytes gemm_4bit / MatMul4Bit.backward dequantize_4bit; MatMul8bitFp / MatMul8bitLt CB*SCB")
    return states


def _zero12_layout(states: States, model, facts: ModelFacts, partition_bytes: int, world: int, lp: int, term) -> None:
    """ZeRO-1/2 where the parameter layout is known and covers what is trained (estimate/zero_partitions.py):
    the gradient buffer holds the whole of every parameter the rank's partition touches, and the
    optimizer step peaks at the norm, the flattening or the update, whichever is largest on some rank."""
    buf = states.buffers
    buf.grads_early = partition_bytes
    if not partition_bytes or not zero_partitions.covers(model.param_order, facts.trained):
        return  # offloaded (no device gradient buffer), LoRA, or no layout: the partition
    whole = lp * zero_partitions.grads_in_partition_elements(model.param_order, world)
    buf.grads_early = max(whole, partition_bytes)
    part = partition_bytes // lp
    states.grads_optimizer, buf.opt = zero_partitions.step_instants(model.param_order, world, lp, part, buf.opt)
    if term:
        term("grads.zero12_grads_in_partition", whole, "lp * whole numel of the params the worst rank's partition touches",
             {"lp": lp, "world": world, "partition": partition_bytes}, "deepspeed stage_1_and_2.py copy_grads_in_partition")


def _gather_bytes(plan, facts: ModelFacts) -> float:
    """Bytes per element FSDP gathers. LoRA: the frozen base in its stored dtype, unless MixedPrecision
    casts it to 16-bit (a float base under bf16 / fp16; bitsandbytes' packed uint8 is gathered as it is)."""
    model, precision, lora = plan.model, plan.training.precision, plan.training.lora
    if lora is not None and model.n_params and facts.frozen_bytes and (precision == "fp32" or lora.base_dtype in ("int8", "nf4")):
        return facts.frozen_bytes / model.n_params
    return 2 if precision != "fp32" else 4
