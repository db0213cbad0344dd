"""Gradient partitions in the swap store (``offload_optimizer.device: "nvme"``).

With the optimizer on NVMe, a rank's fp32 gradient partition would be the largest thing it still holds in
memory (4 bytes per parameter of its partition: as much as the master it no longer holds).  So it is swapped
too, sub-group by sub-group (a sub-group is one partition group, ``sub_group_size`` elements):

* backward: the reducer asks for a sub-group's gradient (:meth:`GradientSwap.acquire`) when it launches the
  first bucket of that sub-group in this backward.  The window's first backward gets a fresh buffer (every
  bucket then overwrites its slice); a later backward of the same window reads the sum so far back from the
  files and adds to it.  Once the last bucket of the sub-group is settled the reducer hands it back
  (:meth:`GradientSwap.release`): its sum of squares is taken (the step's global norm reads it instead of the
  gradient), the write starts, and the buffer goes back to the pool when the write is done.
* step: the optimizer swap (``optimizer.py``) reads each sub-group's gradient ahead of stepping it, with its
  master and optimizer state, and gives the buffer back after.  Stepped gradients are spent: the files are
  not read again until a backward writes them anew (a sub-group with no gradient in the window is zero).

Buckets are reduced in a fixed order, groups last to first, so a backward has at most the sub-groups of the
buckets in flight in memory, two or three, plus writes still running: the pool (``BUFFERS`` buffers, each
the size of the largest sub-group) bounds it, and a buffer asked for when every one is busy waits for the
oldest write.
"""

from __future__ import annotations

from concurrent.futures import Future

import torch

from rayzero.offload.swap_store import aligned_empty

# sub-groups' gradients in memory at once: the buckets in flight span at most two sub-groups (the reducer
# keeps two launched and one filling), and one more lets a write finish while the next sub-group fills
BUFFERS = 3

NONE, DISK, RESIDENT = "none", "disk", "resident"


