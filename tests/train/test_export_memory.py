"""Consolidation (`shardfit export` of a DCP checkpoint) without a process group: the files hold the
checkpoint's exact tensors, split at the shard size; each tensor is written as read (no copy), the
pending shard is written before the next tensor is read, and the process holds about one tensor plus
one shard. Small checkpoints written here with `dcp.save(no_dist=True)`: seconds, one process."""
from __future__ import annotations

import json
import subprocess
import sys
import warnings
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from launch import REPO
from shardfit.train import export

SHARD = 300_000  # bytes: below the embedding (2048 x 64 fp32 = 512 KiB), above every layer's tensors


def _save_dcp(state: dict, folder: Path) -> None:
    import torch.distributed.checkpoint as dcp

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "assuming the intent is to save in a single process"
        dcp.save(state, checkpoint_id=str(folder), no_dist=True)


def _make_checkpoint(folder: Path, model_state: dict, config: dict) -> Path:
    """A checkpoint folder as `shardfit train` writes one: config.json, dcp/ (model and optimizer
    state, like the engines' {"model", "optim"}), and a manifest with every file's checksum."""
    from shardfit.train.checkpoint import write_manifest

    folder.mkdir(parents=True)
    # Adam-like state and its step scalars: not model tensors, so never exported.
    optim = {"state": {name: {"step": torch.tensor(3.0), "exp_avg": torch.ones_like(t)}
                       for name, t in list(model_state.items())[:2]}}
    _save_dcp({"model": model_state, "optim": optim}, folder / "dcp")
    (folder / "config.json").write_text(json.dumps(config))
    write_manifest(folder, {"step": 1, "format": "dcp", "engine": "ddp", "world_size": 1, "lora": False})
    return folder


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    """A tiny Llama checkpoint: (folder, its model tensors, the model's config)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=64, intermediate_size=176, num_attention_heads=4, num_key_value_heads=4,
                         num_hidden_layers=2, vocab_size=2048, max_position_embeddings=64, tie_word_embeddings=False)
    model = LlamaForCausalLM(config)
    state = {name: tensor.detach().clone() for name, tensor in model.state_dict().items()}
    folder = _make_checkpoint(tmp_path_factory.mktemp("export") / "step-1", state, model.config.to_dict())
    return folder, state, model.config.to_dict()


def _nbytes(tensor) -> int:
    return tensor.numel() * tensor.element_size()


def test_dcp_export_has_the_exact_tensors_in_shards_with_an_index(llama, tmp_path):
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    folder, state, _ = llama
    files = export.export_checkpoint(folder, tmp_path / "hf", max_shard_bytes=SHARD)
    count = len(files)
    assert count >= 3
    assert [f.name for f in files] == [f"model-{i:05d}-of-{count:05d}.safetensors" for i in range(1, count + 1)]
    index = json.loads((tmp_path / "hf" / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(state)  # every model tensor, no optimizer state
    assert index["metadata"]["total_size"] == sum(f.stat().st_size for f in files)
    for file in files:
        tensors = load_file(file)
        assert set(tensors) == {k for k, v in index["weight_map"].items() if v == file.name}
        assert len(tensors) == 1 or sum(_nbytes(t) for t in tensors.values()) <= SHARD
        for name, tensor in tensors.items():
            assert tensor.dtype == state[name].dtype and torch.equal(tensor, state[name]), name
    assert not list((tmp_path / "hf").glob(".part-*"))
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    loaded = model.state_dict()
    assert all(torch.equal(loaded[name], tensor) for name, tensor in state.items())


def test_dcp_export_in_one_file_has_no_index(llama, tmp_path):
    from safetensors.torch import load_file

    folder, state, _ = llama
    files = export.export_checkpoint(folder, tmp_path)
    assert [f.name for f in files] == ["model.safetensors"]
    assert not (tmp_path / "model.safetensors.index.json").exists()
    tensors = load_file(files[0])
    assert set(tensors) == set(state) and all(torch.equal(tensors[k], v) for k, v in state.items())


def test_dcp_tensors_are_written_as_read_and_the_shard_before_the_next_read(llama, tmp_path, monkeypatch):
    """No copy between DCP and safetensors (the data pointer handed to save_file is the one the read
    filled), the pending shard goes to disk before the next tensor is read (sizes come from the
    metadata), and the metadata is read once, not once per tensor."""
    import safetensors.torch

    from shardfit.engines.dcp_io import SafeMetadataReader

    folder, state, _ = llama
    events: list = []
    read_pointers: dict = {}
    metadata_reads = []
    original_tensors, original_save = export.dcp_model_tensors, safetensors.torch.save_file
    original_metadata = SafeMetadataReader.read_metadata

    def tensors(path, *args, **kwargs):
        for name, lazy in original_tensors(path, *args, **kwargs):
            def load(name=name, lazy=lazy):
                tensor = lazy.load()
                events.append(("read", name, _nbytes(tensor)))
                read_pointers[name] = tensor.data_ptr()
                return tensor
            yield name, export.LazyTensor(lazy.nbytes, load)

    def save_file(tensors, path, metadata=None):
        events.append(("save", list(tensors)))
        for name, tensor in tensors.items():
            assert tensor.data_ptr() == read_pointers[name], f"{name} was copied before it was written"
        return original_save(tensors, path, metadata=metadata)

    def read_metadata(self, *args, **kwargs):
        metadata_reads.append(1)
        return original_metadata(self, *args, **kwargs)

    monkeypatch.setattr(export, "dcp_model_tensors", tensors)
    monkeypatch.setattr(safetensors.torch, "save_file", save_file)
    monkeypatch.setattr(SafeMetadataReader, "read_metadata", read_metadata)
    files = export.export_checkpoint(folder, tmp_path, max_shard_bytes=SHARD)
    assert len(files) >= 3 and len(metadata_reads) == 1
    pending: list[int] = []  # sizes read since the last save
    for event in events:
        if event[0] == "save":
            assert len(event[1]) == len(pending)
            pending = []
        else:
            # Either nothing is pending when a tensor is read, or the shard has room for it.
            assert not pending or sum(pending) + event[2] <= SHARD, events
            pending.append(event[2])
    assert sorted(name for e in events if e[0] == "read" for name in [e[1]]) == sorted(state)


def test_shared_storage_is_copied_whole_tensors_are_not(tmp_path, monkeypatch):
    """Views into one flat buffer (FSDP1 flat parameters, optimizer step scalars) and the same tensor
    under two names are copied (safetensors refuses shared storage, and a view would pin the whole
    buffer); a tensor that owns its storage is written as it is."""
    import safetensors.torch
    from safetensors.torch import load_file

    flat = torch.arange(30, dtype=torch.float32)
    steps = torch.tensor([1.0, 2.0, 3.0])
    whole = torch.randn(3, 3)
    transposed = torch.randn(4, 2).t()  # not contiguous: written as a contiguous copy
    items = [("a.weight", flat[:10].view(2, 5)), ("b.weight", flat[10:].view(4, 5)), ("c.weight", whole),
             ("d.weight", whole), ("step", steps[1]), ("t.weight", transposed), ("skipped", None)]
    saved: dict = {}
    original_save = safetensors.torch.save_file

    def save_file(tensors, path, metadata=None):
        saved.update({name: tensor.data_ptr() for name, tensor in tensors.items()})
        return original_save(tensors, path, metadata=metadata)

    monkeypatch.setattr(safetensors.torch, "save_file", save_file)
    files = export.write_hf_dir(iter(items), {}, tmp_path)
    assert saved["c.weight"] == whole.data_ptr()
    assert saved["d.weight"] != whole.data_ptr()
    flat_range = range(flat.data_ptr(), flat.data_ptr() + _nbytes(flat))
    assert saved["a.weight"] not in flat_range and saved["b.weight"] not in flat_range
    assert saved["step"] != steps[1].data_ptr()
    written = load_file(files[0])
    assert set(written) == {name for name, t in items if t is not None}
    for name, tensor in items:
        if tensor is not None:
            assert torch.equal(written[name], tensor)


def test_lora_merge_reads_lazy_tensors(tmp_path):
    """merge_lora reads the base weight and both adapters when it needs them; other tensors stay
    lazy until the writer reads them."""
    from safetensors.torch import load_file

    torch.manual_seed(1)
    base, a, b, bias, other = torch.randn(6, 4), torch.randn(2, 4), torch.randn(6, 2), torch.randn(6), torch.randn(3)
    reads: list[str] = []

    def lazy(name, tensor):
        def load():
            reads.append(name)
            return tensor.clone()
        return export.LazyTensor(_nbytes(tensor), load)

    prefix = "base_model.model.layer.q_proj"
    items = [(f"{prefix}.base_layer.weight", lazy("base", base)), (f"{prefix}.base_layer.bias", lazy("bias", bias)),
             (f"{prefix}.lora_A.default.weight", lazy("a", a)), (f"{prefix}.lora_B.default.weight", lazy("b", b)),
             ("base_model.model.norm.weight", lazy("other", other))]
    merged = export.merge_lora(iter(items), SimpleNamespace(alpha=8, rank=2))
    files = export.write_hf_dir(merged, {}, tmp_path)
    written = load_file(files[0])
    assert sorted(written) == ["layer.q_proj.bias", "layer.q_proj.weight", "norm.weight"]
    assert torch.allclose(written["layer.q_proj.weight"], base + 4 * b @ a)
    assert torch.equal(written["layer.q_proj.bias"], bias) and torch.equal(written["norm.weight"], other)
    assert sorted(reads) == ["a", "b", "base", "bias", "other"]


_PROBE = """
import json, resource, sys
from pathlib import Path
import safetensors.torch, torch.distributed.checkpoint  # imports are not consolidation
from shardfit.train.export import dcp_model_tensors, write_hf_dir
base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
write_hf_dir(dcp_model_tensors(Path(sys.argv[1])), {}, Path(sys.argv[2]), max_shard_bytes=int(sys.argv[3]))
print(json.dumps({"growth": (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base) * 1024}))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="ru_maxrss in KiB and glibc's allocator: Linux")
def test_consolidation_peak_rss_is_about_one_tensor_plus_one_shard(tmp_path):
    """Peak RSS growth of consolidation in a fresh process, as bench_checkpoint.py measures it: here
    every tensor is one chunk, so reading the largest one holds it twice (DCP's temporary and the
    tensor) = largest + one shard of the same size. A copy per tensor, or a shard still pending while
    the next tensor is read, would exceed the bound by a whole tensor."""
    mib = 2**20
    state = {"embed.weight": torch.randn(4 * mib // 4, 4)}  # 16 MiB, the largest
    state.update({f"layers.{i}.weight": torch.randn(mib // 4, 2) for i in range(8)})  # 2 MiB each
    state["head.weight"] = torch.randn(4 * mib // 4, 4)
    largest, shard = 16 * mib, 16 * mib
    _save_dcp({"model": state}, tmp_path / "dcp")
    result = subprocess.run([sys.executable, "-c", _PROBE, str(tmp_path / "dcp"), str(tmp_path / "hf"), str(shard)],
                            capture_output=True, text=True, timeout=120, cwd=REPO)
    assert result.returncode == 0, result.stderr[-3000:]
    growth = json.loads(result.stdout.strip().splitlines()[-1])["growth"]
    assert growth <= 1.25 * (largest + shard), f"peak RSS growth {growth / mib:.1f} MiB"
    assert len(list((tmp_path / "hf").glob("*.safetensors"))) == 3  # embed | the 8 layers | head
