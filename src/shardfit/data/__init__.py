"""Training data: the embedded corpus or local files, a byte-level or local HF tokenizer, a
train/validation split, dynamic padding, and a resumable length-grouped distributed sampler."""
from shardfit.data.dataset import TokenData, collate, read_documents, tokenize
from shardfit.data.sampler import DistributedBatches, Position, epoch_order
from shardfit.data.tokenizer import ByteTokenizer, HFTokenizer, check_vocab, load_tokenizer


def load_data(path: str | None, tokenizer_ref: str | None, seq_len: int, model_vocab: int = 0):
    """(tokenizer, TokenData) for a Plan's data section."""
    tokenizer = load_tokenizer(tokenizer_ref)
    check_vocab(tokenizer, model_vocab)
    docs, source = read_documents(path)
    return tokenizer, tokenize(docs, tokenizer, seq_len, source=source)


__all__ = ["ByteTokenizer", "HFTokenizer", "DistributedBatches", "Position", "TokenData", "check_vocab", "collate",
           "epoch_order", "load_data", "load_tokenizer", "read_documents", "tokenize"]
