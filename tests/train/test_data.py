"""Data: embedded corpus, tokenizers, split, padding, the distributed sampler and its position."""
from __future__ import annotations

import json

import pytest

from shardfit.data import (ByteTokenizer, DistributedBatches, Position, collate, epoch_order, load_data,
                           load_tokenizer, read_documents, tokenize)
from shardfit.errors import ShardfitError


def test_embedded_corpus_ships_and_splits():
    docs, source = read_documents(None)
    assert source == "embedded corpus" and len(docs) > 500
    assert sum(len(d) for d in docs) > 250_000
    tokenizer, data = load_data(None, None, seq_len=64, model_vocab=320)
    assert len(data.val) * 15 < len(data.train) < len(data.val) * 25
    assert max(len(e) for e in data.train) == 64 and min(len(e) for e in data.train) < 64  # ragged lengths


def test_byte_tokenizer_round_trips_unicode():
    tok = ByteTokenizer()
    ids = tok.encode("naïve café ✓")
    assert ids[0] == tok.bos_id and ids[-1] == tok.eos_id and max(ids) < tok.vocab_size
    assert tok.decode(ids) == "naïve café ✓"


def test_vocab_too_small_is_one_line_error():
    with pytest.raises(ShardfitError, match="vocabulary is 100"):
        load_data(None, None, 64, model_vocab=100)


def test_local_text_and_jsonl(tmp_path):
    text = tmp_path / "a.txt"
    text.write_text("\n\n".join(f"paragraph number {i} " * (i % 5 + 1) for i in range(60)))
    docs, _ = read_documents(str(text))
    assert len(docs) == 60 and docs[1].startswith("paragraph number 1")
    lines = tmp_path / "a.jsonl"
    lines.write_text("\n".join(json.dumps({"text": f"record {i}"}) for i in range(30)) + "\n")
    docs, _ = read_documents(str(lines))
    assert docs[:2] == ["record 0", "record 1"]
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "ok"}\n{"txt": 1}\n')
    with pytest.raises(ShardfitError, match=r"bad.jsonl:2 has no 'text'"):
        read_documents(str(bad))
    with pytest.raises(ShardfitError, match="does not exist"):
        read_documents(str(tmp_path / "missing.txt"))


def test_local_hf_tokenizer_directory(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    docs, _ = read_documents(None)
    raw = Tokenizer(models.BPE(unk_token="<unk>"))
    raw.pre_tokenizer = pre_tokenizers.Whitespace()
    raw.train_from_iterator(docs[:300], trainers.BpeTrainer(vocab_size=200, special_tokens=["<unk>", "<s>", "</s>"]))
    PreTrainedTokenizerFast(tokenizer_object=raw, bos_token="<s>", eos_token="</s>", unk_token="<unk>").save_pretrained(tmp_path)
    tok = load_tokenizer(str(tmp_path))
    ids = tok.encode("the baker found a letter")
    assert ids[0] == tok.bos_id and ids[-1] == tok.eos_id and tok.pad_id == tok.eos_id
    assert tok.decode(ids).replace(" ", "") == "thebakerfoundaletter"
    _, data = load_data(None, str(tmp_path), seq_len=32, model_vocab=320)
    assert max(max(e) for e in data.train) < tok.vocab_size
    with pytest.raises(ShardfitError, match="not a local directory"):
        load_tokenizer(str(tmp_path / "nope"))


def test_collate_pads_dynamically_and_masks_labels():
    batch = collate([(5, 6, 7), (8,)], pad_id=258)
    assert batch["input_ids"].tolist() == [[5, 6, 7], [8, 258, 258]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1], [1, 0, 0]]
    assert batch["labels"].tolist() == [[5, 6, 7], [8, -100, -100]]


def test_length_grouping_reduces_padding():
    _, data = load_data(None, None, 128, 320)
    lengths = [len(e) for e in data.train]

    def padded(order):
        total = 0
        for i in range(0, len(order) - 4, 4):
            chunk = [lengths[j] for j in order[i:i + 4]]
            total += 4 * max(chunk) - sum(chunk)
        return total

    grouped, plain = epoch_order(lengths, 3, 0, True), epoch_order(lengths, 3, 0, False)
    assert sorted(grouped) == sorted(plain) == list(range(len(lengths)))
    assert padded(grouped) < 0.5 * padded(plain)


def test_ranks_are_disjoint_and_cover_the_global_batch():
    lengths = [10 + i % 7 for i in range(500)]
    ranks = [DistributedBatches(lengths, 4, r, 3, seed=9) for r in range(3)]
    single = DistributedBatches(lengths, 12, 0, 1, seed=9)
    for _ in range(20):
        parts = [b.next() for b in ranks]
        assert not set(parts[0]) & set(parts[1]) and not set(parts[1]) & set(parts[2])
        assert sum(parts, []) == single.next()  # the same global order whatever the world size
    assert ranks[0].position == ranks[2].position == Position(epoch=0, consumed=240)


def test_position_resumes_and_epochs_roll_over():
    lengths = [3] * 50
    run = DistributedBatches(lengths, 4, 1, 2, seed=1)
    for _ in range(5):
        run.next()
    saved = run.position
    expected = [run.next() for _ in range(8)]
    resumed = DistributedBatches(lengths, 4, 1, 2, seed=1, position=saved)
    assert [resumed.next() for _ in range(8)] == expected
    assert resumed.position.epoch >= 1  # 50 examples, 8 per global micro-step: epoch 0 ends after 6
    with pytest.raises(ShardfitError, match="can't fill one step"):
        DistributedBatches([3] * 5, 4, 0, 2, seed=1)


def test_tokenize_rejects_tiny_data():
    with pytest.raises(ShardfitError, match="at least 20 are needed"):
        tokenize(["a b c"] * 5, ByteTokenizer(), 64)
