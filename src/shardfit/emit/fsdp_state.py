"""The FSDP1 / FSDP2 scripts' weights and state: the model's own init on the sharded parameters,
pretrained safetensors read shard by shard, sharded DCP checkpoints with resume, and a consolidated
safetensors export that `from_pretrained` loads. Source text only (emit imports no torch).

Host RAM per node, for P parameters and R ranks per node (fp32 = 4 bytes a parameter):
- meta build + own init: the model never exists unsharded; each rank materialises its shard on its
  device, so host RAM is the processes' own overhead (no 4·P·R copies, no 4·P copy either).
- --weights (DCP's HuggingFace reader): each rank reads only the slices of its own shards from the
  memory-mapped safetensors files, so host RAM holds page cache of the file at most, never a rank's
  full copy.
- the consolidated export gathers one tensor at a time on rank 0 (DCP consolidation): the largest
  tensor, not the model.
"""
from __future__ import annotations

# Inserted as it is (not a format template) after fsdp.py's templates are dedented.
STATE_CODE = '''

def init_weights(model, modules):
    # The model's own initialisation on the already-sharded parameters: transformers' _init_weights per
    # module (normal(0, initializer_range) for linear and embedding weights, ones for norms, the rotary
    # frequencies recomputed), as from_config would have run it on the unsharded model. LoRA's B stays 0,
    # so training starts from the base model.
    hf = model.get_base_model() if LORA else model
    lora_b = {id(m) for layer in model.modules() if hasattr(layer, "lora_B") for m in layer.lora_B.values()}
    with torch.no_grad():
        for module in modules:
            if id(module) in lora_b:
                module.weight.zero_()
            else:
                hf._init_weights(module)


def load_weights(model, path):
    # Pretrained weights from a save_pretrained folder (*.safetensors): each rank reads only the slices of
    # its own shards (DCP's HuggingFace reader over memory-mapped files); no rank holds a full copy.
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        set_model_state_dict,
    )
    state = get_model_state_dict(model)
    reader = dcp.HuggingFaceStorageReader(path)
    stored = reader.read_metadata().state_dict_metadata
    # The file's names are the plain model's: without peft's prefix and base_layer; adapters keep their init.
    names = {k.replace("base_model.model.", "", 1).replace(".base_layer.", "."): k for k in state if "lora_" not in k}
    missing = [n for n in names if n not in stored and not (n == "lm_head.weight" and TIED)]
    if missing:
        raise SystemExit(f"{path} has no {', '.join(missing[:3])}{' ...' if len(missing) > 3 else ''}: "
                         "not this model's weights")
    part = {n: state[k] for n, k in names.items() if n in stored}
    dcp.load(part, storage_reader=reader)
    set_model_state_dict(model, {names[n]: t for n, t in part.items()}, options=StateDictOptions(strict=False))


def newest_checkpoint():
    # The newest complete checkpoint: saves go to step-N.tmp and are renamed when every rank has written,
    # so a kill mid-save leaves only a .tmp, never a half-written step-N.
    if not os.path.isdir(CKPT_DIR):
        return None, 0
    done = [d for d in os.listdir(CKPT_DIR) if d.startswith("step-") and d[5:].isdigit()
            and os.path.exists(os.path.join(CKPT_DIR, d, ".metadata"))]
    if not done:
        return None, 0
    newest = max(done, key=lambda d: int(d[5:]))
    return os.path.join(CKPT_DIR, newest), int(newest[5:])


def save_checkpoint(model, optimizer, step, rank):
    # Sharded: each rank writes its own shards of the weights and optimizer states (a shared filesystem
    # across nodes); resumable on another world size.
    import shutil

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict
    final = os.path.join(CKPT_DIR, f"step-{step}")
    tmp = final + ".tmp"
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)  # left by a kill mid-save
        os.makedirs(CKPT_DIR, exist_ok=True)
    dist.barrier()
    model_state, optim_state = get_state_dict(model, optimizer)
    dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=tmp)
    dist.barrier()
    if rank == 0:
        os.replace(tmp, final)
        print(f"saved {final}", flush=True)
    dist.barrier()


def load_checkpoint(model, optimizer, path):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    model_state, optim_state = get_state_dict(model, optimizer)
    state = {"model": model_state, "optim": optim_state}
    dcp.load(state, checkpoint_id=path)
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])


def export(model, rank):
    # Consolidated safetensors + config.json that AutoModelForCausalLM.from_pretrained(EXPORT_DIR) loads:
    # every rank writes its shards, then rank 0 consolidates them one tensor at a time (DCP's HuggingFace
    # writer), so no rank gathers the whole model.
    import json
    import shutil

    import torch.distributed.checkpoint as dcp
    from safetensors import safe_open
    from torch.distributed.checkpoint.state_dict import get_model_state_dict
    if LORA:
        export_adapters(model, rank)
        return
    state = get_model_state_dict(model)
    if TIED:
        state.pop("lm_head.weight", None)  # from_pretrained ties it back to the embedding
    writer = dcp.HuggingFaceStorageWriter(EXPORT_DIR, save_distributed=True, enable_consolidation=True)
    dcp.save(state, storage_writer=writer)
    if rank == 0:
        shutil.rmtree(os.path.join(EXPORT_DIR, "sharded"), ignore_errors=True)  # the per-rank parts, consolidated
        files = sorted(f for f in os.listdir(EXPORT_DIR) if f.endswith(".safetensors"))
        index = {"metadata": {}, "weight_map": {}}
        for name in files:
            with safe_open(os.path.join(EXPORT_DIR, name), framework="pt") as handle:
                index["weight_map"].update(dict.fromkeys(handle.keys(), name))
        with open(os.path.join(EXPORT_DIR, "model.safetensors.index.json"), "w") as handle:
            json.dump(index, handle, indent=1)
        model.config.save_pretrained(EXPORT_DIR)
        print(f"exported {EXPORT_DIR}", flush=True)
    dist.barrier()


def export_adapters(model, rank):
    # LoRA: the adapters only, as peft's save_pretrained writes them (adapter_model.safetensors +
    # adapter_config.json), for PeftModel.from_pretrained(base_model, EXPORT_DIR). FSDP2 / DDP gather only
    # the adapter tensors; FSDP1's sharded state dict has no per-tensor gather, so it goes through FSDP's
    # full state dict (unit by unit; on GPUs into rank 0's host memory) and keeps the adapters. NOTE: on CPU
    # (gloo) FSDP1's cpu_offload full state dict crashed rank 0 (SIGSEGV, torch 2.13), and the device is host
    # memory there anyway, so it offloads on GPUs only.
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
    )
    fsdp1 = type(model).__name__ == "FullyShardedDataParallel"
    options = StateDictOptions(full_state_dict=fsdp1, cpu_offload=fsdp1 and torch.cuda.is_available())
    state = get_model_state_dict(model, options=options)
    adapters = {}
    for name, value in state.items():
        if "lora_" in name:
            value = value.full_tensor() if hasattr(value, "full_tensor") else value
            adapters[name] = value.detach().cpu().clone()
    if rank == 0:
        getattr(model, "module", model).save_pretrained(EXPORT_DIR, state_dict=adapters)
        print(f"exported LoRA adapters to {EXPORT_DIR}", flush=True)
    dist.barrier()
'''


def state_functions(*names: str) -> str:
    """The named functions of STATE_CODE, in its order (the DDP script shares all but the FSDP export)."""
    blocks = ("\n" + STATE_CODE).split("\n\n\ndef ")
    chosen = [block for block in blocks[1:] if block.split("(", 1)[0] in names]
    assert len(chosen) == len(names), names
    return "".join("\n\n\ndef " + block.rstrip("\n") for block in chosen) + "\n"
