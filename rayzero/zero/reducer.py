"""Gradient buckets and their reduction into the gradient partitions (every ZeRO stage).

Gradients reach rayzero through one post-accumulate hook per parameter.  Each hook copies the parameter's
gradient into the bucket that holds it and drops ``param.grad``; a bucket whose parameters are all in is
reduced while backward goes on.  Buckets are launched strictly in bucket order (the reverse of
registration order, which is the order backward usually produces them), so every rank issues the same
collectives in the same order even when parameters finish in a different order or not at all.

Stage policies:

* stage 0: buckets are slices of the full fp32 gradient; local gradients accumulate there across
  micro-steps and the boundary's backward all-reduces them.
* stage 1: full-size fp32 local gradients (laid out as rows per rank) accumulate across micro-steps; the
  boundary's backward reduce-scatters them into the gradient partition.  No traffic between boundaries.
* stages 2 and 3: every backward reduce-scatters each bucket as soon as it is full, into the gradient
  partition, and frees the bucket: no full-size gradient outlives its bucket.  Freed bucket buffers go
  back to a small pool (at most ``max_inflight + 1`` of them, the most a backward has alive at once; one
  bucket in flight with parameters on NVMe, two otherwise: :meth:`GradientReducer.inflight_for`) and
  are reused by the next bucket: a freshly allocated multi-megabyte buffer costs a page fault per 4 KiB
  on first touch, which on CPU made every stage-2 backward pay for zeroing new memory (about a third of
  the step on a small model).

On a CPU device under the keep policy (accelerator/host_allocator.py) the weight gradients of ``nn.Linear``
come from a :class:`~rayzero.zero.grad_pool.GradientPool`; the hook gives each back to it once copied into its
bucket, so the next layer's gradient reuses the same block of memory.

Where the reduction domain's ranks share a host (rayzero/comm/shm.py), the bucket buffers come from an
exposed region instead: memory every rank of the group maps, so a reduce-scatter reads each rank's rows
where they lie, without copying them through the transport first.  A buffer is never zeroed whole: the
first gradient of a parameter in an accumulation window is copied over whatever the buffer held (and its
padding zeroed), later ones are added, and a parameter that got no gradient is zeroed at launch.

Under optimizer offload the gradient partitions live in host memory while the buckets reduce on the device.
Each reduced bucket is copied into a pinned host buffer of its own on a side stream (after an event on the
compute stream, ``non_blocking``), and the host adds it into the partition later, at :meth:`drain`: before
the step reads the partitions (``zero_stale``), or when the next backward reduces the same bucket again and
its copy is still unfinished.  The host waits once there (the side stream's copies finish in order), not per
bucket, and backward never blocks on a copy.  The device buffer a copy reads goes back to the pool with the
copy's event: the reduction that reuses it first makes the compute stream wait on that event.

The gradient partitions are not zeroed after a step either (stages 1-3): :meth:`GradientReducer.forget`
marks every bucket's slice stale, the window's first reduction writes its sum straight into the slice
(the transport's output is the partition itself), and :meth:`GradientReducer.zero_stale` zeroes whatever
no reduction reached before the step reads the partitions.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch

from rayzero.comm import Handle
from rayzero.offload.staging import accelerator_for
from rayzero.zero.grad_pool import GradientPool
from rayzero.zero.layout import ParamEntry, copy_into_rows, zero_padding
from rayzero.zero.partition import GroupPartition, Partitions


@dataclass
class Bucket:
    group: GroupPartition
    entries: list[ParamEntry]  # consecutive in the partition
    params: list[torch.nn.Parameter]
    cols: int
    part_start: int
    col_of: dict[int, int] = field(default_factory=dict)  # index_in_group -> column
    rows: torch.Tensor | None = None  # (world, cols) local gradients (stage 0: a view of the grad partition)
    ready: set = field(default_factory=set)  # got their gradient in this backward
    written: set = field(default_factory=set)  # columns hold this accumulation window's gradient
    # stages 1-3: the bucket's slice of the gradient partition holds nothing of this window yet (its
    # content is left over: the first reduction overwrites it instead of adding to zeros)
    partition_stale: bool = False
    out_is_partition: bool = False
    host_out: torch.Tensor | None = None  # offload: the pinned host buffer its reduced slice is copied into
    launched: bool = False
    handle: Handle | None = None
    out: torch.Tensor | None = None
    send: torch.Tensor | None = None
    # this rank's own row where it lies in the parameter's gradient, when it was not copied into ``rows``
    own: torch.Tensor | None = None

    @property
    def part_slice(self) -> slice:
        return slice(self.part_start, self.part_start + self.cols)


def make_buckets(partitions: Partitions, max_elements: int) -> list[Bucket]:
    """Split each group into runs of consecutive entries of at most ``max_elements`` padded elements.

    A parameter larger than ``max_elements`` gets a bucket of its own.  Buckets are returned in launch
    order: groups last to first, parameters last to first.
    """
    buckets: list[Bucket] = []
    for g in partitions.groups:
        current: list[tuple[ParamEntry, torch.nn.Parameter]] = []
        size = 0
        for e, p in zip(g.layout.entries, g.params):
            if current and size + e.padded_numel > max_elements:
                buckets.append(_bucket(g, current))
                current, size = [], 0
            current.append((e, p))
            size += e.padded_numel
        if current:
            buckets.append(_bucket(g, current))
    buckets.reverse()
    return buckets


def _bucket(g: GroupPartition, members: list[tuple[ParamEntry, torch.nn.Parameter]]) -> Bucket:
    entries = [e for e, _ in members]
    b = Bucket(
        group=g,
        entries=entries,
        params=[p for _, p in members],
        cols=sum(e.chunk for e in entries),
        part_start=entries[0].partition_offset,
    )
    for e in entries:
        b.col_of[e.index_in_group] = e.partition_offset - b.part_start
    return b


class GradientReducer:
    """Moves gradients from backward into the fp32 gradient partitions, in buckets.

    Each bucket is reduced over its group's domain (parallel/state.py: the DP group for dense parameters,
    the EDP group for experts); every reduced sum is divided by the data-parallel size ``dp``.
    """

    MAX_INFLIGHT = 2

    @classmethod
    def inflight_for(cls, zero) -> int:
        """Buckets a backward keeps reducing at once for ``zero`` (the config's ``zero_optimization``): one
        with parameters on NVMe, else ``MAX_INFLIGHT``.  Each bucket in flight is a buffer of the largest
        bucket's size (and the transport's receive buffers for it); with parameters on NVMe the backward
        waits on the disk's reads between its units anyway, and holding less is what that config is for."""
        return 1 if zero.offload_param.device == "nvme" else cls.MAX_INFLIGHT

    def __init__(
        self,
        partitions: Partitions,
        stage: int,
        bucket_elements: int,
        comm_dtype: torch.dtype,
        data_parallel_size: int,
        on_param_reduced: Callable[[torch.nn.Parameter], None] | None = None,
        grad_pool: GradientPool | None = None,
        max_inflight: int | None = None,
    ):
        self.partitions = partitions
        # buckets reducing at once while backward goes on (:meth:`inflight_for`)
        self.max_inflight = self.MAX_INFLIGHT if max_inflight is None else max_inflight
        self.stage = stage
        self.comm_dtype = comm_dtype
        self.dp = data_parallel_size
        self.on_param_reduced = on_param_reduced
        # spent gradients go back here, for the next layer's weight gradient (zero/grad_pool.py)
        self.grad_pool = grad_pool
        # 16-bit reductions divide before summing so the sum cannot overflow; fp32 divides once at the end.
        self.predivide = comm_dtype != torch.float32
        self.buckets = make_buckets(partitions, bucket_elements)
        self.bucket_of: dict[torch.nn.Parameter, Bucket] = {}
        for b in self.buckets:
            for p in b.params:
                self.bucket_of[p] = b
        # gradients swapped to NVMe (offload/gradients.py): each group's buckets, and how many of them this
        # backward has settled (the group is written out after its last one)
        self._group_buckets: dict[int, list[Bucket]] = {}
        for b in self.buckets:
            self._group_buckets.setdefault(b.group.layout.group_index, []).append(b)
        self._settled: dict[int, int] = {}
        self.accumulate_locally = stage in (0, 1)
        self._pool: dict[tuple[str, torch.dtype], list[torch.Tensor]] = {}  # freed flat buffers, for reuse
        self._regions = self._expose_regions() if stage >= 1 else {}
        if self.accumulate_locally:
            for b in self.buckets:
                if stage == 0:
                    b.rows = b.group.grad[b.part_slice].view(1, b.cols)
                else:
                    b.rows = self._new_rows(b)
        self._inflight: list[Bucket] = []
        self.reduce_now = True  # set per backward: reduce in this backward (boundary) or only accumulate
        self.pending = False  # some gradients are in buckets but not yet in the partition
        self._next_launch = 0
        self._hooks = [p.register_post_accumulate_grad_hook(self._on_grad) for p in self.bucket_of]
        # optimizer offload: gradient partitions on the host, reductions on the device (module docstring)
        self._offloaded = any(g.grad.device.type != partitions.device.type for g in partitions.groups)
        self._accelerator = accelerator_for(partitions.device) if self._offloaded else None
        self._d2h_stream = self._accelerator.stream() if self._accelerator is not None else None
        # (bucket, its partition slice, overwrite? (None: copied into the slice itself), copy event), in order
        self._to_host: list[tuple] = []
        self._reuse_after: dict[int, object] = {}  # id(pooled buffer) -> event of the copy still reading it
        self.host_waits = 0  # host waits on the device-to-host copies (tests)

    def _expose_regions(self) -> dict:
        """One exposed region per communicator whose ranks share a host (a collective, in bucket order):
        stage 1 keeps all its rows there, stages 2-3 the buckets in flight and the one filling."""
        need: dict[int, list] = {}  # id(comm) -> [comm, bytes]
        size = torch.empty(0, dtype=self._bucket_dtype()).element_size()
        for b in self.buckets:
            nbytes = -(-b.group.world * b.cols * size // 4096) * 4096
            entry = need.setdefault(id(b.group.comm), [b.group.comm, 0])
            entry[1] = entry[1] + nbytes if self.stage == 1 else max(entry[1], nbytes)
        if self._bucket_dtype() != self.comm_dtype:  # the rows are converted before they travel: nothing to expose
            return {}
        count = 1 if self.stage == 1 else self.max_inflight + 1
        return {key: comm.expose_region(nbytes * count) for key, (comm, nbytes) in need.items()}

    # ---- backward side -------------------------------------------------------------------------------
    @torch.no_grad()
    def _on_grad(self, param: torch.nn.Parameter) -> None:
        grad = param.grad
        if grad is None:
            return
        b = self.bucket_of[param]
        e = self.partitions.entry_of[param]
        if b.launched:
            raise RuntimeError(
                f"parameter {e.name!r} received a second gradient after its bucket was reduced in this "
                "backward; rayzero supports one gradient per parameter per backward (no reentrant "
                "re-use of a parameter after its gradient is complete)"
            )
        if b.rows is None:
            b.rows = self._new_rows(b)
        flat = grad.reshape(-1)
        if self.predivide and not self.accumulate_locally:
            flat = flat / self.dp
        col = b.col_of[e.index_in_group]
        if self.stage == 0:
            b.rows[0, col : col + e.numel].add_(flat)
        else:
            accumulate = e.index_in_group in b.written
            w, r = b.group.world, b.group.rank
            if b.own is not None:  # (only a failed backward leaves one behind, or a second gradient adds to it)
                if accumulate:
                    b.rows[r].copy_(b.own)
                b.own = None
            if (self.grad_pool is None and not accumulate and self.reduce_now and len(b.entries) == 1
                    and b.cols == e.chunk
                    and e.numel == w * e.chunk and flat.dtype == b.rows.dtype == self.comm_dtype):
                # a bucket of one unpadded parameter, reduced in this backward: the peers' rows are copied
                # in, and the reduction reads this rank's own row where it lies in the gradient (not where
                # the gradient goes back to the pool now: its memory serves the next layer's gradient)
                parts = flat.view(w, e.chunk)
                for j in range(w):
                    if j != r:
                        b.rows[j].copy_(parts[j])
                b.own = parts[r]
            else:
                if not accumulate:  # the first gradient of the window overwrites what the buffer held
                    zero_padding(b.rows, col, e.chunk, e.numel)
                copy_into_rows(b.rows, col, e.chunk, flat, accumulate=accumulate)
            b.written.add(e.index_in_group)
        param.grad = None
        if self.grad_pool is not None:  # nothing reads it any more (no own row is kept with a pool)
            del flat
            self.grad_pool.give(grad)
        b.ready.add(e.index_in_group)
        self.pending = True
        if self.on_param_reduced is not None:
            self.on_param_reduced(param)
        if self.reduce_now:
            self._launch_ready()

    def _bucket_dtype(self) -> torch.dtype:
        return torch.float32 if self.accumulate_locally else self.comm_dtype

    def _new_rows(self, b: Bucket) -> torch.Tensor:
        """A ``(world, cols)`` buffer for ``b``, its content undefined (``b.written`` starts empty): from the
        communicator's exposed region when it has room, else from the pool."""
        numel, dtype = b.group.world * b.cols, self._bucket_dtype()
        region = self._regions.get(id(b.group.comm))
        rows = region.alloc(numel, dtype) if region is not None else None
        if rows is None:
            rows = self._take("rows", numel, dtype)
        b.written.clear()
        return rows.view(b.group.world, b.cols)

    def _drop_rows(self, b: Bucket) -> None:
        region = self._regions.get(id(b.group.comm))
        if region is not None and region.offset_of(b.rows) is not None:
            region.free(b.rows.view(-1))
        else:
            self._give("rows", b.rows)
        b.rows = None
        b.own = None
        b.written.clear()

    def _take(self, kind: str, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """A flat buffer of ``numel`` elements (uninitialized): a pooled one large enough, else a new one."""
        free = self._pool.get((kind, dtype), [])
        for i, buf in enumerate(free):
            if buf.numel() >= numel:
                buf = free.pop(i)
                copy_done = self._reuse_after.pop(id(buf), None)
                if copy_done is not None:  # a copy to the host still reads it: the device waits, not the host
                    self._accelerator.current_stream().wait_event(copy_done)
                return buf[:numel]
        return torch.empty(numel, dtype=dtype, device=self.partitions.device)

    def _give(self, kind: str, t: torch.Tensor, read_until=None) -> None:
        """Return a buffer from :meth:`_take` to the pool, keeping at most ``max_inflight + 1`` per kind;
        ``read_until``: the event of a copy on another stream that still reads it."""
        base = t._base if t._base is not None else t
        free = self._pool.setdefault((kind, t.dtype), [])
        free.append(base)
        if read_until is not None:
            self._reuse_after[id(base)] = read_until
        if len(free) > self.max_inflight + 1:  # keep the largest ones
            free.sort(key=lambda x: x.numel(), reverse=True)
            for dropped in free[self.max_inflight + 1 :]:
                self._reuse_after.pop(id(dropped), None)
            del free[self.max_inflight + 1 :]

    def _launch_ready(self) -> None:
        while self._next_launch < len(self.buckets):
            b = self.buckets[self._next_launch]
            if len(b.ready) < len(b.entries):
                return
            self._launch(b)
            self._next_launch += 1

    def _launch(self, b: Bucket) -> None:
        if b.rows is None:  # no parameter of this bucket got a gradient: it contributes zeros
            b.rows = self._new_rows(b)
        if self.stage >= 1:
            for e in b.entries:
                if e.index_in_group not in b.written:  # no gradient in this window
                    col = b.col_of[e.index_in_group]
                    b.rows[:, col : col + e.chunk].zero_()
        send = b.rows
        if send.dtype != self.comm_dtype:
            send = (send / self.dp if self.predivide else send).to(self.comm_dtype)
        b.send = send
        if self.stage == 0:
            b.handle = b.group.comm.all_reduce(send)
        else:
            swap = self.partitions.grad_swap
            if swap is not None:  # the group's gradient partition comes back from the swap store
                gi = b.group.layout.group_index
                swap.acquire(gi, overwrite=all(x.partition_stale for x in self._group_buckets[gi]))
            grad = b.group.grad[b.part_slice]
            b.out_is_partition = (b.partition_stale and grad.dtype == self.comm_dtype
                                  and grad.device == send.device)
            b.out = grad if b.out_is_partition else self._take("out", b.cols, self.comm_dtype)
            b.handle = b.group.comm.reduce_scatter(b.out, send, own=b.own)
        b.launched = True
        self._inflight.append(b)
        # Bound what is in flight, so bucket buffers (and the transport's receive buffers) are freed as
        # backward goes on: at most max_inflight buckets' worth of gradient exists beyond the partitions.
        while len(self._inflight) > self.max_inflight:
            self._settle(self._inflight.pop(0))

    def _settle(self, b: Bucket) -> None:
        b.handle.wait()
        if self.stage == 0:
            if b.send is not b.rows:
                b.rows[0].copy_(b.send[0])
        elif not b.out_is_partition:
            grad = b.group.grad[b.part_slice]
            if b.out.device.type != grad.device.type:  # offload: the host accumulator, added at drain()
                self._copy_to_host(b, grad)
            else:
                if b.partition_stale:
                    grad.copy_(b.out)
                else:
                    grad.add_(b.out)
                self._give("out", b.out)
        b.partition_stale = b.out_is_partition = False
        b.handle = b.out = b.send = b.own = None
        if self.stage == 1:
            b.written.clear()  # the next window overwrites the rows instead of zeroing them now
        elif self.stage >= 2:
            self._drop_rows(b)  # the full-size gradient dies with its bucket
        if self.partitions.grad_swap is not None and self.stage >= 1:
            gi = b.group.layout.group_index
            self._settled[gi] = self._settled.get(gi, 0) + 1
            if self._settled[gi] == len(self._group_buckets[gi]):  # the group's last bucket: write it out
                del self._settled[gi]
                self.drain()  # (offload to the host from an accelerator: its copies are added first)
                self.partitions.grad_swap.release(gi)

    def _copy_to_host(self, b: Bucket, grad: torch.Tensor) -> None:
        """Queue the copy of ``b``'s reduced slice into its pinned host buffer on the side stream."""
        acc = self._accelerator
        if any(pending[0] is b for pending in self._to_host):
            self.drain(only_if_unfinished=True)  # its host buffer is about to be rewritten
        # the window's first reduction into a pinned partition (offload_optimizer.pin_memory) lands in the
        # partition itself; others go through the bucket's own pinned buffer, added at drain()
        direct = b.partition_stale and b.out.dtype == grad.dtype and acc.is_pinned(grad)
        if direct:
            host = grad
        else:
            if b.host_out is None or b.host_out.numel() < b.out.numel() or b.host_out.dtype != b.out.dtype:
                b.host_out = acc.pin_memory(torch.empty(b.out.numel(), dtype=b.out.dtype))
            host = b.host_out[: b.out.numel()]
        reduced = acc.Event()
        reduced.record(acc.current_stream())  # the reduction's result is complete on the compute stream
        with acc.stream_context(self._d2h_stream):
            self._d2h_stream.wait_event(reduced)
            host.copy_(b.out, non_blocking=acc.is_pinned(host))
            copied = acc.Event()
            copied.record(self._d2h_stream)
        acc.record_stream(b.out, self._d2h_stream)  # should the pool drop it, its memory waits for the copy
        self._to_host.append((b, grad, None if direct else b.partition_stale, copied))
        self._give("out", b.out, read_until=copied)

    @torch.no_grad()
    def drain(self, only_if_unfinished: bool = False) -> None:
        """Add the reduced slices copied to the host into the (host) gradient partitions: one host wait, on
        the newest copy (the side stream runs them in order).  ``only_if_unfinished``: skip the wait when the
        copies are done already (a later backward reusing a bucket's buffer)."""
        if not self._to_host:
            return
        newest = self._to_host[-1][3]
        if not (only_if_unfinished and newest.query()):
            newest.synchronize()
            self.host_waits += 1
        for b, grad, overwrite, _ in self._to_host:
            if overwrite is None:  # copied straight into the partition
                continue
            host = b.host_out[: grad.numel()]
            if overwrite:
                grad.copy_(host)
            else:
                grad.add_(host)
        self._to_host = []

    @torch.no_grad()
    def flush(self) -> None:
        """End of a backward: reduce what is left (if this is a reducing backward) and settle buckets."""
        if self.reduce_now:
            while self._next_launch < len(self.buckets):
                self._launch(self.buckets[self._next_launch])
                self._next_launch += 1
            while self._inflight:
                self._settle(self._inflight.pop(0))
            self._next_launch = 0
            self.pending = False
        for b in self.buckets:  # readiness is per backward; unreduced gradients stay in the local buffers
            b.ready.clear()
            b.launched = False
        self._settled.clear()

    def forget(self) -> None:
        """After a step (stages 1-3): the gradient partitions' content is spent; the next window's first
        reduction of each bucket overwrites it (instead of zeroing every partition now)."""
        self.drain()
        if self.stage >= 1:
            for b in self.buckets:
                b.partition_stale = True
        if self.partitions.grad_swap is not None:
            self.partitions.grad_swap.forget()

    @torch.no_grad()
    def zero_stale(self) -> None:
        """Before the partitions are read (the step, the norm): zero the slices no reduction of this window
        reached (every slice, when the window had no reducing backward)."""
        self.drain()
        swap = self.partitions.grad_swap
        back: set[int] = set()  # swapped groups read back to zero some slices, written out again after
        untouched = {gi for gi, bs in self._group_buckets.items() if all(x.partition_stale for x in bs)}
        for b in self.buckets:
            if b.partition_stale:
                gi = b.group.layout.group_index
                if swap is not None and not swap.resident(gi):
                    if gi in untouched:
                        b.partition_stale = False  # nothing of this window: the swap counts the group as zero
                        swap.discard(gi)
                        continue
                    swap.acquire(gi, overwrite=False)  # (a failed backward reached only some of its buckets)
                    back.add(gi)
                b.group.grad[b.part_slice].zero_()
                b.partition_stale = False
        for gi in back:
            swap.release(gi)

    def zero_local(self) -> None:
        """Drop gradients accumulated locally but not yet reduced (stages 0 and 1)."""
        self.drain()  # reduced ones are in the partitions already
        for b in self.buckets:
            if self.stage == 0:
                b.rows.zero_()
            b.written.clear()  # stage 1: the next gradient overwrites the rows
        self.pending = False

    def grad_scale(self) -> float:
        """Factor that turns the reduced sums in the gradient partitions into the mean gradient."""
        return 1.0 if self.predivide else 1.0 / self.dp

    def remove_hooks(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []
        for b in self.buckets:
            b.rows = b.out = b.send = b.handle = b.own = None
        self._pool.clear()
        if self.grad_pool is not None:
            self.grad_pool.clear()
        self._reuse_after.clear()
        if self._to_host:  # the copies still write the host buffers about to go
            self._to_host[-1][3].synchronize()
        self._to_host = []
        self._regions = {}
