"""Gradient buckets (every stage) and weight publishing for ZeRO stages 0-2.

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
  back to a small pool (at most ``MAX_INFLIGHT + 1`` of them, the most a backward has alive at once) and
  are reused by the next bucket: a freshly allocated multi-megabyte buffer costs a page fault per 4 KiB
  on first touch, which on CPU made every stage-2 backward pay for zeroing new memory (about a third of
  the step on a small model).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch

from rayzero.comm import Handle
from rayzero.zero.layout import ParamEntry, copy_from_rows, copy_into_rows
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
    ready: set = field(default_factory=set)
    launched: bool = False
    handle: Handle | None = None
    out: torch.Tensor | None = None
    send: torch.Tensor | None = None

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

    def __init__(
        self,
        partitions: Partitions,
        stage: int,
        bucket_elements: int,
        comm_dtype: torch.dtype,
        data_parallel_size: int,
        on_param_reduced: Callable[[torch.nn.Parameter], None] | None = None,
    ):
        self.partitions = partitions
        self.stage = stage
        self.comm_dtype = comm_dtype
        self.dp = data_parallel_size
        self.on_param_reduced = on_param_reduced
        # 16-bit reductions divide before summing so the sum cannot overflow; fp32 divides once at the end.
        self.predivide = comm_dtype != torch.float32
        self.buckets = make_buckets(partitions, bucket_elements)
        self.bucket_of: dict[torch.nn.Parameter, Bucket] = {}
        for b in self.buckets:
            for p in b.params:
                self.bucket_of[p] = b
        self.accumulate_locally = stage in (0, 1)
        if self.accumulate_locally:
            for b in self.buckets:
                if stage == 0:
                    b.rows = b.group.grad[b.part_slice].view(1, b.cols)
                else:
                    b.rows = torch.zeros((b.group.world, b.cols), dtype=torch.float32, device=partitions.device)
        self._inflight: list[Bucket] = []
        self._pool: dict[tuple[str, torch.dtype], list[torch.Tensor]] = {}  # freed flat buffers, for reuse
        self.reduce_now = True  # set per backward: reduce in this backward (boundary) or only accumulate
        self.pending = False  # some gradients are in buckets but not yet in the partition
        self._next_launch = 0
        self._hooks = [p.register_post_accumulate_grad_hook(self._on_grad) for p in self.bucket_of]

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
            copy_into_rows(b.rows, col, e.chunk, flat, accumulate=self.accumulate_locally or e.index_in_group in b.ready)
        param.grad = None
        b.ready.add(e.index_in_group)
        self.pending = True
        if self.on_param_reduced is not None:
            self.on_param_reduced(param)
        if self.reduce_now:
            self._launch_ready()

    def _bucket_dtype(self) -> torch.dtype:
        return torch.float32 if self.accumulate_locally else self.comm_dtype

    def _new_rows(self, b: Bucket) -> torch.Tensor:
        return self._take("rows", b.group.world * b.cols, self._bucket_dtype()).view(b.group.world, b.cols).zero_()

    def _take(self, kind: str, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """A flat buffer of ``numel`` elements (uninitialized): a pooled one large enough, else a new one."""
        free = self._pool.get((kind, dtype), [])
        for i, buf in enumerate(free):
            if buf.numel() >= numel:
                return free.pop(i)[:numel]
        return torch.empty(numel, dtype=dtype, device=self.partitions.device)

    def _give(self, kind: str, t: torch.Tensor) -> None:
        """Return a buffer from :meth:`_take` to the pool, keeping at most ``MAX_INFLIGHT + 1`` per kind."""
        base = t._base if t._base is not None else t
        free = self._pool.setdefault((kind, t.dtype), [])
        free.append(base)
        if len(free) > self.MAX_INFLIGHT + 1:  # keep the largest ones
            free.sort(key=lambda x: x.numel(), reverse=True)
            del free[self.MAX_INFLIGHT + 1 :]

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
        send = b.rows
        if send.dtype != self.comm_dtype:
            send = (send / self.dp if self.predivide else send).to(self.comm_dtype)
        b.send = send
        if self.stage == 0:
            b.handle = b.group.comm.all_reduce(send)
        else:
            b.out = self._take("out", b.cols, self.comm_dtype)
            b.handle = b.group.comm.reduce_scatter(b.out, send)
        b.launched = True
        self._inflight.append(b)
        # Bound what is in flight, so bucket buffers (and the transport's receive buffers) are freed as
        # backward goes on: at most MAX_INFLIGHT buckets' worth of gradient exists beyond the partitions.
        while len(self._inflight) > self.MAX_INFLIGHT:
            self._settle(self._inflight.pop(0))

    def _settle(self, b: Bucket) -> None:
        b.handle.wait()
        if self.stage == 0:
            if b.send is not b.rows:
                b.rows[0].copy_(b.send[0])
        else:
            grad = b.group.grad[b.part_slice]
            grad.add_(b.out if b.out.device == grad.device else b.out.to(grad.device))  # offload: host accumulator
            self._give("out", b.out)
        b.handle = b.out = b.send = None
        if self.stage == 1:
            b.rows.zero_()
        elif self.stage >= 2:
            self._give("rows", b.rows)
            b.rows = None  # the full-size gradient dies with its bucket

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

    def zero_local(self) -> None:
        """Drop gradients accumulated locally but not yet reduced (stages 0 and 1)."""
        if self.accumulate_locally:
            for b in self.buckets:
                b.rows.zero_()
        self.pending = False

    def grad_scale(self) -> float:
        """Factor that turns the reduced sums in the gradient partitions into the mean gradient."""
        return 1.0 if self.predivide else 1.0 / self.dp

    def remove_hooks(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []
        for b in self.buckets:
            b.rows = b.out = b.send = b.handle = None
        self._pool.clear()


class WeightPublisher:
    """After a step, copies the updated fp32 masters into the model's compute-dtype parameters.

    ``params`` restricts it to a subset (stage 3 refreshes only its persistent parameters): their shards
    are packed into one send buffer per bucket, so only their elements travel.
    """

    MAX_INFLIGHT = 2

    def __init__(
        self,
        partitions: Partitions,
        bucket_elements: int,
        compute_dtype: torch.dtype,
        params: set[torch.nn.Parameter] | None = None,
    ):
        self.partitions = partitions
        self.compute_dtype = compute_dtype
        # a bucket holds parameters partitioned over one communicator (it is gathered over those ranks);
        # consecutive partition groups over the same ranks share buckets
        self.buckets: list[tuple[GroupPartition, list[tuple[ParamEntry, torch.nn.Parameter]]]] = []
        current, size, owner = [], 0, None
        for g in partitions.groups:
            if current and g.comm is not owner.comm:
                self.buckets.append((owner, current))
                current, size = [], 0
            owner = g
            for p, e in zip(g.params, g.layout.entries):
                if params is not None and p not in params:
                    continue
                if current and size + e.padded_numel > bucket_elements:
                    self.buckets.append((owner, current))
                    current, size = [], 0
                current.append((e, p))
                size += e.padded_numel
        if current:
            self.buckets.append((owner, current))

        # send and receive buffers of the packed buckets, kept from one step to the next (a fresh one costs
        # a page fault per 4 KiB page on every step); at most MAX_INFLIGHT + 1 of each are in use at once
        self._free_buffers: list[tuple[torch.Tensor, torch.Tensor]] = []

    def _direct(self, g: GroupPartition, members) -> bool:
        """A bucket of one parameter whose shards tile it exactly is gathered straight into it: the
        parameter's storage viewed as ``(world, chunk)`` is the all-gather's output."""
        if len(members) != 1:
            return False
        e, p = members[0]
        return e.numel == e.chunk * g.world and p.data.is_contiguous() and p.dtype == self.compute_dtype

    def _buffers(self, world: int, cols: int) -> tuple[torch.Tensor, torch.Tensor]:
        """A free (send, receive) pair for a packed bucket of ``cols`` columns over ``world`` ranks; a new
        pair is sized for the largest packed bucket, so any pair serves any bucket of the same world."""
        for i, (send, recv) in enumerate(self._free_buffers):
            if send.numel() >= cols and recv.numel() >= world * cols:
                return self._free_buffers.pop(i)
        packed = [(g.world, sum(e.chunk for e, _ in m)) for g, m in self.buckets if not self._direct(g, m)]
        send = max([c for _, c in packed] + [cols, 1])
        recv = max([w * c for w, c in packed] + [world * cols, 1])
        device = self.partitions.device
        return (torch.empty(send, dtype=self.compute_dtype, device=device),
                torch.empty(recv, dtype=self.compute_dtype, device=device))

    @torch.no_grad()
    def publish(self) -> None:
        device = self.partitions.device
        inflight: list = []
        for g, members in self.buckets:
            world = g.world
            if world == 1:
                for e, p in members:
                    p.data.view(-1).copy_(self.partitions.weight_shard(e)[: e.numel])
                continue
            if self._direct(g, members):
                e, p = members[0]
                shard = self.partitions.weight_shard(e)
                if shard.dtype != self.compute_dtype or shard.device != p.device or not shard.is_contiguous():
                    shard = shard.to(device=p.device, dtype=self.compute_dtype)
                handle = g.comm.all_gather(p.data.view(world, e.chunk), shard)
                inflight.append((None, None, None, handle))
            else:
                cols = sum(e.chunk for e, _ in members)
                buffers = self._buffers(world, cols)
                mine, rows = buffers[0][:cols], buffers[1][: world * cols].view(world, cols)
                col = 0
                for e, _ in members:
                    mine[col : col + e.chunk].copy_(self.partitions.weight_shard(e))
                    col += e.chunk
                inflight.append((members, rows, buffers, g.comm.all_gather(rows, mine)))
            while len(inflight) > self.MAX_INFLIGHT:
                self._unpack(*inflight.pop(0))
        while inflight:
            self._unpack(*inflight.pop(0))

    def _unpack(self, members, rows: torch.Tensor | None, buffers, handle: Handle) -> None:
        handle.wait()
        if members is None:  # gathered straight into the parameter
            return
        col = 0
        for e, p in members:
            copy_from_rows(p.data.view(-1), rows, col, e.chunk)
            col += e.chunk
        self._free_buffers.append(buffers)
