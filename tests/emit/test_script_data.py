"""The emitted scripts' data code, run in this process (no ranks): it must read, tokenize, order, pad
and split data exactly as `shardfit train` does (shardfit/data/), packing and save_to_disk folders
beyond it."""
import importlib.util
import json
from importlib import resources

import pytest

from shardfit.data import ByteTokenizer, collate, epoch_order, read_documents, tokenize
from shardfit.emit import EmitOptions, emit
from shardfit.spec.models import load_model_spec
from shardfit.spec.plan import Cluster, Data, Plan, Training, parse_strategy

CORPUS = str(resources.files("shardfit.data").joinpath("corpus.txt"))


def _script(tmp_path, fmt="fsdp2", **options):
    plan = Plan(model=load_model_spec("tiny-llama"), strategy=parse_strategy(fmt),
                training=Training(micro_batch=2, grad_accum=2, seq_len=48, precision="fp32"),
                cluster=Cluster(nodes=1, gpus_per_node=2, gpu="custom:1"))
    path = tmp_path / f"{fmt}.py"
    path.write_text(emit(plan, fmt, EmitOptions(**options)).main)
    spec = importlib.util.spec_from_file_location(f"emitted_{fmt}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_text_and_jsonl_follow_shardfit_trains_conventions(tmp_path):
    script = _script(tmp_path, data=CORPUS)
    assert script.DATA == CORPUS and script.TOKENIZER == "" and not script.PACK
    docs = script.read_documents(CORPUS)
    assert docs == read_documents(CORPUS)[0]
    jsonl = tmp_path / "docs.jsonl"
    jsonl.write_text("\n".join(json.dumps({"text": d}) for d in docs[:30]) + "\n\n")
    assert script.read_documents(str(jsonl)) == docs[:30]
    encode, pad = script.load_tokenizer(320)
    examples = script.token_examples(docs, encode)
    # shardfit train holds out every 20th example: the rest must be the emitted script's, in order.
    data = tokenize(docs, ByteTokenizer(), 48)
    assert [tuple(e) for i, e in enumerate(examples) if i % 20 != 19] == list(data.train)
    assert pad == data.pad_id and max(len(e) for e in examples) == 48 and min(len(e) for e in examples) < 48
    lengths = [len(e) for e in examples]
    assert script.epoch_order(lengths, 3) == epoch_order(lengths, script.SEED, 3)
    batch = script.collate(examples[:3], pad)
    expected = collate(examples[:3], pad)
    assert all((batch[k] == expected[k]).all() for k in expected)


def test_ranks_take_disjoint_length_grouped_slices_and_padding_is_dynamic(tmp_path):
    script = _script(tmp_path, data=CORPUS)
    ranks = [script.dataset_batches(320, rank, 2) for rank in (0, 1)]
    widths, seen = [], set()
    for _ in range(20):
        for source in ranks:
            batch = next(source)
            rows = {tuple(r[m.bool()].tolist()) for r, m in zip(batch["input_ids"], batch["attention_mask"])}
            assert not rows & seen  # no example twice in the epoch's first steps, on any rank
            seen |= rows
            widths.append(batch["input_ids"].shape[1])
            assert (batch["labels"][batch["attention_mask"] == 0] == -100).all()
    assert len(set(widths)) > 1 and max(widths) <= 48  # padded per batch, not to seq_len


def test_packing_fills_every_row(tmp_path):
    script = _script(tmp_path, data=CORPUS, pack=True)
    assert script.PACK
    encode, _ = script.load_tokenizer(320)
    docs = script.read_documents(CORPUS)
    rows = script.token_examples(docs, encode)
    stream = [t for d in docs for t in encode(d)]
    assert all(len(r) == 48 for r in rows) and [t for r in rows for t in r] == stream[:48 * len(rows)]


def test_plan_data_section_is_the_default_and_bad_data_is_one_line(tmp_path):
    plan = Plan(model=load_model_spec("tiny-llama"), strategy=parse_strategy("fsdp2"),
                cluster=Cluster(nodes=1, gpus_per_node=2), data=Data(path="corpus.jsonl", tokenizer="tok"))
    text = emit(plan, "fsdp2").main
    assert "DATA = os.environ.get(\"DATA\", 'corpus.jsonl')" in text and "'tok')" in text
    script = _script(tmp_path)
    assert script.DATA == ""  # no data anywhere: the stand-in random tokens
    batch = next(script.batches(320, "cpu", 0, 2, 0))
    assert batch["input_ids"].shape == (2, 48) and batch["input_ids"].max() < 40
    with pytest.raises(SystemExit, match="does not exist"):
        script.read_documents(str(tmp_path / "missing.txt"))
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "a"}\n{"body": "b"}\n')
    with pytest.raises(SystemExit, match="bad.jsonl:2 has no 'text'"):
        script.read_documents(str(bad))


def test_hf_dataset_saved_to_disk(tmp_path):
    import datasets  # the dev extra installs it: a missing one is a failure, not a skip
    script = _script(tmp_path)
    docs = read_documents(CORPUS)[0][:40]
    import pyarrow
    # A fingerprint given: datasets' own hashing of a fresh table failed under dill 0.4.1 (MonthDayNano pickling).
    table = datasets.table.InMemoryTable(pyarrow.table({"text": docs, "id": list(range(len(docs)))}))
    train = datasets.Dataset(table, fingerprint="emit-test")
    datasets.DatasetDict({"train": train}).save_to_disk(str(tmp_path / "ds"))
    assert script.read_documents(str(tmp_path / "ds")) == docs
    train.save_to_disk(str(tmp_path / "flat"))  # a plain Dataset folder, no splits
    assert script.read_documents(str(tmp_path / "flat")) == docs
