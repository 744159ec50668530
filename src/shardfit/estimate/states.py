"""Model states per rank: parameters, gradients and optimizer state, as each engine really keeps them.

Every function is pure and counts one thing. `model_states` composes them for a strategy and says
where each byte lives (device, host RAM, NVMe) and when it exists (always, only after backward, only
during the optimizer step). Bytes are per rank.
"""
from __future__ import annotations

import math
from functools import lru_cache

# Bytes per element of the dtypes a plan can name. nf4 is 4 bits; its block constants are separate.
DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2, "int8": 1, "nf4": 0.5}

# LoRA target names -> (input dim, output dim, copies per block) from the ModelSpec's shapes.
# The GPT-2 names are Conv1D modules; `c_proj` exists twice in a GPT-2 block (attention and MLP).
LORA_TARGET_NAMES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj",
                     "c_attn", "c_proj", "c_fc", "query", "key", "value", "dense", "all-linear")

# DeepSpeed's default sub_group_size (elements): the fp32 gradient of one sub-group exists at step.
ZERO3_SUB_GROUP_SIZE = 1_000_000_000


def block_linears(model) -> tuple[tuple[str, int, int, int], ...]:
    """(name, in, out, copies) for the linear layers of one block, from the spec's shapes."""
    return _block_linears(model.family, model.hidden_size, model.num_heads, model.num_kv_heads,
                          model.head_dim, model.intermediate_size, model.num_experts, model.mlp)


