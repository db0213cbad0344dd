"""Collectives through shared memory for the ranks of a group that all run on one host.

Gloo moves ~640 MB/s over loopback where a memory copy moves ~8.5 GB/s: between processes of one host the
cheapest wire is memory they all map.  :class:`ShmTransport` maps one segment per group (a file in
``/dev/shm``, unlinked as soon as every rank has mapped it, so nothing is left behind even when a rank is
killed) and runs reduce-scatter, all-gather and all-reduce through it.

Layout: ``SLOTS`` slots per rank of ``chunk_bytes`` each, plus two flag words per slot and rank.  A
collective is cut into chunks; chunk ``q`` (a counter shared by every collective of the group, so every
rank numbers chunks alike) uses slot ``q % SLOTS``:

1. wait until every rank has read the chunk that used this slot before (``done >= q - SLOTS``);
2. copy this rank's contribution into its slot, then publish ``written = q``;
3. wait until every rank has published ``q``, then read: sum the ranks' pieces in rank order (the same
   additions in the same order as :class:`~rayzero.comm.PairwiseTransport`, so results are bitwise equal to
   it and the deterministic policy holds), or copy them out;
4. publish ``done = q``.

Two slots let a rank write chunk ``q + 1`` while the others still read chunk ``q``.  A collective runs when
its handle is waited on, after every collective issued before it (ranks issue them in one order, so they
run them in one order).  The flag words are plain 8-byte stores published after the data; x86-64 keeps
stores in order, which is why the transport is only chosen there.  A rank that dies or stalls makes the
others' waits time out with an error that names the rank and the chunk, as gloo's timeout would.

**Tensors the other ranks read in place.**  A copy through the slots costs every rank a write and a read of
its whole contribution.  Memory the group maps anyway avoids both: :meth:`ShmTransport.expose_region` maps
one region per rank that every rank of the group can read (:class:`ExposedRegion`, an allocator over the
rank's own part), and :meth:`ShmTransport.shared_tensor` one tensor that is the same memory on every rank.
Every reduce-scatter and all-gather publishes, when it is issued, where its input lies: an offset in an
exposed region, or "not exposed".  When it runs, every rank reads everyone's entries; if all inputs are
exposed, each rank reads the others' rows where they lie (a reduce-scatter sums its own row of every rank
straight into ``out``, in rank order as always), else all of them take the slots as above.  A rank marks
the collective consumed after reading, and an exposed buffer freed afterwards is handed out again only once
every rank has consumed the last collective that exposed it.
"""

from __future__ import annotations

import logging
import mmap
import os
import platform
import socket
import time
from typing import Callable

import numpy as np
import torch
import torch.distributed as dist

from rayzero.comm import Handle, OrderedTransport, PairwiseTransport

logger = logging.getLogger("rayzero")

SLOTS = 2
RING = 64  # published input locations kept per rank: collectives a rank may issue ahead of the slowest reader
NOT_EXPOSED = -1
CHUNK_BYTES = 4 << 20  # per slot and rank: 2 slots x 4 MiB x world of shared memory per group
_FLAG_STRIDE = 8  # int64 words between flags: each flag on its own 64-byte line
_SHM_DIR = "/dev/shm"


class CollectiveTimeout(RuntimeError):
    pass


def shm_supported() -> bool:
    """Whether this host can run the transport: a shared-memory filesystem and x86-64's store order (and
    ``RAYZERO_SHM=0`` not set, which keeps every group on gloo)."""
    if os.environ.get("RAYZERO_SHM", "1") == "0":
        return False
    return platform.machine().lower() in ("x86_64", "amd64") and os.path.isdir(_SHM_DIR)


def same_host(group: dist.ProcessGroup | None) -> bool:
    """Whether every rank of ``group`` runs on this host (a collective: every member calls it)."""
    me = (socket.gethostname(), _boot_id())
    everyone: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, me, group=group)
    return all(x == me for x in everyone)


def _boot_id() -> str:
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return ""


