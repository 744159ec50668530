"""Documents -> token sequences -> a train/validation split. Everything is deterministic: the same
data, tokenizer and seed give the same examples on every rank and every run."""
from __future__ import annotations

import json
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from shardfit.errors import ShardfitError

DEFAULT_CORPUS = "corpus.txt"


@dataclass(frozen=True)
class TokenData:
    train: tuple[tuple[int, ...], ...]
    val: tuple[tuple[int, ...], ...]
    pad_id: int
    source: str


def read_documents(path: str | None) -> tuple[list[str], str]:
    """Paragraphs (blank-line separated) of a .txt file, or the "text" field of each JSONL line.
    None reads the corpus shipped in the package."""
    if path is None:
        text = resources.files("shardfit.data").joinpath(DEFAULT_CORPUS).read_text(encoding="utf-8")
        return _paragraphs(text), "embedded corpus"
    file = Path(path).expanduser()
    if not file.is_file():
        raise ShardfitError(f"data file '{path}' does not exist: give a local .txt or .jsonl file")
    if file.suffix in (".jsonl", ".json"):
        docs = []
        for number, line in enumerate(file.read_text(encoding="utf-8").splitlines(), 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                raise ShardfitError(f"{path}:{number} is not valid JSON: each line must be an object with a 'text' field") from None
            if not isinstance(record, dict) or not isinstance(record.get("text"), str):
                raise ShardfitError(f"{path}:{number} has no 'text' string: each line must look like {{\"text\": \"...\"}}")
            docs.append(record["text"])
    else:
        docs = _paragraphs(file.read_text(encoding="utf-8"))
    if not docs:
        raise ShardfitError(f"data file '{path}' holds no text")
    return docs, str(file)


def _paragraphs(text: str) -> list[str]:
    return [p.strip() for p in text.split("\n\n") if p.strip()]


def tokenize(docs: list[str], tokenizer, seq_len: int, val_every: int = 20, source: str = "") -> TokenData:
    """Each document becomes one or more examples of at most seq_len tokens (long ones are cut into
    pieces, short ones kept whole, so lengths vary and padding matters). Every val_every-th example
    is held out for validation."""
    if seq_len < 2:
        raise ShardfitError(f"seq_len must be at least 2 to predict a next token, got {seq_len}")
    examples: list[tuple[int, ...]] = []
    for doc in docs:
        ids = tokenizer.encode(doc)
        for start in range(0, len(ids), seq_len):
            piece = tuple(ids[start:start + seq_len])
            if len(piece) >= 2:
                examples.append(piece)
    val = tuple(e for i, e in enumerate(examples) if i % val_every == val_every - 1)
    train = tuple(e for i, e in enumerate(examples) if i % val_every != val_every - 1)
    if not train or not val:
        raise ShardfitError(f"data '{source}' gives only {len(examples)} examples: at least {val_every} are needed for a split")
    return TokenData(train=train, val=val, pad_id=tokenizer.pad_id, source=source)


def collate(examples, pad_id: int):
    """Dynamic padding: pad to the longest example of this batch, not to seq_len. Padding is on the
    right and masked out of the loss (-100), so a causal model's real-token logits are unchanged."""
    import torch

    width = max(len(e) for e in examples)
    ids = torch.full((len(examples), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(examples), width), dtype=torch.long)
    for row, example in enumerate(examples):
        ids[row, :len(example)] = torch.tensor(example, dtype=torch.long)
        mask[row, :len(example)] = 1
    labels = ids.masked_fill(mask == 0, -100)
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}
