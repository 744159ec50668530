"""The bench's data: deterministic byte-level windows of the shipped corpus, the same in every
strategy, every rank layout and the resumed process."""
from __future__ import annotations


class Batches:
    """Deterministic byte-level windows of the shipped corpus: batch i of rank r is the same in
    every strategy and in the resumed process (engines move it to their device)."""

    def __init__(self, plan, rank: int, world: int):
        from importlib import resources

        import torch

        text = resources.files("shardfit.data").joinpath("corpus.txt").read_bytes()
        vocab = max(plan.model.vocab_size, 2)
        self.tokens = torch.tensor(list(text), dtype=torch.long) % vocab
        self.mb, self.seq = plan.training.micro_batch, plan.training.seq_len
        self.rank, self.world = rank, world

    def __call__(self, step: int) -> dict:
        import torch

        span = len(self.tokens) - self.seq - 1
        rows = []
        for row in range(self.mb):
            start = ((step * self.world + self.rank) * self.mb + row) * 997 * self.seq % span
            rows.append(self.tokens[start:start + self.seq])
        ids = torch.stack(rows)
        return {"input_ids": ids, "labels": ids.clone(), "attention_mask": torch.ones_like(ids)}

    def step(self, step: int, accum: int) -> list[dict]:
        """The `accum` micro-batches of optimizer step `step` (with accum 1: batch `step`, as before)."""
        return [self(step * accum + micro) for micro in range(accum)]