class GradientSwap:
    """Keeps each sub-group's fp32 gradient partition in the swap store between backward and step."""

    def __init__(self, partitions, store):
        self.partitions = partitions
        self.store = store
        self.state = [NONE] * len(partitions.groups)
        self.sq: list[torch.Tensor | None] = [None] * len(partitions.groups)  # sum of squares of what was written
        self._largest = max((g.layout.partition_numel for g in partitions.groups), default=0)
        self._free: list[torch.Tensor] = []
        self._allocated = 0
        self._whole: dict[int, torch.Tensor] = {}  # data_ptr -> the pool buffer (callers hold slices of it)
        self._writing: list[tuple[Future, torch.Tensor]] = []  # (write, the buffer it reads), oldest first
        self._reads: dict[int, tuple[Future, torch.Tensor]] = {}  # reads ahead for the step
        self._empty = torch.empty(0, dtype=torch.float32)
        for g in partitions.groups:
            g.grad = self._empty
        partitions.grad_swap = self

    @staticmethod
    def key(gi: int) -> str:
        return f"group{gi}.grad"

    def resident(self, gi: int) -> bool:
        return self.state[gi] == RESIDENT

    # ---- buffers -------------------------------------------------------------------------------------
    def _buffer(self, numel: int, wait: bool = True) -> torch.Tensor | None:
        """A pool buffer of at least ``numel`` elements: a free one, a new one while the pool is not full,
        else the buffer of the oldest write once it is done (None with ``wait=False`` instead of waiting)."""
        self._settle_done()
        if self._free:
            return self._free.pop()
        if self._allocated < BUFFERS:
            return self._new()
        if not self._writing:
            if not wait:
                return None
            # every buffer holds a sub-group in use (more sub-groups resident than the reducer keeps in
            # flight): grow rather than fail; the pool shrinks back to BUFFERS as they are given back
            return self._new()
        if not wait:
            return None
        fut, view = self._writing.pop(0)
        fut.result()
        return self._whole[view.data_ptr()]

    def _new(self) -> torch.Tensor:
        self._allocated += 1
        buf = aligned_empty(self._largest, torch.float32)
        self._whole[buf.data_ptr()] = buf
        return buf

    def _give(self, view: torch.Tensor) -> None:
        """Give back the pool buffer ``view`` starts at."""
        buf = self._whole.get(view.data_ptr())
        if buf is None:
            return
        if self._allocated > BUFFERS:
            self._allocated -= 1  # dropped: the pool is back to its size
            del self._whole[view.data_ptr()]
            return
        self._free.append(buf)

    def _settle_done(self) -> None:
        while self._writing and self._writing[0][0].done():
            fut, buf = self._writing.pop(0)
            fut.result()  # a failed write raises here
            self._give(buf)

    # ---- backward --------------------------------------------------------------------------------------
    def acquire(self, gi: int, overwrite: bool) -> torch.Tensor:
        """Sub-group ``gi``'s gradient partition in memory (``GroupPartition.grad``): the sum so far read back
        from the files, or with nothing written since the last step zeros (``overwrite``: every slice will
        be written before it is read, so the buffer is left as it is)."""
        g = self.partitions.groups[gi]
        if self.state[gi] == RESIDENT:
            return g.grad
        numel = g.layout.partition_numel
        pending = self._reads.pop(gi, None)
        if pending is not None:
            pending[0].result()
            buf = pending[1]
        else:
            buf = self._buffer(numel)[:numel]
            if self.state[gi] == DISK:
                self.store.read(self.key(gi), buf).result()
            elif not overwrite:
                buf.zero_()
        g.grad = buf[:numel]
        self.state[gi] = RESIDENT
        return g.grad

    @torch.no_grad()
    def release(self, gi: int) -> None:
        """Write sub-group ``gi``'s gradient to its file (asynchronously) and drop it from memory."""
        g = self.partitions.groups[gi]
        if self.state[gi] != RESIDENT:
            return
        grad = g.grad
        self.sq[gi] = torch.dot(grad, grad)
        self._writing.append((self.store.write(self.key(gi), grad), grad))
        g.grad = self._empty
        self.state[gi] = DISK

    # ---- step --------------------------------------------------------------------------------------------
    def prefetch(self, gi: int) -> None:
        """Start reading sub-group ``gi``'s gradient for the step (skipped when no buffer is free now)."""
        if self.state[gi] != DISK or gi in self._reads:
            return
        numel = self.partitions.groups[gi].layout.partition_numel
        buf = self._buffer(numel, wait=False)
        if buf is None:
            return
        self._reads[gi] = (self.store.read(self.key(gi), buf[:numel]), buf[:numel])

    def discard(self, gi: int) -> None:
        """After the step: sub-group ``gi``'s gradient is spent; its buffer goes back to the pool."""
        g = self.partitions.groups[gi]
        if self.state[gi] == RESIDENT:
            self._give(g.grad)
        g.grad = self._empty
        self.state[gi] = NONE
        self.sq[gi] = None

    def forget(self) -> None:
        """Every sub-group's gradient is zero now (after a step, ``zero_grad``, a load)."""
        for gi in range(len(self.state)):
            pending = self._reads.pop(gi, None)
            if pending is not None:
                pending[0].result()
                self._give(pending[1])
            self.discard(gi)

    def sq_sum(self, gi: int) -> torch.Tensor | None:
        """Sum of squares of sub-group ``gi``'s gradient (None: zero, nothing since the last step)."""
        if self.state[gi] == RESIDENT:
            g = self.partitions.groups[gi].grad
            return torch.dot(g, g)
        return self.sq[gi] if self.state[gi] == DISK else None

    def read(self, gi: int) -> torch.Tensor:
        """Sub-group ``gi``'s gradient as a tensor of its own (exports of the gradient between steps)."""
        g = self.partitions.groups[gi]
        if self.state[gi] == RESIDENT:
            return g.grad
        out = torch.zeros(g.layout.partition_numel, dtype=torch.float32)
        if self.state[gi] == DISK:
            self.flush()
            self.store.read(self.key(gi), out).result()
        return out

    def flush(self) -> None:
        """Wait for every write (a failed one raises)."""
        while self._writing:
            fut, buf = self._writing.pop(0)
            fut.result()
            self._give(buf)

    @property
    def held_bytes(self) -> int:
        """Memory of the pool's buffers (for tests and benches)."""
        return self._allocated * self._largest * 4
