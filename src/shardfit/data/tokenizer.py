"""Tokenizers: a byte-level one that needs no download, or a local Hugging Face tokenizer directory."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from shardfit.errors import ShardfitError


@dataclass(frozen=True)
class ByteTokenizer:
    """UTF-8 bytes 0..255, then BOS, EOS, PAD. Fits every preset whose vocabulary has ≥ 259 entries."""
    bos_id: int = 256
    eos_id: int = 257
    pad_id: int = 258
    vocab_size: int = 259
    name: str = "bytes"

    def encode(self, text: str) -> list[int]:
        return [self.bos_id, *text.encode("utf-8"), self.eos_id]

    def decode(self, ids) -> str:
        return bytes(int(i) for i in ids if 0 <= int(i) < 256).decode("utf-8", errors="replace")


@dataclass(frozen=True)
class HFTokenizer:
    """A local `transformers` tokenizer directory (AutoTokenizer.from_pretrained(path), offline)."""
    tokenizer: object
    bos_id: int | None
    eos_id: int
    pad_id: int
    vocab_size: int
    name: str

    def encode(self, text: str) -> list[int]:
        ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
        head = [self.bos_id] if self.bos_id is not None else []
        return [*head, *ids, self.eos_id]

    def decode(self, ids) -> str:
        return self.tokenizer.decode([int(i) for i in ids], skip_special_tokens=True)


def load_tokenizer(ref: str | None):
    """None or "bytes" -> ByteTokenizer; a directory -> HFTokenizer (no network access)."""
    if ref in (None, "", "bytes", "byte"):
        return ByteTokenizer()
    path = Path(ref).expanduser()
    if not path.is_dir():
        raise ShardfitError(f"tokenizer '{ref}' is not a local directory: give a folder with tokenizer.json "
                            "(or leave data.tokenizer empty for the byte-level tokenizer)")
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    except Exception as exc:  # noqa: BLE001 - transformers raises many types here
        raise ShardfitError(f"tokenizer '{ref}' could not be loaded: {exc}".splitlines()[0]) from None
    eos = tok.eos_token_id if tok.eos_token_id is not None else tok.sep_token_id
    if eos is None:
        raise ShardfitError(f"tokenizer '{ref}' has no EOS token: set eos_token in its tokenizer_config.json")
    pad = tok.pad_token_id if tok.pad_token_id is not None else eos
    return HFTokenizer(tokenizer=tok, bos_id=tok.bos_token_id, eos_id=eos, pad_id=pad,
                       vocab_size=len(tok), name=str(path))


def check_vocab(tokenizer, model_vocab: int) -> None:
    if model_vocab and tokenizer.vocab_size > model_vocab:
        raise ShardfitError(f"tokenizer '{tokenizer.name}' has {tokenizer.vocab_size} tokens but the model's "
                            f"vocabulary is {model_vocab}: use a model with a larger vocab_size or another tokenizer")
