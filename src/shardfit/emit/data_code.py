"""The emitted training scripts' data: the stand-in random pool, or a real dataset read with
`shardfit train`'s conventions (shardfit/data/), written out so the script needs no shardfit.

Conventions shared with `shardfit train`: a .txt file is split into paragraphs at blank lines, a
.jsonl file gives each line's "text"; every document is [BOS] + tokens + [EOS] and cut into pieces
of at most SEQ_LEN tokens; no tokenizer means shardfit's byte-level one (bytes 0..255, BOS 256,
EOS 257, PAD 258); one global order per epoch from (seed, epoch), runs of 64 examples sorted by
length (longest first) so a micro-batch pads little; global micro-step k takes the next
MICRO_BATCH x world examples and each rank its slice; padding to the batch's longest example, on
the right, masked out of the loss (-100). Beyond `shardfit train`: an HF dataset folder written by
`save_to_disk` (its "text" column) and packing (documents concatenated and cut into full SEQ_LEN
rows: no padding at all, attention crosses document boundaries, as in most pre-training).
Source text only: emit imports no torch.
"""
from __future__ import annotations

# Inserted as it is (not a format template) after the templates are dedented.
DATA_CODE = '''

def batches(vocab, device, rank, world, skip):
    # Micro-batches of this rank as model inputs, forever; a resumed run skips the `skip` micro-batches
    # already trained on (the same order on every run: it depends on the seed alone).
    source = dataset_batches(vocab, rank, world) if DATA else random_batches(vocab, rank)
    for _ in range(skip):
        next(source)
    for batch in source:
        yield {key: value.to(device) for key, value in batch.items()}


def random_batches(vocab, rank):
    # Stand-in data (no DATA): a fixed pool of random sequences per rank over the first eighth of the
    # vocabulary, so the loss visibly falls (from ln(vocab) towards ln(vocab / 8)) while it is learnt.
    # A generator of its own per rank: different data per rank, while the global RNG (model init,
    # dropout) stays identical on every rank.
    gen = torch.Generator().manual_seed(SEED + rank)
    pool = torch.randint(0, max(vocab // 8, 2), (8 * MICRO_BATCH, SEQ_LEN), generator=gen)
    while True:
        ids = pool[torch.randint(0, len(pool), (MICRO_BATCH,), generator=gen)]
        yield {"input_ids": ids, "labels": ids}


def read_documents(path):
    # shardfit train's conventions: paragraphs of a text file, the "text" field of each JSONL line, or
    # the "text" column of an HF dataset folder (save_to_disk; its "train" split if it has splits).
    import json
    if os.path.isdir(path):
        from datasets import load_from_disk
        dataset = load_from_disk(path)
        if hasattr(dataset, "keys"):
            dataset = dataset["train"] if "train" in dataset else dataset[next(iter(dataset.keys()))]
        if "text" not in dataset.column_names:
            raise SystemExit(f"{path}: the dataset has no 'text' column (it has {', '.join(dataset.column_names)})")
        docs = [text for text in dataset["text"] if text and text.strip()]
    elif not os.path.isfile(path):
        raise SystemExit(f"data '{path}' does not exist: give a .txt or .jsonl file or a save_to_disk folder")
    elif path.endswith((".jsonl", ".json")):
        docs = []
        with open(path, encoding="utf-8") as handle:
            for number, line in enumerate(handle, 1):
                record = json.loads(line) if line.strip() else {}
                if line.strip() and not isinstance(record.get("text"), str):
                    raise SystemExit(f"{path}:{number} has no 'text' string")
                if line.strip():
                    docs.append(record["text"])
    else:
        with open(path, encoding="utf-8") as handle:
            docs = [p.strip() for p in handle.read().split("\\n\\n") if p.strip()]
    if not docs:
        raise SystemExit(f"data '{path}' holds no text")
    return docs


def load_tokenizer(vocab):
    # (encode, pad id): a local tokenizer folder (no network), or shardfit's byte-level tokenizer.
    if not TOKENIZER:
        if vocab < 259:
            raise SystemExit(f"the byte-level tokenizer needs 259 tokens, the model has {vocab}: set TOKENIZER")
        return (lambda text: [256, *text.encode("utf-8"), 257]), 258
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(TOKENIZER, local_files_only=True)
    eos = tok.eos_token_id if tok.eos_token_id is not None else tok.sep_token_id
    if eos is None or len(tok) > vocab:
        raise SystemExit(f"tokenizer {TOKENIZER}: {'no EOS token' if eos is None else f'{len(tok)} tokens > the model vocabulary {vocab}'}")
    head = [tok.bos_token_id] if tok.bos_token_id is not None else []
    return (lambda text: [*head, *tok(text, add_special_tokens=False)["input_ids"], eos]), \\
        tok.pad_token_id if tok.pad_token_id is not None else eos


def token_examples(docs, encode):
    # Each document -> pieces of at most SEQ_LEN tokens (at least 2: one next-token target); packed:
    # all documents back to back, cut into full rows.
    pieces = []
    if PACK:
        stream = [token for doc in docs for token in encode(doc)]
        return [stream[i:i + SEQ_LEN] for i in range(0, len(stream) - SEQ_LEN + 1, SEQ_LEN)]
    for doc in docs:
        ids = encode(doc)
        pieces.extend(ids[i:i + SEQ_LEN] for i in range(0, len(ids), SEQ_LEN) if len(ids[i:i + SEQ_LEN]) >= 2)
    return pieces


def epoch_order(lengths, epoch):
    # One shuffled order per epoch from (seed, epoch): every rank computes it without communication.
    # Length grouping: each run of 64 examples sorted longest first, the runs still in random order.
    import random
    order = list(range(len(lengths)))
    random.Random(SEED * 1_000_003 + epoch).shuffle(order)
    if not GROUP_BY_LENGTH:
        return order
    return [i for start in range(0, len(order), 64)
            for i in sorted(order[start:start + 64], key=lambda i: (-lengths[i], i))]


def collate(rows, pad_id):
    # Dynamic padding: to the longest row of this batch, not SEQ_LEN; pads masked out of the loss.
    width = max(len(row) for row in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, row in enumerate(rows):
        ids[i, :len(row)] = torch.tensor(row, dtype=torch.long)
        mask[i, :len(row)] = 1
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


def dataset_batches(vocab, rank, world):
    encode, pad_id = load_tokenizer(vocab)
    examples = token_examples(read_documents(DATA), encode)
    span = MICRO_BATCH * world
    if len(examples) < span:
        raise SystemExit(f"{DATA}: {len(examples)} examples cannot fill one micro-batch on {world} ranks")
    lengths = [len(e) for e in examples]
    epoch = 0
    while True:
        order = epoch_order(lengths, epoch)
        for start in range(0, len(order) - span + 1, span):  # the ragged tail is dropped
            yield collate([examples[i] for i in order[start + rank * MICRO_BATCH:start + (rank + 1) * MICRO_BATCH]], pad_id)
        epoch += 1
'''
