"""DCP's `.metadata` is a pickle: shardfit reads it with an allowlist of DCP's own classes, so a
checkpoint cannot make a load run code."""
from __future__ import annotations

import pickle

import pytest
import torch
import torch.distributed.checkpoint as dcp

from shardfit.engines.dcp_io import SafeMetadataReader, UnsafeMetadata, save_with_checksums


def _save(tmp_path):
    state = {"model": {"w": torch.randn(4, 3, dtype=torch.bfloat16)}, "step": torch.tensor(2), "note": "bytes"}
    save_with_checksums(state, tmp_path / "dcp", no_dist=True)
    return state


def test_real_metadata_reads_and_loads(tmp_path):
    state = _save(tmp_path)
    reader = SafeMetadataReader(str(tmp_path / "dcp"))
    plain = dcp.FileSystemReader(str(tmp_path / "dcp")).read_metadata()
    assert reader.read_metadata().state_dict_metadata.keys() == plain.state_dict_metadata.keys()
    target = {"model": {"w": torch.zeros(4, 3, dtype=torch.bfloat16)}, "step": torch.tensor(0), "note": ""}
    dcp.load(target, storage_reader=SafeMetadataReader(str(tmp_path / "dcp")), no_dist=True)
    assert torch.equal(target["model"]["w"], state["model"]["w"]) and int(target["step"]) == 2


class _RunsCode:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (open, (str(self.marker), "w"))  # a call the unpickler would make if it allowed it


def test_metadata_that_would_run_code_is_refused(tmp_path):
    _save(tmp_path)
    marker = tmp_path / "ran"
    (tmp_path / "dcp" / ".metadata").write_bytes(pickle.dumps({"payload": _RunsCode(marker)}))
    with pytest.raises(UnsafeMetadata, match=r"names io\.open, which is not part of DCP's metadata"):
        SafeMetadataReader(str(tmp_path / "dcp")).read_metadata()
    assert not marker.exists()


def test_only_classes_of_dcp_modules_and_torch_dtypes_are_allowed():
    from shardfit.engines.dcp_io import _allowed

    # A function of an allowed module is as dangerous as any other call: classes and enums only.
    assert _allowed("torch.distributed.checkpoint.metadata", "TensorStorageMetadata")
    assert not _allowed("torch.distributed.checkpoint.metadata", "dataclass")
    assert not _allowed("torch.distributed.checkpoint.filesystem", "_write_item")
    assert _allowed("torch", "bfloat16") and _allowed("torch", "Size") and not _allowed("torch", "load")
    assert not _allowed("os", "system") and not _allowed("builtins", "eval")


def test_damaged_metadata_is_one_clear_error(tmp_path):
    from shardfit.errors import ShardfitError

    _save(tmp_path)
    (tmp_path / "dcp" / ".metadata").write_bytes(b"\x80\x04garbage")
    with pytest.raises(ShardfitError, match=r"\.metadata is unreadable .*the checkpoint is damaged"):
        SafeMetadataReader(str(tmp_path / "dcp")).read_metadata()