def _map_shared(group: dist.ProcessGroup | None, rank: int, size: int) -> mmap.mmap:
    """A new segment of ``size`` bytes that every rank of ``group`` maps (a collective).  Rank 0 creates and
    reserves it; its name is unlinked once every rank has mapped it.  Every rank raises the same OSError if
    any rank could not take part, so all of them use it or none does."""
    box: list = [None, None]
    if rank == 0:
        path = os.path.join(_SHM_DIR, f"rayzero-shm-{os.getpid()}-{time.time_ns()}")
        st = os.statvfs(_SHM_DIR)
        try:
            if size > st.f_bavail * st.f_frsize:
                raise OSError(f"{size / 2**20:.0f} MiB needed, {st.f_bavail * st.f_frsize / 2**20:.0f} MiB free")
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        except OSError as e:
            box = [None, f"cannot create {path}: {e}"]
        else:
            try:
                # zero-filled (every flag starts at 0), and the pages reserved now: a full /dev/shm
                # (a container's 64 MiB default) is an error here, not a SIGBUS in the middle of a step
                os.posix_fallocate(fd, 0, size)
                box = [path, None]
            except OSError as e:
                os.close(fd)
                os.unlink(path)
                box = [None, f"cannot reserve {size / 2**20:.0f} MiB in {_SHM_DIR}: {e}"]
    dist.broadcast_object_list(box, src=dist.get_global_rank(group, 0) if group is not None else 0, group=group)
    if box[0] is None:
        raise OSError(box[1])
    path, error, mapped = box[0], None, None
    try:
        if rank != 0:
            fd = os.open(path, os.O_RDWR)
        try:
            mapped = mmap.mmap(fd, size)
        finally:
            os.close(fd)
    except OSError as e:
        error = e
    # every rank has mapped it or failed (a gloo group: a host tensor), so the name can go; and all
    # ranks learn whether any failed, so that all of them use the segment or none does
    failed = torch.tensor([0.0 if error is None else 1.0])
    dist.all_reduce(failed, group=group)
    if rank == 0:
        os.unlink(path)
    if failed.item() > 0:
        raise OSError(f"mapping {path} failed: {error}" if error else "another rank could not map the segment")
    return mapped


def _words(mapped: mmap.mmap, offset: int, *shape: int) -> np.ndarray:
    """int64 flag words of ``shape`` at ``offset``, each on its own 64-byte line (the last axis spaced)."""
    count = int(np.prod(shape)) * _FLAG_STRIDE
    return np.frombuffer(mapped, dtype=np.int64, count=count, offset=offset).reshape(*shape, _FLAG_STRIDE)[..., 0]


