"""What every emitter shares: the output bundle, the model's HF config and block class, atomic writes."""
from __future__ import annotations

import json
import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from shardfit.errors import ShardfitError
from shardfit.spec.model_spec import ModelSpec
from shardfit.spec.plan import Plan, is_selective_ac, parse_activation_checkpointing

PRESETS = Path(__file__).resolve().parents[1] / "spec" / "presets"


@dataclass(frozen=True, kw_only=True)
class EmitOptions:
    plan_path: str = "plan.yaml"  # how launch commands refer to the plan
    entry: str | None = None  # training entry point; None = `-m shardfit train PLAN`
    master_addr: str = "$MASTER_ADDR"
    master_port: int = 29500
    hosts: tuple[str, ...] = ()  # hostfile names; default node-0, node-1, ...
    time_limit: str = "24:00:00"  # SLURM
    out_dir: str = "out"
    weights: str | None = None  # FSDP scripts: a save_pretrained folder of safetensors to start from
    # Training scripts' data (None: the plan's data section; no data there: random tokens).
    data: str | None = None  # .txt / .jsonl file or an HF dataset folder (save_to_disk)
    tokenizer: str | None = None  # a local tokenizer folder; None: byte-level
    pack: bool = False  # documents packed into full SEQ_LEN rows instead of padded batches


@dataclass(frozen=True, kw_only=True)
class Emitted:
    """Files to write (name -> text; the first is the main one) and notes for the user (stderr)."""
    files: dict[str, str]
    notes: tuple[str, ...] = field(default=())

    @property
    def main(self) -> str:
        return next(iter(self.files.values()))


def hf_config(spec: ModelSpec) -> dict | None:
    """The model's Hugging Face config (preset file, local config path, or rebuilt from the shape);
    None for a model that is not a transformers model (nn.Module factory, params-only)."""
    if spec.family in ("module", "params"):
        return None
    for candidate in (PRESETS / f"{spec.source}.json", Path(spec.source), Path(spec.source) / "config.json"):
        try:
            if candidate.is_file():
                return json.loads(candidate.read_text())
        except (OSError, ValueError):
            continue
    if spec.family in ("llama", "mistral", "qwen2") and spec.has_shape:
        return {"model_type": spec.family, "hidden_size": spec.hidden_size, "num_hidden_layers": spec.num_layers,
                "num_attention_heads": spec.num_heads, "num_key_value_heads": spec.num_kv_heads or spec.num_heads,
                "intermediate_size": spec.intermediate_size, "vocab_size": spec.vocab_size,
                "max_position_embeddings": spec.max_position or 4096, "tie_word_embeddings": spec.tie_embeddings}
    if spec.family == "gpt2" and spec.has_shape:
        return {"model_type": "gpt2", "n_embd": spec.hidden_size, "n_layer": spec.num_layers, "n_head": spec.num_heads,
                "vocab_size": spec.vocab_size, "n_positions": spec.max_position or 1024}
    return None


def block_class(spec: ModelSpec) -> str:
    """The repeated block class name: the FSDP wrap unit and activation-checkpointing unit."""
    if spec.block_class:
        return spec.block_class
    defaults = {"llama": "LlamaDecoderLayer", "mistral": "MistralDecoderLayer", "qwen2": "Qwen2DecoderLayer",
                "mixtral": "MixtralDecoderLayer", "gemma2": "Gemma2DecoderLayer", "gpt2": "GPT2Block", "bert": "BertLayer"}
    if spec.family in defaults:
        return defaults[spec.family]
    raise ShardfitError(f"model '{spec.name}' has no known block class: set block_class in its spec "
                        "(the class name of the repeated transformer layer, e.g. LlamaDecoderLayer)")


def block_module(spec: ModelSpec) -> str:
    """The transformers module that defines the block class, for `import` lines."""
    config = hf_config(spec) or {}
    model_type = config.get("model_type") or spec.family
    return f"transformers.models.{model_type}.modeling_{model_type}"


def script_inputs(plan: Plan, script: str, own_module: str) -> tuple[dict, dict | None]:
    """(model config, LoRA kwargs) of an emitted training script, as template values; one error line
    when the plan cannot be written as such a script. own_module: the formats for a user's nn.Module."""
    t = plan.training
    config = hf_config(plan.model)
    if config is None:
        raise ShardfitError(f"model '{plan.model.name}' is not a transformers model: the {script} needs a preset "
                            f"or a config.json; for your own nn.Module use {own_module}")
    if not plan.model.causal_lm:
        raise ShardfitError(f"the {script} trains causal language models and {plan.model.name} is not one: "
                            "use --format accelerate or hf-trainer with your own training script")
    if t.lora is not None and t.lora.base_dtype in ("int8", "nf4"):
        raise ShardfitError(f"the {script} has no quantized base ({t.lora.base_dtype}): use lora.base_dtype bf16, "
                            "or --format hf-trainer with bitsandbytes")
    lora = None
    if t.lora is not None:
        lora = {"r": t.lora.rank, "lora_alpha": t.lora.alpha, "lora_dropout": t.lora.dropout,
                "target_modules": list(t.lora.target_modules)}
    config = {k: v for k, v in config.items() if k not in ("architectures", "torch_dtype", "transformers_version", "dtype")}
    return dict(sorted(config.items())), lora


def ac_every(plan: Plan) -> int:
    return parse_activation_checkpointing(plan.training.activation_checkpointing)


