"""Parameter offload to NVMe (stage 3): each parameter's shard of the weights, in the compute dtype, lives
in the rank's swap files between uses.

A stage-3 gather (and the step's refresh of persistent parameters) asks for the shards it is about to
send; they are read on the swap store's threads, the next unit's while the current one runs, and up to
``max_in_cpu`` elements stay cached in memory (least recently used go first), so small and often used
parameters are not read again every time.  After the optimizer changes a sub-group's master, its shards
are cast to the compute dtype and written back.

Reads in flight land in a bounded pool (``offload_param.buffer_count`` buffers of ``buffer_size``
elements, aligned for O_DIRECT, made on first use and reused): a unit's shards are placed one after another
in a buffer, each starting on an aligned boundary, and spill into further buffers when they do not fit.
When a shard is taken it is copied into its own resident tensor (the cache), and a buffer goes back to the
pool once every shard placed in it was taken.  A read ahead that finds the pool full is skipped (the shard
is read when asked for); a shard asked for while every buffer is busy first takes the oldest reads into the
cache to free one.  A single shard larger than ``buffer_size`` is an error, raised at set-up.
"""

from __future__ import annotations

from collections import OrderedDict
from concurrent.futures import Future, wait

import torch

from rayzero.config import ConfigError
from rayzero.offload.swap_store import ALIGNMENT, aligned_empty
from rayzero.zero.layout import ParamEntry


def cache_elements(max_in_cpu: int | None) -> int:
    """Elements of shards kept cached in memory: ``offload_param.max_in_cpu``, or 0 when the key is left
    out.  The shards are on NVMe so that the rank does not hold them; a cache as large as DeepSpeed's
    default (1e9 elements) keeps every shard of most models in memory as well, and a rank with parameters
    and optimizer on NVMe then held more than one without offload.  With 0 only the shard just taken stays
    until the next one is; the reads ahead (``buffer_count`` buffers) hide the disk."""
    return 0 if max_in_cpu is None else int(max_in_cpu)


