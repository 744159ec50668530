"""Consolidated export: a Hugging Face directory (config.json + safetensors, split into several
files when large) that `AutoModelForCausalLM.from_pretrained` loads.

Tensors arrive one at a time (from a live engine, a DCP checkpoint read key by key, or DeepSpeed's
zero_to_fp32), and rank 0 writes a file whenever the pending tensors reach the shard size, so
neither the GPU nor the host ever holds more than one shard beyond the tensor being gathered.

From a DCP checkpoint the sizes come from its metadata before any data is read, so the pending shard
is written out *before* the next tensor is read; tensors go to safetensors as read (copied only when
they share storage), a tensor's chunks are read one at a time, and the metadata is read once. The
host then holds about the largest tensor (plus one of its chunks, DCP's temporary) or one shard.
"""
from __future__ import annotations

import functools
import json
import math
import os
import shutil
from pathlib import Path
from typing import Iterable

from shardfit.errors import ShardfitError
from shardfit.spec.models import load_model_spec
from shardfit.spec.plan import plan_from_dict

MAX_SHARD_BYTES = 2 * 1024**3


@functools.cache
def _malloc_trim():
    import ctypes

    try:
        return ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError, TypeError):  # not glibc
        return None


def release_free_heap() -> None:
    """Hand freed heap memory back to the OS now: glibc's malloc_trim(0), a no-op where there is none.
    It changes no allocator setting; it only returns pages that nothing uses any more.

    Why: once glibc frees an mmap'd block of up to 32 MiB it raises its mmap threshold to that size
    (the dynamic threshold), so later tensors and DCP's chunk temporaries come from the brk heap,
    whose pages stay resident after free(); and a freed hole split by one small allocation no longer
    fits the next chunk, which then grows the heap. Without this, a written shard or a chunk's
    temporary stays resident under the next tensor (the benchmark's ratio: 1.04 in most runs, 1.37
    in about one in ten)."""
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


class LazyTensor:
    """A tensor not read yet, with its size known (from checkpoint metadata): the writer flushes the
    pending shard before calling load(), so the two never coexist in memory."""

    __slots__ = ("nbytes", "_load")

    def __init__(self, nbytes: int, load):
        self.nbytes = int(nbytes)
        self._load = load

    def load(self):
        return self._load()


def materialize(tensor):
    """The tensor itself (a LazyTensor is read now); None stays None."""
    return tensor.load() if isinstance(tensor, LazyTensor) else tensor


def _nbytes(tensor) -> int:
    return tensor.nbytes if isinstance(tensor, LazyTensor) else tensor.numel() * tensor.element_size()


def _owned(tensor, pending_storages: set):
    """A host tensor safe to hand to safetensors and cheap to keep: copied only when it is a view into
    a larger storage (FSDP1 flat params, the optimizer's step scalars: safetensors refuses tensors
    that share a storage, and keeping the view would pin the whole of it) or when its storage already
    backs a pending tensor (the same tensor under two names). A tensor that owns its storage, such as
    one just read from DCP or gathered to the host, is kept as it is."""
    tensor = tensor.detach().contiguous().cpu()
    storage = tensor.untyped_storage()
    size = tensor.numel() * tensor.element_size()
    if size and (storage.nbytes() > size or storage.data_ptr() in pending_storages):
        tensor = tensor.clone()
    return tensor


def write_hf_dir(items: Iterable, config: dict, out: Path, write: bool = True,
                 max_shard_bytes: int = MAX_SHARD_BYTES) -> list[Path]:
    """items: (name, tensor or LazyTensor or None). Every rank must iterate (the engine gathers inside);
    only the rank with write=True touches the disk. Each file holds at most max_shard_bytes of tensor
    data, unless a single tensor is larger (it then gets a file of its own)."""
    from safetensors.torch import save_file

    out = Path(out)
    pending: dict = {}
    pending_bytes = 0
    pending_storages: set = set()
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
        pending, pending_bytes = {}, 0  # drop the references now: the next tensor reuses the memory
        pending_storages.clear()
        release_free_heap()

    tied = bool(config.get("tie_word_embeddings", False))
    for name, tensor in items:
        if not write or tensor is None:
            continue
        if tied and name == "lm_head.weight":
            continue
        size = _nbytes(tensor)
        # Flush before a lazy tensor is read (and before a device tensor comes to the host), so the
        # pending shard and the next tensor are not in memory together.
        if pending and pending_bytes + size > max_shard_bytes:
            flush()
        tensor = _owned(materialize(tensor), pending_storages)
        pending[name] = tensor
        pending_bytes += size
        if size:
            pending_storages.add(tensor.untyped_storage().data_ptr())
        del tensor  # `pending` holds the only reference: flush() frees it
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
            yield name, tensor  # a LazyTensor stays lazy: the writer reads it when it has room
            continue
        module, _, rest = name.partition(part)
        if part == ".base_layer." and rest != "weight":
            yield f"{module}.{rest}", tensor  # the base layer's bias is unchanged
            continue
        entry = pending.setdefault(module, {})
        entry[part] = materialize(tensor)
        if len(entry) == 3:
            del pending[module]
            base = entry[".base_layer."]
            delta = entry[".lora_B."].float() @ entry[".lora_A."].float()
            yield f"{module}.weight", (base.float() + scale * delta).to(base.dtype)
    if pending:
        raise ShardfitError(f"LoRA export: incomplete adapter for {next(iter(pending))} (base weight, lora_A and lora_B needed)")


def dcp_model_tensors(path: Path, prefix: str = "model."):
    """A DCP checkpoint's model tensors, one by one and without a process group, as LazyTensors: the
    size comes from the metadata, the data when the writer calls load().

    This is dcp.load's own protocol (planner and FileSystemReader), with the metadata read once
    instead of once per key, and the read plan executed one chunk (one rank's shard) at a time: the
    reader torch.loads a chunk into a temporary and copies it into the tensor, so a read holds the
    tensor plus one chunk, never the tensor plus two temporaries."""
    import dataclasses

    import torch
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from shardfit.engines.dcp_io import SafeMetadataReader

    reader = SafeMetadataReader(str(path))
    metadata = reader.read_metadata()
    reader.set_up_storage_reader(metadata, True)

    def loader(key: str, meta: TensorStorageMetadata):
        def load():
            tensor = torch.empty(meta.size, dtype=meta.properties.dtype)
            planner = DefaultLoadPlanner()
            planner.set_up_planner({key: tensor}, metadata, True)
            plan = reader.prepare_local_plan(planner.create_local_plan())
            plan = planner.finish_plan(reader.prepare_global_plan(planner.create_global_plan([plan]))[0])
            for item in plan.items:
                reader.read_data(dataclasses.replace(plan, items=[item]), planner).wait()
                release_free_heap()  # the chunk's temporary: not resident while the next is read
            return tensor

        return load

    for key, meta in metadata.state_dict_metadata.items():
        if not key.startswith(prefix) or not isinstance(meta, TensorStorageMetadata):
            continue
        yield key[len(prefix):], LazyTensor(math.prod(meta.size) * meta.properties.dtype.itemsize, loader(key, meta))


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
