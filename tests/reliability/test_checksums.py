"""Checksums taken while DCP writes, and verification that overlaps a load (one process, real DCP)."""
from __future__ import annotations

import hashlib
import io
import json

import pytest
import torch
import torch.distributed.checkpoint as dcp

from shardfit.checksums import ALGORITHM, ChecksumWriter, content_matches, file_digest, file_entry
from shardfit.engines.dcp_io import save_with_checksums
from shardfit.train import manifest as integrity
from shardfit.train.checkpoint import write_manifest


def _state():
    torch.manual_seed(0)
    return {"model": {"w": torch.randn(300, 200), "b": torch.randn(7)},
            "optim": {"step": torch.tensor(3.0), "exp_avg": torch.randn(300, 200)}, "note": "bytes item"}


def test_checksums_taken_while_writing_equal_the_files(tmp_path):
    written = save_with_checksums(_state(), tmp_path / "dcp", no_dist=True)
    files = sorted(p for p in (tmp_path / "dcp").iterdir() if p.is_file())
    # Every file DCP wrote, the renamed `.metadata` included, with the digest of its bytes on disk.
    assert sorted(written) == files and any(p.name == ".metadata" for p in files)
    for path in files:
        assert written[path] == file_entry(path)
    restored = _state()
    for value in restored["model"].values():
        value.zero_()
    dcp.load(restored, checkpoint_id=str(tmp_path / "dcp"), no_dist=True)
    assert torch.equal(restored["model"]["w"], _state()["model"]["w"])


def test_writer_hashes_large_writes_in_pieces_and_gives_up_on_seek(tmp_path):
    path = tmp_path / "blob"
    payload = torch.randn(3 << 18).numpy().tobytes()  # 3 MiB: several pieces
    with open(path, "wb") as raw:
        stream = ChecksumWriter(raw)
        assert stream.write(b"head") == 4 and stream.write(payload) == len(payload)
    assert stream.entry(path) == file_entry(path)
    with open(path, "wb") as raw:
        stream = ChecksumWriter(raw)
        stream.write(b"abcdef")
        stream.seek(0)
        stream.write(b"X")
    assert stream.entry(path) is None  # out of order: the manifest hashes this file from disk instead
    buffer = io.BytesIO()
    torch.save({"t": torch.arange(10)}, ChecksumWriter(buffer))
    assert buffer.getvalue()  # torch.save accepts the wrapper as a file-like object


def test_manifest_uses_known_entries_and_hashes_the_rest(tmp_path, monkeypatch):
    folder = tmp_path / "ckpt"
    written = save_with_checksums(_state(), folder / "dcp", no_dist=True)
    (folder / "trainer.pt").write_bytes(b"trainer state")
    hashed = []
    real = integrity.file_entry
    monkeypatch.setattr(integrity, "file_entry", lambda path: hashed.append(path.name) or real(path))
    data = write_manifest(folder, {"step": 1}, known=written)
    assert hashed == ["trainer.pt"]  # the DCP files were not read back
    on_disk = json.loads((folder / integrity.MANIFEST).read_text())
    assert on_disk["files"] == data["files"] and set(data["files"]) == {"trainer.pt", *(f"dcp/{p.name}" for p in written)}
    assert integrity.problems(folder) == []


def _checkpoint(tmp_path):
    folder = tmp_path / "step-1"
    written = save_with_checksums(_state(), folder / "dcp", no_dist=True)
    write_manifest(folder, {"step": 1, "format": "dcp", "engine": "fsdp2"}, known=written)
    integrity._VERIFIED.clear()
    return folder


def _flip(path):
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("background", [True, False])
def test_checks_catch_a_flipped_byte_when_finished(tmp_path, background):
    folder = _checkpoint(tmp_path)
    shard = next((folder / "dcp").glob("*.distcp"))
    _flip(shard)
    checks = integrity.Checks(folder, integrity.read_manifest_file(folder), background=background)
    assert checks.pending  # the load would run now (with the thread hashing, or before the hashing)
    with pytest.raises(integrity.CorruptCheckpoint, match=rf"{shard.name} is corrupted: its {ALGORITHM} differs") as raised:
        checks.finish()
    assert raised.value.every_rank  # gathered from every rank: only rank 0 prints it
    with pytest.raises(integrity.CorruptCheckpoint, match="corrupted"):  # nothing was cached as verified
        integrity.verify(folder)


def test_checks_refuse_a_truncated_file_before_any_load(tmp_path):
    folder = _checkpoint(tmp_path)
    shard = next((folder / "dcp").glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[:100])
    with pytest.raises(integrity.CorruptCheckpoint, match=rf"{shard.name} is truncated or altered: 100 bytes"):
        integrity.Checks(folder, integrity.read_manifest_file(folder))


def test_intact_checkpoint_verified_once(tmp_path, monkeypatch):
    folder = _checkpoint(tmp_path)
    checks = integrity.Checks(folder, integrity.read_manifest_file(folder))
    checks.finish()
    assert not checks.pending
    monkeypatch.setattr(integrity, "content_problems", lambda *a: pytest.fail("hashed a verified folder again"))
    again = integrity.Checks(folder, integrity.read_manifest_file(folder))
    assert integrity.problems(folder) == [] and not again.pending


@pytest.mark.parametrize("background", [True, False])
def test_raise_local_reports_this_ranks_damage_only(tmp_path, background):
    folder = _checkpoint(tmp_path)
    integrity.Checks(folder, integrity.read_manifest_file(folder), background=background).raise_local()  # intact: silent
    _flip(folder / "dcp" / ".metadata")
    checks = integrity.Checks(folder, integrity.read_manifest_file(folder), background=background)
    with pytest.raises(integrity.CorruptCheckpoint, match=r"\.metadata is corrupted") as raised:
        checks.raise_local()
    assert not raised.value.every_rank  # this rank's own finding: every rank that has one prints it


def test_older_sha256_manifests_still_verify(tmp_path):
    path = tmp_path / "file"
    path.write_bytes(b"some checkpoint bytes")
    entry = {"size": path.stat().st_size, "sha256": hashlib.sha256(path.read_bytes()).hexdigest()}
    assert content_matches(path, entry)
    _flip(path)
    assert not content_matches(path, entry)
    assert integrity.content_problems(tmp_path, {"file": entry}, ["file"]) == [
        f"checkpoint file {path} is corrupted: its sha256 differs from the manifest"]
    assert file_digest(path) == file_entry(path)[ALGORITHM]
