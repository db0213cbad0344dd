"""A resumable, seeded sampler whose position is counted in global samples, so a run resized to another
world size continues at exactly the next sample: none repeated, none skipped.

The global sample order is fixed by the seed alone: epoch ``e`` is ``randperm(len(dataset))`` drawn from a
generator seeded with ``(seed, e)``.  Step ``s`` consumes the ``global_batch`` samples starting at global
position ``s * global_batch``; inside a step, micro-step ``k`` of rank ``r`` takes the slice
``[(k * world + r) * micro, (k * world + r + 1) * micro)`` of the step's samples.  Only the cut of a step
depends on the world size, never which samples the step holds.
"""

from __future__ import annotations

from typing import Iterator

import torch


class GlobalOrder:
    def __init__(self, length: int, seed: int = 0, shuffle: bool = True):
        if length < 1:
            raise ValueError("the dataset is empty")
        self.length, self.seed, self.shuffle = length, seed, shuffle
        self._epoch, self._perm = -1, None

    def index(self, position: int) -> int:
        """The dataset index of global sample number ``position``."""
        epoch, offset = divmod(position, self.length)
        if not self.shuffle:
            return offset
        if epoch != self._epoch:
            g = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            self._perm = torch.randperm(self.length, generator=g)
            self._epoch = epoch
        return int(self._perm[offset])

    def step_indices(self, step: int, global_batch: int) -> list[int]:
        start = step * global_batch
        return [self.index(p) for p in range(start, start + global_batch)]


def micro_batches(
    order: GlobalOrder, step: int, global_batch: int, world: int, rank: int, micro: int
) -> Iterator[list[int]]:
    """The dataset indices of each of this rank's micro-batches in ``step``."""
    if global_batch != world * micro * (global_batch // (world * micro)):
        raise ValueError(f"global batch {global_batch} is not world {world} x micro {micro} x accumulation")
    samples = order.step_indices(step, global_batch)
    for k in range(global_batch // (world * micro)):
        lo = (k * world + rank) * micro
        yield samples[lo : lo + micro]
