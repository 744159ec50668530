"""Consolidated export: a Hugging Face directory (config.json + safetensors, split into several
files when large) that `AutoModelForCausalLM.from_pretrained` loads.

Tensors arrive one at a time (from a live engine, a DCP checkpoint read key by key, or DeepSpeed's
zero_to_fp32), and rank 0 writes a file whenever the pending tensors reach the shard size, so
neither the GPU nor the host ever holds more than one shard beyond the tensor being gathered.
"""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Iterable

from shardfit.errors import ShardfitError

MAX_SHARD_BYTES = 2 * 1024**3


def write_hf_dir(items: Iterable, config: dict, out: Path, write: bool = True,
                 max_shard_bytes: int = MAX_SHARD_BYTES) -> list[Path]:
    """items: (name, tensor or None). Every rank must iterate (the engine gathers inside); only the
    rank with write=True touches the disk."""
    from safetensors.torch import save_file

    out = Path(out)
    pending: dict = {}
    pending_bytes = 0
    written: list[tuple[Path, list[str]]] = []
    if write:
        out.mkdir(parents=True, exist_ok=True)
        for old in out.glob("model*.safetensors*"):
            old.unlink()

    def flush():
        nonlocal pending, pending_bytes
        if pending:
            path = out / f".part-{len(written) + 1:05d}.safetensors"
            save_file(pending, str(path), metadata={"format": "pt"})
            written.append((path, list(pending)))
        pending, pending_bytes = {}, 0

    tied = bool(config.get("tie_word_embeddings", False))
    for name, tensor in items:
        if not write or tensor is None:
            continue
        if tied and name == "lm_head.weight":
            continue
        # NOTE: clone: consolidated tensors may share storage (FSDP1 flat params, the optimizer's
        # step scalars), which safetensors refuses.
        tensor = tensor.detach().contiguous().cpu().clone()
        size = tensor.numel() * tensor.element_size()
        if pending and pending_bytes + size > max_shard_bytes:
            flush()
        pending[name] = tensor
        pending_bytes += size
    if not write:
        return []
    flush()
    if not written:
        raise ShardfitError("export found no model tensors: is this a model checkpoint?")
    final: list[Path] = []
    index: dict[str, str] = {}
    for number, (path, names) in enumerate(written, 1):
        name = "model.safetensors" if len(written) == 1 else f"model-{number:05d}-of-{len(written):05d}.safetensors"
        os.replace(path, out / name)
        final.append(out / name)
        index.update({key: name for key in names})
    if len(written) > 1:
        total = sum(p.stat().st_size for p in final)
        (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": total},
                                                                       "weight_map": index}, indent=2))
    config = {**config, "use_cache": True}
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return final


def export_engine(engine, out: Path, max_shard_bytes: int = MAX_SHARD_BYTES) -> None:
    """From a live engine (all ranks call this)."""
    import torch.distributed as dist

    config = engine.module.config.to_dict()
    items = engine.full_state()
    if engine.plan.training.lora is not None:
        items = merge_lora(items, engine.plan.training.lora)
    write_hf_dir(items, config, out, write=engine.ctx.is_main, max_shard_bytes=max_shard_bytes)
    dist.barrier()


def export_checkpoint(checkpoint: Path, out: Path, max_shard_bytes: int = MAX_SHARD_BYTES) -> list[Path]:
    """From a checkpoint folder, in one process, no process group needed."""
    from shardfit.train.checkpoint import read_manifest

    checkpoint = Path(checkpoint)
    manifest = read_manifest(checkpoint)
    config_file = checkpoint / "config.json"
    if not config_file.is_file():
        raise ShardfitError(f"{checkpoint} has no config.json: it was not written by `shardfit train`")
    config = json.loads(config_file.read_text())
    if manifest["format"] == "dcp":
        items = dcp_model_tensors(checkpoint / "dcp")
    else:
        items = deepspeed_model_tensors(checkpoint / "deepspeed")
    if manifest.get("lora"):
        import yaml

        from shardfit.spec.models import load_model_spec
        from shardfit.spec.plan import plan_from_dict

        plan = plan_from_dict(yaml.safe_load((checkpoint / "plan.yaml").read_text()), resolve_model=load_model_spec)
        items = merge_lora(items, plan.training.lora)
    return write_hf_dir(items, config, out, max_shard_bytes=max_shard_bytes)


_PEFT_PREFIX = "base_model.model."
_LORA_PARTS = (".base_layer.", ".lora_A.", ".lora_B.")


def merge_lora(items: Iterable, lora):
    """Fold peft LoRA adapters into plain weights (W + alpha/r * B @ A) as the tensors stream by, so
    the export is an ordinary model. Names lose peft's prefixes; non-main ranks pass None through."""
    scale = lora.alpha / lora.rank
    pending: dict[str, dict] = {}
    for name, tensor in items:
        name = name[len(_PEFT_PREFIX):] if name.startswith(_PEFT_PREFIX) else name
        part = next((p for p in _LORA_PARTS if p in name), None)
        if tensor is None or part is None:
            yield name, tensor
            continue
        module, _, rest = name.partition(part)
        if part == ".base_layer." and rest != "weight":
            yield f"{module}.{rest}", tensor  # the base layer's bias is unchanged
            continue
        entry = pending.setdefault(module, {})
        entry[part] = tensor
        if len(entry) == 3:
            del pending[module]
            base = entry[".base_layer."]
            delta = entry[".lora_B."].float() @ entry[".lora_A."].float()
            yield f"{module}.weight", (base.float() + scale * delta).to(base.dtype)
    if pending:
        raise ShardfitError(f"LoRA export: incomplete adapter for {next(iter(pending))} (base weight, lora_A and lora_B needed)")


def dcp_model_tensors(path: Path, prefix: str = "model."):
    """Read a DCP checkpoint's model tensors one by one, without a process group."""
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    metadata = dcp.FileSystemReader(str(path)).read_metadata()
    for key, meta in metadata.state_dict_metadata.items():
        if not key.startswith(prefix) or not isinstance(meta, TensorStorageMetadata):
            continue
        tensor = torch.empty(meta.size, dtype=meta.properties.dtype)
        dcp.load({key: tensor}, checkpoint_id=str(path), no_dist=True)
        yield key[len(prefix):], tensor


def deepspeed_model_tensors(path: Path):
    """DeepSpeed's own consolidation (zero_to_fp32): fp32 master weights from the ZeRO shards."""
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    from shardfit.engines.deepspeed import TAG

    state = get_fp32_state_dict_from_zero_checkpoint(str(path), tag=TAG)
    for name in list(state):
        yield name, state.pop(name)


def copy_tokenizer_note(out: Path, tokenizer_name: str) -> None:
    """Byte-level runs have no tokenizer files; say so next to the weights."""
    if tokenizer_name == "bytes":
        (Path(out) / "TOKENIZER.txt").write_text("byte-level: ids 0-255 are UTF-8 bytes, 256 BOS, 257 EOS, 258 PAD\n")
    elif Path(tokenizer_name).is_dir():
        for file in Path(tokenizer_name).iterdir():
            if file.is_file() and ("token" in file.name or file.name.endswith(".model")):
                shutil.copy(file, Path(out) / file.name)
