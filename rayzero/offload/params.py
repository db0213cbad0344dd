"""Parameter offload to NVMe (stage 3): each parameter's shard of the weights, in the compute dtype, lives
in the rank's swap files between uses.

A stage-3 gather (and the step's refresh of persistent parameters) asks for the shards it is about to
send; they are read on the swap store's threads, the unit after the next one is read ahead, and up to
``max_in_cpu`` elements stay cached in memory (least recently used go first), so small and often used
parameters are not read again every time.  After the optimizer changes a sub-group's master, its shards
are cast to the compute dtype and written back.
"""

from __future__ import annotations

from collections import OrderedDict
from concurrent.futures import Future

import torch

from rayzero.zero.layout import ParamEntry


class NvmeParamSwap:
    def __init__(self, store, compute_dtype: torch.dtype, max_in_cpu: int):
        from rayzero.offload.swap_store import aligned_empty

        self._aligned_empty = aligned_empty
        self.store = store
        self.dtype = compute_dtype
        self.max_in_cpu = max_in_cpu
        self.cache: OrderedDict[str, torch.Tensor] = OrderedDict()  # key -> the shard, resident
        self.cached_elements = 0
        self.reading: dict[str, tuple[Future, torch.Tensor]] = {}
        self.writes: list[Future] = []

    @staticmethod
    def _key(e: ParamEntry) -> str:
        return f"weights.group{e.group_index}.param{e.index_in_group}"

    def write_from(self, entries: list[ParamEntry], source: torch.Tensor) -> None:
        """Store the shards of ``entries`` from ``source`` (their group's fp32 master partition)."""
        self.settle_writes()  # a shard's previous write must not land after this one
        for e in entries:
            key = self._key(e)
            buf = self.cache.get(key)
            if buf is None:
                buf = self._aligned_empty(e.chunk, self.dtype)
            buf.copy_(source[e.partition_offset : e.partition_offset + e.chunk])
            self.writes.append(self.store.write(key, buf))
            # a read of the old value still in flight is dropped
            self.reading.pop(key, None)

    def settle_writes(self) -> None:
        for f in self.writes:
            f.result()
        self.writes = []

    def prefetch(self, entries: list[ParamEntry]) -> None:
        """Start reading shards that are neither cached nor already being read."""
        for e in entries:
            key = self._key(e)
            if key in self.cache or key in self.reading:
                continue
            self.settle_writes()  # never read a file while its new value is still being written
            buf = self._aligned_empty(e.chunk, self.dtype)
            self.reading[key] = (self.store.read(key, buf), buf)

    def shard(self, e: ParamEntry) -> torch.Tensor:
        """The resident shard of ``e`` (read now if it was not prefetched); stays cached while room."""
        key = self._key(e)
        buf = self.cache.get(key)
        if buf is not None:
            self.cache.move_to_end(key)
            return buf
        if key not in self.reading:
            self.prefetch([e])
        future, buf = self.reading.pop(key)
        future.result()
        self.cache[key] = buf
        self.cached_elements += buf.numel()
        self._evict(keep=key)
        return buf

    def _evict(self, keep: str) -> None:
        while self.cached_elements > self.max_in_cpu and len(self.cache) > 1:
            key, buf = next(iter(self.cache.items()))
            if key == keep:
                self.cache.move_to_end(key)
                continue
            del self.cache[key]
            self.cached_elements -= buf.numel()

    def drop(self) -> None:
        """Forget every resident shard (after a load the files hold new values)."""
        self.settle_writes()
        for future, _ in self.reading.values():
            future.result()
        self.reading.clear()
        self.cache.clear()
        self.cached_elements = 0