@lru_cache(maxsize=256)
def _block_linears(family, h, heads, kv_heads, head_dim, inter, experts, mlp):
    hd = head_dim or (h // heads if heads else 0)
    q, kv = heads * hd, (kv_heads or heads) * hd
    if family == "gpt2":
        return (("c_attn", h, 3 * h, 1), ("c_proj", h, h, 1), ("c_fc", h, inter, 1), ("c_proj", inter, h, 1))
    if family == "bert":
        return (("query", h, h, 1), ("key", h, h, 1), ("value", h, h, 1), ("dense", h, h, 1),
                ("dense", h, inter, 1), ("dense", inter, h, 1))
    copies = max(experts, 1)
    attention = (("q_proj", h, q, 1), ("k_proj", h, kv, 1), ("v_proj", h, kv, 1), ("o_proj", q, h, 1))
    if mlp == "gelu":
        return attention + (("up_proj", h, inter, copies), ("down_proj", inter, h, copies))
    return attention + (("gate_proj", h, inter, copies), ("up_proj", h, inter, copies),
                        ("down_proj", inter, h, copies))


def model_linears(model) -> tuple[tuple[str, int, int, int], ...]:
    """(name, in, out, count in the whole model) of the block linears: a derived spec lists what the
    meta-built model has; a hand-written family's come from its shapes, times the layers."""
    if model.derived:
        return model.linears
    return tuple((name, i, o, n * model.num_layers) for name, i, o, n in block_linears(model))


def lora_adapter_params(model, rank: int, targets: tuple[str, ...]) -> int:
    # Source: LoRA (Hu et al. 2021): A is r x in, B is out x r per adapted linear, per block.
    wanted = set(targets)
    everything = "all-linear" in wanted
    return sum(rank * (i + o) * n for name, i, o, n in model_linears(model) if everything or name in wanted)


def lora_unknown_targets(model, targets: tuple[str, ...]) -> list[str]:
    names = {name for name, *_ in model_linears(model)} | {"all-linear"}
    return [t for t in targets if t not in names]


def quantized_linear_params(model) -> int:
    """Parameters of the block linears: what bitsandbytes quantizes (not embeddings, norms, head)."""
    return sum(i * o * n for _, i, o, n in model_linears(model))


def nf4_weight_bytes(numel: int) -> int:
    # Source: bitsandbytes functional.quantize_4bit(blocksize=64, compress_statistics=True), as
    # Params4bit._quantize calls it: packed 4-bit data, one uint8 absmax per 64-block (quantize_blockwise
    # with blocksize 256), one fp32 absmax per 256 blocks, and per weight the fp32 offset, the 16-value
    # fp32 nf4 code and a copy of the 256-value fp32 dynamic map of the nested state.
    blocks = -(-numel // 64)
    return -(-numel // 2) + blocks + 4 * -(-blocks // 256) + 4 + 4 * 16 + 4 * 256


def int8_weight_bytes(in_features: int, out_features: int) -> int:
    # Source: bitsandbytes Int8Params._quantize (int8_vectorwise_quant): int8 rows (CB, also the
    # weight's data) and one fp32 absmax per output row (SCB).
    return in_features * out_features + 4 * out_features


def frozen_base_bytes(model, base_dtype: str) -> int:
    """The frozen base of LoRA / QLoRA. A quantized base is what transformers + peft build: the block
    linears in bitsandbytes' format, every other weight (embeddings, norms, head, biases) in fp32."""
    if base_dtype not in ("nf4", "int8"):
        return int(model.n_params * DTYPE_BYTES[base_dtype])
    # Source: peft utils/other.py prepare_model_for_kbit_training casts every fp16/bf16 parameter that
    # is not a Params4bit to fp32 (Int8Params are int8, so they stay): the unquantized rest is 4 B.
    if not model.has_shape:  # no shapes (--params): count every parameter as a quantized linear
        per_param = 0.5 + 1 / 64 + 4 / (64 * 256) if base_dtype == "nf4" else 1.0
        return int(model.n_params * per_param)
    linears = model_linears(model)
    linear = sum(i * o * n for _, i, o, n in linears)
    if base_dtype == "nf4":
        quantized = sum(nf4_weight_bytes(i * o) * n for _, i, o, n in linears)
    else:
        quantized = sum(int8_weight_bytes(i, o) * n for _, i, o, n in linears)
    return int(quantized + 4 * (model.n_params - linear))


def adafactor_ratio(model) -> float:
    """Adafactor's factored state per parameter: sum(rows + cols) / sum(rows * cols) over matrices."""
    if not model.has_shape:
        side = max(model.largest_layer_params, model.n_params // 100, 1) ** 0.5
        return 2.0 / side
    if model.derived:
        # Adafactor factors the last two dimensions of every tensor of rank >= 2 (3-D experts too).
        vectors = sum((math.prod(shape[:-1]) + math.prod(shape[:-2]) * shape[-1]) * n if len(shape) >= 2
                      else shape[0] * n for shape, n in model.tensor_shapes)
        return min(1.0, vectors / max(model.n_params, 1))
    vectors = sum((i + o) * n for _, i, o, n in model_linears(model))
    vectors += 2 * (model.vocab_size + model.hidden_size)
    return min(1.0, vectors / max(model.n_params, 1))


# Source: bitsandbytes optim/optimizer.py Optimizer2State.init_state: a tensor with fewer elements than
# min_8bit_size (4096) keeps fp32 state1/state2 even in the 8-bit optimizers.
MIN_8BIT_SIZE = 4096


def eightbit_fraction(model, rank: int = 0, targets: tuple[str, ...] = ()) -> float:
    """Share of the trained parameters whose AdamW8bit state is 8-bit (tensors of at least
    min_8bit_size elements): 1 for a full model (its small norms are negligible); for LoRA, per
    adapter matrix A (r x in) and B (out x r)."""
    if not rank:
        return 1.0
    wanted = set(targets)
    total = big = 0
    for name, i, o, n in model_linears(model):
        if "all-linear" in wanted or name in wanted:
            for size in (rank * i, rank * o):
                total += size * n
                big += size * n if size >= MIN_8BIT_SIZE else 0
    return big / total if total else 1.0


def optimizer_state_bytes_per_param(optimizer: str, state_bytes: int, factored: float) -> float:
    """factored: Adafactor's row+col ratio; for adamw8bit the share of 8-bit state (eightbit_fraction)."""
    # Source: torch.optim AdamW/SGD keep moments in the param dtype; bitsandbytes AdamW8bit 1 B per
    # moment + fp32 absmax per 256-block (fp32 moments below min_8bit_size); Lion one moment;
    # Adafactor factored row+col statistics. PagedAdamW8bit holds the same bytes in CUDA unified memory.
    if optimizer == "adamw":
        return 2 * state_bytes
    if optimizer == "adamw8bit":
        return factored * (2 + 2 * 4 / 256) + (1 - factored) * 2 * 4
    if optimizer in ("sgd", "lion"):
        return state_bytes
    return state_bytes * factored  # adafactor


@lru_cache(maxsize=512)
def zero3_persistent_params(model, threshold: int) -> int:
    """Parameters ZeRO-3 keeps gathered on every rank: tensors with numel below
    stage3_param_persistence_threshold (norms, biases, and every matrix of a small model)."""
    if not model.has_shape:
        return 0
    if model.derived:
        return sum(math.prod(shape) * n for shape, n in model.tensor_shapes if math.prod(shape) < threshold)
    mats = [i * o * n for _, i, o, n in block_linears(model)]
    embed = model.vocab_size * model.hidden_size
    router = model.hidden_size * model.num_experts
    position = model.max_position * model.hidden_size if model.family in ("gpt2", "bert") else 0
    big = [embed] * (1 if model.tie_embeddings else 2) + ([position] if position else [])
    if model.family == "bert":
        big.append(model.hidden_size * model.hidden_size)  # the MLM head's transform.dense
    matrices = model.num_layers * (sum(mats) + router) + sum(big)
    vectors = max(0, model.n_params - matrices)  # norms and biases: always below the threshold
    small = model.num_layers * (sum(m for m in mats if m < threshold) + (router if router < threshold else 0))
    small += sum(m for m in big if m < threshold)
    return vectors + small


def largest_tensor(model, largest_layer: int) -> int:
    """Elements of the largest single parameter tensor (a derived spec knows every shape; the
    hand-written rules use the largest module, which for them is one tensor)."""
    if model.derived and model.tensor_shapes:
        return max(math.prod(shape) for shape, _ in model.tensor_shapes)
    return largest_layer


def step_scratch_params(model, largest_layer: int) -> tuple[int, int]:
    """(largest tensor, previous tensor) for the single-tensor optimizer loop's scratch, so that
    2*largest + previous is single-tensor AdamW's exact peak (derived specs record it in order)."""
    if model.derived and model.single_adam_peak:
        big = largest_tensor(model, largest_layer)
        return big, max(0, model.single_adam_peak - 2 * big)
    return largest_layer, param_before_largest(model)


def param_before_largest(model) -> int:
    """Elements of the parameter registered just before the largest one: the token embedding when
    the position embedding is the largest (GPT-2 / BERT with more positions than tokens); otherwise
    the largest is the token embedding (registered first) or the head (after a norm vector): ~0."""
    if not model.has_shape or model.family not in ("gpt2", "bert"):
        return 0
    position, embed = model.max_position * model.hidden_size, model.vocab_size * model.hidden_size
    return embed if position > embed and position >= model.largest_layer_params else 0


@lru_cache(maxsize=512)
def zero3_gathered_bounds(model, threshold: int) -> tuple[int, int]:
    """(largest tensor ZeRO-3 gathers, all gatherable params): tensors at or above the threshold."""
    if model.derived:
        big = [math.prod(shape) for shape, _ in model.tensor_shapes if math.prod(shape) >= threshold]
        return max(big, default=0), max(0, model.n_params - zero3_persistent_params(model, threshold))
    mats = [i * o * n for _, i, o, n in block_linears(model)] + [model.hidden_size * model.num_experts]
    embed = model.vocab_size * model.hidden_size
    big = [m for m in mats + [embed] if m >= threshold]
    return (max(big) if big else 0), max(0, model.n_params - zero3_persistent_params(model, threshold))


class States:
    """Per-rank model-state bytes by where and when they live (plain attributes; built once per plan)."""
    __slots__ = ("params", "grads_persistent", "grads_full", "grads_step", "optimizer", "host", "nvme",
                 "trained_per_rank", "state_bytes", "terms", "grads_optimizer", "params_optimizer")

    def __init__(self):
        self.params = self.grads_persistent = self.grads_full = self.grads_step = self.optimizer = 0
        self.grads_optimizer = self.params_optimizer = None  # None: grads_full + grads_step / params
        self.host = {}
        self.nvme = 0
        self.trained_per_rank = 0
        self.state_bytes = 4
        self.terms = None


def model_states(kind: str, shard: int, world: int, precision: str, optimizer: str, trained: int,
                 frozen_bytes: int, factored: float, offload_optimizer, offload_params,
                 persistent_params: int = 0, largest_param: int = 0, explain: bool = False,
                 bucket_view: bool = False) -> States:
    """Real engine accounting. kind: single | ddp | fsdp | zero1 | zero2 | zero3; shard = ranks sharing
    the sharded states (N, or the hybrid group size; 1 for no_shard, ddp and single)."""
    out = States()
    rec = [] if explain else None
    mixed = precision in ("bf16", "fp16")
    if kind in ("zero1", "zero2", "zero3"):
        lp = 4 if precision == "fp32" else 2
        moments = optimizer_state_bytes_per_param(optimizer, 4, factored)
        part = trained / world
        # Source: DeepSpeed stage_1_and_2.py / stage3.py: fp32 master partition + optimizer moments.
        master = 4 * part  # a separate fp32 copy even when training in fp32
        opt = master + moments * part
        if kind == "zero3":
            params = lp * part + frozen_bytes / world + lp * persistent_params
            grads_persist = lp * part  # grad_partitions_flat_buffer, allocated at init
            grads_full = grads_persist
            step = 4 * min(part, ZERO3_SUB_GROUP_SIZE)  # fp32 grad of one sub-group at step
        else:
            params = lp * trained + frozen_bytes
            grads_persist = 0
            # DeepSpeed 0.19 reduces ZeRO-1 gradients during backward too (ipg buckets): partitions.
            grads_full = lp * part
            step = 4 * part  # fp32 gradient partition, created in step()
        out.state_bytes = 4
        host, nvme = {}, 0
        if offload_optimizer:
            where_opt = opt + step
            if kind == "zero3":
                where_opt += grads_persist  # the flat grad buffer follows the optimizer to the host
                grads_persist = grads_full = 0
            else:
                grads_full = 0
            step = 0
            if offload_optimizer == "nvme":
                nvme += int(opt + 4 * part)
                host["nvme_swap_buffers"] = int(4 * min(part, ZERO3_SUB_GROUP_SIZE) * 4)
                if kind == "zero3":
                    host["grad_partitions"] = int(lp * part)
            else:
                host["offloaded_optimizer"] = int(where_opt)
            opt = 0
        if offload_params:
            moved = lp * part + frozen_bytes / world
            params -= moved
            if offload_params == "nvme":
                nvme += int(moved)
                host["nvme_param_buffers"] = int(5 * 100_000_000 * lp)
            else:
                host["offloaded_params"] = int(moved)
        out.params, out.grads_persistent, out.grads_full, out.grads_step, out.optimizer = \
            int(params), int(grads_persist), int(grads_full), int(step), int(opt)
        if kind == "zero3":
            # Measured (DeepSpeed 0.19, CPU): without parameter offload the persistent params'
            # gathered copies are not resident during step(); with it they stay.
            if not offload_params:
                out.params_optimizer = int(params - lp * persistent_params)
        else:
            # step() converts the 16-bit partition to fp32 and frees it before the update.
            out.grads_optimizer = int(step)
        out.host, out.nvme = host, nvme
        out.trained_per_rank = int(part)
        if rec is not None:
            rec.append(("params", out.params, "lp*T/N + frozen/N + lp*persistent" if kind == "zero3" else "lp*T + frozen",
                        {"lp": lp, "T": trained, "N": world, "frozen": frozen_bytes, "persistent": persistent_params},
                        "DeepSpeed: 16-bit model params (partitioned in ZeRO-3)"))
            rec.append(("grads", out.grads_full, "lp*T/N" if kind != "zero1" else "lp*T",
                        {"lp": lp, "T": trained, "N": world}, "DeepSpeed: 16-bit gradient (partition in ZeRO-2/3)"))
            rec.append(("fp32_grad_at_step", out.grads_step, "4*min(T/N, sub_group)" if kind == "zero3" else "4*T/N",
                        {"T": trained, "N": world}, "DeepSpeed step(): fp32 copy of the gradient partition"))
            rec.append(("optimizer", out.optimizer, "(4 master + moments)*T/N",
                        {"moments": moments, "T": trained, "N": world, "offload": offload_optimizer},
                        "ZeRO paper K=12 for Adam: fp32 master 4 + moments 8"))
        out.terms = rec
        return out

    # single, DDP and FSDP: torch keeps the optimizer in the dtype of the (sharded) parameters. A
    # single-device loop's grads exist from backward to zero_grad(set_to_none=True), as DDP's do.
    param_bytes = 2 if precision == "bf16-pure" else 4
    moments = optimizer_state_bytes_per_param(optimizer, param_bytes, factored)
    part = trained / shard
    params = param_bytes * part + frozen_bytes / shard
    grads = param_bytes * part
    opt = moments * part
    out.state_bytes = param_bytes
    if kind == "ddp" and bucket_view:
        # Source: DDP gradient_as_bucket_view: grads live in the reducer's buckets for the whole run.
        out.grads_persistent = int(grads)
    host = {}
    if offload_params:
        host["offloaded_states"] = int(params + grads + opt)
        params = grads = opt = 0
        out.grads_persistent = 0
    out.params, out.grads_full, out.optimizer = int(params), int(grads), int(opt)
    out.host = host
    out.trained_per_rank = int(part)
    if rec is not None:
        rec.append(("params", out.params, "pbytes*T/S + frozen/S",
                    {"pbytes": param_bytes, "T": trained, "S": shard, "frozen": frozen_bytes, "mixed": mixed},
                    "FSDP MixedPrecision keeps sharded params fp32; DDP autocast keeps fp32 params"))
        rec.append(("grads", out.grads_full, "pbytes*T/S", {"pbytes": param_bytes, "T": trained, "S": shard},
                    "grads in the (sharded) param dtype"))
        rec.append(("optimizer", out.optimizer, "moments*T/S", {"moments": moments, "T": trained, "S": shard},
                    "torch.optim state follows the param dtype"))
    out.terms = rec
    return out


def ideal_states(stage: int, shard: int, precision: str, optimizer: str, trained: int, factored: float):
    # Source: ZeRO paper (arXiv 1910.02054) sec. 5: (2 + 2 + K)*P, K = 12 for mixed-precision Adam.
    lp = 4 if precision == "fp32" else 2
    k = optimizer_state_bytes_per_param(optimizer, 4, factored) + (0 if precision == "fp32" else 4)
    params = lp * trained / (shard if stage >= 3 else 1)
    grads = lp * trained / (shard if stage >= 2 else 1)
    opt = k * trained / (shard if stage >= 1 else 1)
    return int(params), int(grads), int(opt), k