# Per-op selective checkpointing in an emitted script: the policy shardfit's engines run (shardfit/sac.py),
# written out so the script needs no shardfit. Inserted after the templates are dedented.
_SAC_CODE = '''

def selective_checkpoint_wrapper(module):
    # Per-op selective activation checkpointing (torchtitan's "op" mode): keep the outputs of the
    # attention kernel and of every other matmul; recompute the rest in backward.
    from collections import defaultdict

    from torch.distributed.algorithms._checkpoint import checkpoint_wrapper as cw
    from torch.utils.checkpoint import (
        CheckpointPolicy,
        create_selective_checkpoint_contexts,
    )

    aten = torch.ops.aten
    keep = {aten._scaled_dot_product_flash_attention.default, aten._scaled_dot_product_efficient_attention.default,
            aten._scaled_dot_product_cudnn_attention.default, aten._scaled_dot_product_flash_attention_for_cpu.default}

    def context_fn():
        counts = defaultdict(int)

        def policy(ctx, func, *args, **kwargs):
            if func in (aten.mm.default, aten.addmm.default):  # a matmul, with or without its bias
                counts[ctx.is_recompute] += 1
                saved = counts[ctx.is_recompute] % 2 == 1
            else:
                saved = func in keep
            return CheckpointPolicy.MUST_SAVE if saved else CheckpointPolicy.PREFER_RECOMPUTE
        return create_selective_checkpoint_contexts(policy)

    return cw.checkpoint_wrapper(module, context_fn=context_fn)
'''


# build_model() and apply_activation_checkpointing() as every emitted training script has them.
_MODEL_FUNCTIONS = '''def build_model():
    # Random init from the config. For pretrained weights: AutoModelForCausalLM.from_pretrained(...).
    from transformers import AutoConfig, AutoModelForCausalLM
    config = dict(MODEL_CONFIG)
    config = AutoConfig.for_model(config.pop("model_type"), **config)
    config.use_cache = False  # the KV cache breaks recomputation under activation checkpointing
    model = AutoModelForCausalLM.from_config(config)
    if LORA:
        from peft import LoraConfig, get_peft_model
        model = get_peft_model(model, LoraConfig(task_type="CAUSAL_LM", **LORA))
    return model
{sac_code}

def apply_activation_checkpointing(model):
    from torch.distributed.algorithms._checkpoint import checkpoint_wrapper as cw
    blocks = [m for m in model.modules() if type(m).__name__ == BLOCK_CLASS]
    chosen = {{id(m) for m in blocks[::AC_EVERY]}}
    cw.apply_activation_checkpointing(model, checkpoint_wrapper_fn={ac_wrapper}, check_fn=lambda m: id(m) in chosen)
'''


def model_functions(plan: Plan) -> str:
    """The emitted scripts' model builder and checkpointing (dedented: insert after the template is)."""
    sac_code, wrapper = ac_wrapper(plan)
    wrapper = "cw.checkpoint_wrapper" if wrapper == "checkpoint_wrapper" else wrapper
    return _MODEL_FUNCTIONS.format(sac_code=sac_code, ac_wrapper=wrapper)


def ac_wrapper(plan: Plan) -> tuple[str, str]:
    """(extra script code, checkpoint wrapper name) for the plan's activation checkpointing."""
    if is_selective_ac(plan.training.activation_checkpointing):
        return _SAC_CODE, "selective_checkpoint_wrapper"
    return "", "checkpoint_wrapper"


def launch_entry(options: EmitOptions) -> str:
    return options.entry or f"-m shardfit train {options.plan_path}"


def write_files(files: dict[str, str], target: str | os.PathLike, single: bool) -> list[Path]:
    """Write all files atomically: every file goes to a temporary name in its final folder first and
    is renamed only when all were written, so a failure never leaves a partial output file.
    `single`: target is the file itself; otherwise it is a folder."""
    target = Path(target)
    paths = [target] if single else [target / name for name in files]
    written: list[tuple[str, Path]] = []
    try:
        for path, text in zip(paths, files.values()):
            path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
            with os.fdopen(fd, "w") as handle:
                handle.write(text)
            if path.suffix in (".sh", ".sbatch") or text.startswith("#!"):
                os.chmod(tmp, 0o755)
            else:
                os.chmod(tmp, 0o644)
            written.append((tmp, path))
    except OSError as exc:
        for tmp, _ in written:
            Path(tmp).unlink(missing_ok=True)
        raise ShardfitError(f"cannot write {exc.filename or target}: {exc.strerror}") from None
    for tmp, path in written:
        os.replace(tmp, path)
    return paths


# The end of every multi-rank script's main(), inserted into its dedented template (continuation lines carry
# the indentation of their place there). Why the os._exit: a core dump of the abort showed gloo's worker
# thread freeing a finished barrier (and the broadcast it held, with Python-owned tensors) while the
# interpreter shut down; taking the GIL then ends the thread, and that aborts the rank (SIGABRT after a
# complete run, 5 of 72 runs on a loaded 2-core CPU; torch 2.13).
SCRIPT_FINISH = """dist.barrier()
    dist.destroy_process_group()
    if not cuda:
        # gloo: a process-group thread can still be freeing the last collectives' tensors when the interpreter
        # shuts down, and that aborts this rank after a complete run (torch 2.13). Everything is written and
        # flushed by now: end without the interpreter's shutdown.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)"""