class _Segment:
    """The group's mapped segment: flag words, the published input locations, and the data slots."""

    def __init__(self, group: dist.ProcessGroup | None, rank: int, world: int, chunk_bytes: int) -> None:
        self.world, self.chunk_bytes = world, chunk_bytes
        line = _FLAG_STRIDE * 8
        flags_bytes = (2 * SLOTS * world + 2 * world) * line + RING * world * 8
        self.data_offset = -(-flags_bytes // 4096) * 4096
        size = self.data_offset + SLOTS * world * chunk_bytes
        self.map = _map_shared(group, rank, size)
        flags = _words(self.map, 0, 2, SLOTS, world)
        self.written, self.done = flags[0], flags[1]  # (slot, rank) views
        # collectives whose inputs may be read in place: how many each rank has issued and consumed, and
        # where each rank's input of collective q lies (RING entries per rank, reused round-robin)
        counters = _words(self.map, 2 * SLOTS * world * line, 2, world)
        self.issued, self.consumed = counters[0], counters[1]
        ring_at = (2 * SLOTS * world + 2 * world) * line
        self.where = np.frombuffer(self.map, dtype=np.int64, count=RING * world, offset=ring_at).reshape(RING, world)

    def slot(self, s: int, rank: int, dtype: torch.dtype, numel: int) -> torch.Tensor:
        offset = self.data_offset + (s * self.world + rank) * self.chunk_bytes
        return torch.frombuffer(self.map, dtype=dtype, count=numel, offset=offset)


_ALIGN = 4096
_BLOCK_BITS = 40  # a published location is block index << 40 | byte offset in the block


class ExposedRegion:
    """This rank's part of a block of shared memory that every rank of the group maps: tensors allocated
    here can be read in place by the other ranks' collectives (see the module docstring).

    A first-fit allocator over the rank's own ``region_bytes``.  :meth:`free` of a tensor that a collective
    exposed keeps it aside until every rank has consumed that collective; :meth:`alloc` waits for such a
    block only when nothing else fits, and returns None when the region cannot hold the request at all.
    """

    def __init__(self, transport: "ShmTransport", index: int, mapped: mmap.mmap, region_bytes: int) -> None:
        self.transport, self.index, self.map, self.region_bytes = transport, index, mapped, region_bytes
        self.base = torch.frombuffer(mapped, dtype=torch.uint8)
        self.ptr = self.base.data_ptr()
        self.mine = transport.rank * region_bytes  # my part: [mine, mine + region_bytes)
        self._free: list[tuple[int, int]] = [(self.mine, region_bytes)]  # (offset, bytes), by offset
        self._used: dict[int, int] = {}  # offset -> bytes
        self._exposed: dict[int, int] = {}  # offset -> the last collective that published it
        self._aside: list[tuple[int, int, int]] = []  # (collective, offset, bytes) freed while maybe read

    def alloc(self, numel: int, dtype: torch.dtype) -> torch.Tensor | None:
        nbytes = -(-max(1, numel) * torch.empty(0, dtype=dtype).element_size() // _ALIGN) * _ALIGN
        if nbytes > self.region_bytes:
            return None
        while True:
            self._return_consumed()
            for i, (off, size) in enumerate(self._free):
                if size >= nbytes:
                    if size == nbytes:
                        del self._free[i]
                    else:
                        self._free[i] = (off + nbytes, size - nbytes)
                    self._used[off] = nbytes
                    return self.view(off, numel, dtype)
            if not self._aside:
                return None
            self.transport._wait_consumed(min(q for q, _, _ in self._aside))

    def free(self, t: torch.Tensor) -> None:
        off = self.offset_of(t)
        if off is None or off not in self._used:
            raise ValueError("this tensor was not allocated from this exposed region")
        size = self._used.pop(off)
        q = self._exposed.pop(off, 0)
        self._aside.append((q, off, size))
        self._return_consumed()

    def _return_consumed(self) -> None:
        if not self._aside:
            return
        done = self.transport._min_consumed()
        keep = []
        for q, off, size in self._aside:
            if q <= done:
                self._free.append((off, size))
            else:
                keep.append((q, off, size))
        self._aside = keep
        self._free.sort()
        merged: list[tuple[int, int]] = []
        for off, size in self._free:
            if merged and merged[-1][0] + merged[-1][1] == off:
                merged[-1] = (merged[-1][0], merged[-1][1] + size)
            else:
                merged.append((off, size))
        self._free = merged

    def mark(self, offset: int, q: int) -> None:
        """Collective ``q`` exposed the allocation that holds ``offset``."""
        for start, size in self._used.items():
            if start <= offset < start + size:
                self._exposed[start] = q
                return

    def offset_of(self, t: torch.Tensor) -> int | None:
        """The byte offset of ``t`` in this block if ``t`` is a contiguous tensor inside my part of it."""
        off = t.data_ptr() - self.ptr
        if not (self.mine <= off and off + t.numel() * t.element_size() <= self.mine + self.region_bytes):
            return None
        return off if t.is_contiguous() else None

    def view(self, offset: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
        nbytes = numel * torch.empty(0, dtype=dtype).element_size()
        return self.base[offset : offset + nbytes].view(dtype)


class ShmTransport(PairwiseTransport):
    """Reduce-scatter, all-gather and all-reduce through a shared segment (module docstring); anything else,
    and every collective on a group whose ranks are not all on this host, goes through the pairwise gloo
    transport."""

    def __init__(self, group: dist.ProcessGroup | None, rank: int, world: int, ordered: bool = False,
                 chunk_bytes: int = CHUNK_BYTES, timeout_s: float = 600.0) -> None:
        super().__init__(group, rank, world)
        self.ordered = ordered  # off this host, all-reduce too sums in rank order (the deterministic policy)
        self.chunk_bytes, self.timeout_s = chunk_bytes, timeout_s
        self._seg: _Segment | None = None
        self._local: bool | None = None  # decided at the first collective, by all ranks together
        self._chunk = 0  # chunks run so far (the next one's number is this + 1)
        self._issued = 0
        self._ran = 0
        self._pending: dict[int, Callable[[], None]] = {}
        self._published = 0  # reduce-scatters and all-gathers issued (each publishes where its input lies)
        self._regions: list[ExposedRegion] = []

    # ---- set-up -------------------------------------------------------------------------------------------
    def _ready(self) -> bool:
        if self._local is None:
            self._local = same_host(self.group)
            if self._local:
                try:
                    self._seg = _Segment(self.group, self.rank, self.world, self.chunk_bytes)
                except OSError as e:  # every rank hears the same reason and falls back alike
                    logger.warning("rayzero: shared-memory transport unavailable (%s); this group uses gloo. "
                                   "Give the host a larger /dev/shm, or set RAYZERO_SHM=0 to skip the attempt", e)
                    self._local = False
        return self._local

    def close(self) -> None:
        """Drop the segment (it is unmapped once no tensor viewing it is left)."""
        self._seg = None
        self._local = None
        self._regions = []

    def expose_region(self, nbytes: int) -> ExposedRegion | None:
        """A region of ``nbytes`` for this rank that every rank of the group maps (a collective), or None
        where the group is not on one host or /dev/shm cannot hold it (every rank gets None alike)."""
        if self.world == 1 or not self._ready():
            return None
        nbytes = -(-max(nbytes, 1) // _ALIGN) * _ALIGN
        try:
            mapped = _map_shared(self.group, self.rank, self.world * nbytes)
        except OSError as e:
            logger.warning("rayzero: no shared region of %.0f MiB per rank (%s); those buffers are copied "
                           "through the transport's slots instead", nbytes / 2**20, e)
            return None
        region = ExposedRegion(self, len(self._regions), mapped, nbytes)
        self._regions.append(region)
        return region

    def shares_memory(self) -> bool:
        return self.world > 1 and self._ready()

    def shared_tensor(self, numel: int, dtype: torch.dtype) -> torch.Tensor | None:
        """A zero-filled tensor that is the same memory on every rank of the group (a collective), or None
        where the group is not on one host or /dev/shm cannot hold it (every rank gets None alike)."""
        if self.world == 1 or not self._ready():
            return None
        nbytes = max(1, numel) * torch.empty(0, dtype=dtype).element_size()
        try:
            mapped = _map_shared(self.group, self.rank, -(-nbytes // _ALIGN) * _ALIGN)
        except OSError as e:
            logger.warning("rayzero: no shared tensor of %.0f MiB (%s); each rank keeps its own copy",
                           nbytes / 2**20, e)
            return None
        return torch.frombuffer(mapped, dtype=dtype, count=numel)

    def barrier(self) -> None:
        """Every rank of the group has reached this point (through the segment on one host: microseconds)."""
        if self.world > 1 and self._ready():
            self.all_reduce(torch.zeros(1)).wait()
        else:
            super().barrier()

    # ---- inputs read in place -------------------------------------------------------------------------------
    def _publish(self, t: torch.Tensor) -> int:
        """Number the collective, and tell the other ranks where its input ``t`` lies (or that it is not
        exposed).  Ranks issue collectives in one order, so the numbers agree."""
        self._published += 1
        q = self._published
        where = NOT_EXPOSED
        for region in self._regions:
            off = region.offset_of(t)
            if off is not None:
                region.mark(off, q)
                where = (region.index << _BLOCK_BITS) | off
                break
        seg = self._seg
        if int(seg.consumed.min()) < q - RING:  # its entry is about to be reused: the others must have read it
            self._run_pending()
            self._wait_all(seg.consumed, q - RING, f"read collective {q - RING}")
        seg.where[q % RING, self.rank] = where
        seg.issued[self.rank] = q  # after the entry: x86-64 keeps the two stores in order
        return q

    def _where(self, q: int) -> list[int] | None:
        """Where every rank's input of collective ``q`` lies, once all have issued it; None unless all are
        exposed (then every rank copies through the slots, as every rank sees the same entries)."""
        seg = self._seg
        self._wait_all(seg.issued, q, f"issue collective {q}")
        where = [int(x) for x in seg.where[q % RING]]
        return None if NOT_EXPOSED in where else where

    def _peer(self, where: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
        return self._regions[where >> _BLOCK_BITS].view(where & ((1 << _BLOCK_BITS) - 1), numel, dtype)

    def _min_consumed(self) -> int:
        return int(self._seg.consumed.min())

    def _wait_consumed(self, q: int) -> None:
        self._run_pending()  # my own earlier collectives first: the others may be waiting on them
        self._wait_all(self._seg.consumed, q, f"read collective {q}")

    def settle_reads(self) -> None:
        """Wait until every rank has read whatever this rank's collectives exposed so far: after this, this
        rank may overwrite exposed tensors (an optimizer step on exposed masters)."""
        if self._seg is not None and self._published:
            self._wait_consumed(self._published)

    # ---- ordering: a collective runs once every earlier one has -------------------------------------------
    def _issue(self, run: Callable[[], None]) -> Handle:
        self._issued += 1
        n = self._issued
        self._pending[n] = run

        return Handle([], lambda: self._run_pending(n))

    def _run_pending(self, upto: int | None = None) -> None:
        """Run the collectives issued so far (up to number ``upto``) that have not run yet, in issue order."""
        upto = self._issued if upto is None else upto
        while self._ran < upto:
            self._ran += 1
            self._pending.pop(self._ran)()

    # ---- chunks -------------------------------------------------------------------------------------------
    def _wait_all(self, flags: np.ndarray, at_least: int, what: str) -> None:
        if int(flags.min()) >= at_least:
            return
        start = time.monotonic()
        spins = 0
        while int(flags.min()) < at_least:
            spins += 1
            if spins > 64:
                time.sleep(0 if spins < 256 else 5e-5)
                if time.monotonic() - start > self.timeout_s:
                    late = [j for j in range(self.world) if int(flags[j]) < at_least]
                    raise CollectiveTimeout(
                        f"shared-memory collective: rank(s) {late} of this group of {self.world} did not {what} "
                        f"within {self.timeout_s:g} s (a rank died or is stuck); the run cannot go on"
                    )

    def _exchange(self, dtype: torch.dtype, total: int, step: int, width: int,
                  fill: Callable[[torch.Tensor, int, int], None],
                  use: Callable[[list[torch.Tensor], int, int], None]) -> None:
        """Run the collective in chunks of ``step`` of its ``total`` columns (``width`` elements each): for
        columns ``[a, b)``, ``fill(my_slot, a, b)`` writes this rank's piece, then ``use([slot of rank 0,
        ..., slot of rank W-1], a, b)`` reads everyone's."""
        seg = self._seg
        for a in range(0, total, step):
            b = min(total, a + step)
            self._chunk += 1
            q = self._chunk
            s = q % SLOTS
            self._wait_all(seg.done[s], q - SLOTS, f"finish reading chunk {q - SLOTS}")
            fill(seg.slot(s, self.rank, dtype, width * (b - a)), a, b)
            seg.written[s, self.rank] = q
            self._wait_all(seg.written[s], q, f"write chunk {q}")
            use([seg.slot(s, j, dtype, width * (b - a)) for j in range(self.world)], a, b)
            seg.done[s, self.rank] = q

    def _cols_per_chunk(self, rows: int, element_size: int) -> int:
        return max(1, self.chunk_bytes // (rows * element_size))

    # ---- collectives ----------------------------------------------------------------------------------------
    #: ``reduce_scatter`` reads this rank's own row from where it lies (``own``), without a copy into ``rows``
    reads_own_row_apart = True

    def reduce_scatter(self, out: torch.Tensor, rows: torch.Tensor, own: torch.Tensor | None = None) -> Handle:
        if self.world == 1 or not self._ready():
            if own is not None:
                rows[self.rank].copy_(own)
            return super().reduce_scatter(out, rows)
        w, r, cols = self.world, self.rank, rows.shape[1]

        def fill(slot: torch.Tensor, a: int, b: int) -> None:
            slot.view(w, b - a).copy_(rows[:, a:b])

        def use(slots: list[torch.Tensor], a: int, b: int) -> None:
            _sum_into(out[a:b], [sl.view(w, b - a)[r] for sl in slots])

        q = self._publish(rows)

        def run() -> None:
            where = self._where(q)
            if where is not None:  # every rank's rows are exposed: sum my row of each where it lies
                parts = [self._peer(x, w * cols, rows.dtype).view(w, cols)[r] for x in where]
                if own is not None:
                    parts[r] = own
                _sum_into(out, parts)
            else:
                if own is not None:
                    rows[r].copy_(own)
                self._exchange(rows.dtype, cols, self._cols_per_chunk(w, rows.element_size()), w, fill, use)
            self._seg.consumed[self.rank] = q

        return self._issue(run)

    def all_gather(self, rows: torch.Tensor, mine: torch.Tensor) -> Handle:
        if self.world == 1 or not self._ready():
            return super().all_gather(rows, mine)

        def fill(slot: torch.Tensor, a: int, b: int) -> None:
            slot.copy_(mine[a:b])

        def use(slots: list[torch.Tensor], a: int, b: int) -> None:
            for j, sl in enumerate(slots):
                rows[j, a:b].copy_(sl)

        q = self._publish(mine)

        def run() -> None:
            where = self._where(q)
            if where is not None:  # every rank's piece is exposed: copy each from where it lies
                for j, x in enumerate(where):
                    if j == self.rank:
                        if rows[j].data_ptr() != mine.data_ptr():
                            rows[j].copy_(mine)
                    else:
                        rows[j].copy_(self._peer(x, mine.numel(), mine.dtype))
            else:
                step = self._cols_per_chunk(1, rows.element_size())
                self._exchange(rows.dtype, rows.shape[1], step, 1, fill, use)
            self._seg.consumed[self.rank] = q

        return self._issue(run)

    def all_reduce(self, tensor: torch.Tensor) -> Handle:
        if self.world == 1 or not self._ready():
            return OrderedTransport.all_reduce(self, tensor) if self.ordered else super().all_reduce(tensor)
        flat = tensor.view(-1) if tensor.is_contiguous() else tensor.reshape(-1).clone()

        def fill(slot: torch.Tensor, a: int, b: int) -> None:
            slot.copy_(flat[a:b])

        def use(slots: list[torch.Tensor], a: int, b: int) -> None:
            _sum_into(flat[a:b], slots)

        def run() -> None:
            self._exchange(tensor.dtype, flat.numel(), self._cols_per_chunk(1, tensor.element_size()), 1, fill, use)
            if not tensor.is_contiguous():
                tensor.copy_(flat.view(tensor.shape))

        return self._issue(run)


def _sum_into(dst: torch.Tensor, parts: list[torch.Tensor]) -> None:
    """``dst = parts[0] + parts[1] + ...``, added in rank order, as the pairwise transport adds them (the
    first sum written straight into ``dst``: one pass fewer than copying ``parts[0]`` in first)."""
    if len(parts) == 1:
        dst.copy_(parts[0])
        return
    torch.add(parts[0], parts[1], out=dst)
    for p in parts[2:]:
        dst.add_(p)