def read_pool_shape(buffer_count: int | None, buffer_size: int | None, unit_shards: list[int],
                    dtype: torch.dtype) -> tuple[int, int]:
    """``(buffer_count, buffer_size)`` of the read pool: ``offload_param``'s keys, each derived when left out.
    A gather reads one unit's shards into one buffer, so a buffer is left out as the largest unit's shards
    (``unit_shards``: this rank's shard elements of each parameter of that unit, each placed on an aligned
    boundary), and two of them serve the unit in use and the one read ahead.  DeepSpeed's defaults (5 x 1e8
    elements) would make the pool larger than most ranks' whole weight partition."""
    per_block = ALIGNMENT // dtype.itemsize
    unit = sum(-(-n // per_block) * per_block for n in unit_shards)
    count = 2 if buffer_count is None else int(buffer_count)
    size = max(1, unit) if buffer_size is None else int(buffer_size)
    return count, size


class _Buffer:
    """One aligned read buffer: shards are placed from ``used`` on; ``users`` of them are not taken yet."""

    __slots__ = ("tensor", "used", "users")

    def __init__(self, tensor: torch.Tensor):
        self.tensor, self.used, self.users = tensor, 0, 0


class ReadPool:
    """At most ``count`` aligned buffers of at most ``size`` elements for shard reads in flight.

    A buffer is allocated with ``capacity`` elements (``size``, or less when every shard there is fits in
    less), on first use; buffers are never allocated beyond ``count``.
    """

    def __init__(self, count: int, size: int, dtype: torch.dtype):
        if count < 1 or size < 1:
            raise ConfigError(f"zero_optimization.offload_param: buffer_count ({count}) and buffer_size ({size}) "
                              "must be >= 1")
        self.count, self.size, self.dtype = count, size, dtype
        self.capacity = size
        self.allocated = 0  # buffers alive (free or in use)
        self.peak_in_use = 0  # most buffers holding reads at once
        self._free: list[_Buffer] = []
        self._open: _Buffer | None = None  # the buffer shards are being placed in
        self._busy: set[_Buffer] = set()  # buffers with shards not taken yet (the open one included)

    def slot(self, numel: int) -> int:
        """Elements a shard of ``numel`` takes in a buffer: the next one starts on an aligned boundary."""
        per_block = ALIGNMENT // self.dtype.itemsize
        return -(-numel // per_block) * per_block

    @property
    def in_use(self) -> int:
        return len(self._busy)

    def place(self, numel: int) -> tuple[_Buffer, torch.Tensor] | None:
        """A view of ``numel`` elements in a buffer for one read, or None when every buffer is busy."""
        b = self._open
        if b is None or b.used + numel > b.tensor.numel():
            if b is not None and not b.users:  # empty but too small for this shard
                self._free.append(b)
            self._open = None
            b = self._next_buffer()
            if b is None:
                return None
            self._open = b
        view = b.tensor[b.used : b.used + numel]
        b.used += self.slot(numel)
        b.users += 1
        self._busy.add(b)
        self.peak_in_use = max(self.peak_in_use, len(self._busy))
        return b, view

    def _next_buffer(self) -> _Buffer | None:
        while self._free:
            b = self._free.pop()
            if b.tensor.numel() >= self.capacity:
                return b
            self.allocated -= 1  # made before the shards' sizes were known: too small now
        if self.allocated >= self.count:
            return None
        self.allocated += 1
        return _Buffer(aligned_empty(self.capacity, self.dtype))

    def release(self, b: _Buffer) -> None:
        """One shard placed in ``b`` was taken (or its read dropped after it finished)."""
        b.users -= 1
        if b.users:
            return
        self._busy.discard(b)
        b.used = 0
        if b is not self._open:
            self._free.append(b)


class NvmeParamSwap:
    """The rank's stage-3 weight shards in the swap store (module docstring).

    ``buffer_count`` and ``buffer_size`` are ``offload_param``'s: the read pool.  ``largest_shard``, the
    most elements one rank's shard of any parameter has, checks at construction that every shard fits a
    buffer (the first write of each shard checks it again).
    """

    def __init__(self, store, compute_dtype: torch.dtype, max_in_cpu: int, buffer_count: int = 5,
                 buffer_size: int = 100_000_000, largest_shard: int = 0):
        self.store = store
        self.dtype = compute_dtype
        self.max_in_cpu = max_in_cpu
        self.pool = ReadPool(buffer_count, buffer_size, compute_dtype)
        self._check_fits(largest_shard, "the largest parameter")
        self.cache: OrderedDict[str, torch.Tensor] = OrderedDict()  # key -> the shard, resident
        self.cached_elements = 0
        self.reading: dict[str, tuple[Future, torch.Tensor, _Buffer]] = {}  # oldest first
        self.writes: list[Future] = []
        self._slots: dict[str, int] = {}  # key -> elements it takes in a read buffer, from its first write
        self.skipped = 0  # reads ahead left out because the pool was full

    @staticmethod
    def _key(e: ParamEntry) -> str:
        return f"weights.group{e.group_index}.param{e.index_in_group}"

    def _check_fits(self, numel: int, what: str) -> None:
        size = self.pool.size
        if numel > size:
            raise ConfigError(
                f"zero_optimization.offload_param.buffer_size is {size} elements, but the shard of {what} on "
                f"this rank has {numel} elements: every shard is read from the swap files into one buffer of "
                f"buffer_size elements; set offload_param.buffer_size to at least {numel} (memory: "
                f"buffer_count x buffer_size x {self.dtype.itemsize} bytes), or train on more ranks so that "
                "shards are smaller"
            )

    def _known(self, e: ParamEntry, key: str) -> None:
        if key in self._slots:
            return
        self._check_fits(e.chunk, f"parameter {e.name!r}")
        self._slots[key] = self.pool.slot(e.chunk)
        # no buffer larger than what all the shards take together
        self.pool.capacity = min(self.pool.size, sum(self._slots.values()))

    def write_from(self, entries: list[ParamEntry], source: torch.Tensor) -> None:
        """Store the shards of ``entries`` from ``source`` (their group's fp32 master partition)."""
        self.settle_writes()  # a shard's previous write must not land after this one
        for e in entries:
            key = self._key(e)
            self._known(e, key)
            dropped = self.reading.pop(key, None)
            if dropped is not None:  # a read of the old value: its buffer is free once the read is done
                wait([dropped[0]])
                self.pool.release(dropped[2])
            buf = self.cache.get(key)
            if buf is None:
                buf = aligned_empty(e.chunk, self.dtype)
            buf.copy_(source[e.partition_offset : e.partition_offset + e.chunk])
            self.writes.append(self.store.write(key, buf))

    def settle_writes(self) -> None:
        for f in self.writes:
            f.result()
        self.writes = []

    def _start(self, e: ParamEntry, key: str) -> bool:
        """Start reading ``e`` into the pool; False when every buffer is busy."""
        self._known(e, key)
        self.settle_writes()  # never read a file while its new value is still being written (and a failed
        # write raises here, before a buffer place is taken)
        placed = self.pool.place(e.chunk)
        if placed is None:
            return False
        buf, view = placed
        try:
            future = self.store.read(key, view)
        except BaseException:
            self.pool.release(buf)
            raise
        self.reading[key] = (future, view, buf)
        return True

    def prefetch(self, entries: list[ParamEntry]) -> None:
        """Start reading shards that are neither cached nor already being read, while the pool has room."""
        for i, e in enumerate(entries):
            key = self._key(e)
            if key in self.cache or key in self.reading:
                continue
            if not self._start(e, key):
                self.skipped += sum(1 for f in entries[i:] if self._key(f) not in self.cache
                                    and self._key(f) not in self.reading)
                return

    def shard(self, e: ParamEntry) -> torch.Tensor:
        """The resident shard of ``e`` (read now if it was not read ahead); stays cached while room."""
        key = self._key(e)
        buf = self.cache.get(key)
        if buf is not None:
            self.cache.move_to_end(key)
            return buf
        while key not in self.reading and not self._start(e, key):
            # every buffer holds reads ahead: the oldest go to the cache, freeing their buffers
            if not self.reading:
                raise RuntimeError(f"no offload_param read buffer can take {key} ({e.chunk} elements) although "
                                   "no read is in flight; this is a rayzero bug, please report it")
            self._take(next(iter(self.reading)))
        return self._take(key)

    def _take(self, key: str) -> torch.Tensor:
        """Finish ``key``'s read: copy it out of the pool into the cache and free its place there."""
        future, view, buf = self.reading.pop(key)
        try:
            future.result()
            out = aligned_empty(view.numel(), self.dtype)  # aligned: write_from writes straight from it
            out.copy_(view)
        finally:
            self.pool.release(buf)
        self.cache[key] = out
        self.cached_elements += out.numel()
        self._evict(keep=key)
        return out

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
        for future, _, buf in self.reading.values():
            wait([future])
            self.pool.release(buf)
        self.reading.clear()
        self.cache.clear()
        self.cached_elements = 0
