"""Which examples each rank sees, in which order, and how to resume there.

One global order per epoch comes from (seed, epoch) alone, so every rank computes the same order
without communication. Global micro-step k takes the next `micro_batch * world_size` examples and
rank r takes its `micro_batch` slice of them: ranks are disjoint, and the position (examples
consumed in this epoch) does not depend on the world size, so a checkpoint resumes on another one.
"""
from __future__ import annotations

import random
from dataclasses import dataclass

from shardfit.errors import ShardfitError

MEGABATCH = 64  # examples sorted together by length; independent of the world size on purpose


@dataclass(frozen=True)
class Position:
    epoch: int = 0
    consumed: int = 0  # examples of this epoch already taken, over all ranks

    def to_dict(self) -> dict:
        return {"epoch": self.epoch, "consumed": self.consumed}


def epoch_order(lengths: list[int], seed: int, epoch: int, group_by_length: bool = True) -> list[int]:
    """A shuffled order; with length grouping, each run of MEGABATCH examples is sorted by length
    (longest first) so a micro-batch pads little, yet batches still come in random order."""
    rng = random.Random(seed * 1_000_003 + epoch)
    order = list(range(len(lengths)))
    rng.shuffle(order)
    if not group_by_length:
        return order
    grouped = []
    for start in range(0, len(order), MEGABATCH):
        chunk = sorted(order[start:start + MEGABATCH], key=lambda i: (-lengths[i], i))
        grouped.extend(chunk)
    return grouped


class DistributedBatches:
    """Yields this rank's micro-batches (lists of example indices) forever, epoch after epoch."""

    def __init__(self, lengths: list[int], micro_batch: int, rank: int, world_size: int, seed: int,
                 group_by_length: bool = True, position: Position | None = None):
        if micro_batch * world_size > len(lengths):
            raise ShardfitError(f"{len(lengths)} training examples can't fill one step of micro_batch {micro_batch} "
                                f"on {world_size} ranks: use more data or a smaller micro_batch")
        self.lengths, self.micro_batch, self.rank, self.world_size = lengths, micro_batch, rank, world_size
        self.seed, self.group_by_length = seed, group_by_length
        self.position = position or Position()
        self._order = epoch_order(lengths, seed, self.position.epoch, group_by_length)

    def next(self) -> list[int]:
        span = self.micro_batch * self.world_size
        epoch, consumed = self.position.epoch, self.position.consumed
        if consumed + span > len(self._order):  # drop the ragged tail: every rank needs a full batch
            epoch, consumed = epoch + 1, 0
            self._order = epoch_order(self.lengths, self.seed, epoch, self.group_by_length)
        start = consumed + self.rank * self.micro_batch
        batch = self._order[start:start + self.micro_batch]
        self.position = Position(epoch=epoch, consumed=consumed + span)
        return batch
