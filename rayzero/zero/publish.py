"""Publishing updated weights: after a step, the fp32 masters become the model's compute-dtype parameters.

Stages 1 and 2 (and stage 3's persistent parameters) all-gather each parameter's shards from the ranks
that own them, bucket by bucket (``allgather_bucket_size``).

**Weights shared by the ranks of one host** (stages 1-2).  Every rank of a reduction domain holds the
same weights, so where the domain's ranks all run on one host (rayzero/comm/shm.py) one copy serves them
all: at set-up the parameters of that domain move into one tensor every rank maps
(``Communicator.shared_tensor``), and publishing is each rank writing its own shard of every parameter
into it, between two barriers (no rank still reads the old weights when the first rank writes; no rank
runs a forward before the last rank has written).  Nothing is gathered and the host keeps one copy of the
weights instead of one per rank.  In fp32 (``alias_masters``) a parameter alone in its partition group has
no write either: its master is the rank's row of the shared weights, so the optimizer updates them in
place (the engine gives large parameters a group of their own for this, ``ALIAS_ALONE_FROM``, and waits
for the host's ranks before an update or a load rewrites them: ``Partitions.settle_exposed_reads``).
``Engine.destroy`` gives every rank a private copy back.  Stage 3 does the same where
``zero_optimization.stage3_share_weights`` says so (zero/stage3.py): its parameters that could not be
shared (a communicator across hosts) are left out of publishing (``only_if_shared``) and gathered.

**Overlap with the next forward** (``zero_optimization.overlap_param_gather``, stages 1-2, where weights are
gathered).  ``publish()`` leaves its last gathers (at most ``MAX_INFLIGHT``) running; the engine runs the next
forward under ``WaitForWeights``, which completes a gather before any operation reads one of its
parameters, and ``finish()`` completes the rest before anything else touches the weights or the masters.

**Optimizer offload** (masters in host memory, weights on an accelerator).  ``publish()`` first casts every
host shard it sends into one pinned host buffer (offload/staging.py), copies that to the device at once on
the staging's copy stream (``non_blocking``) and makes the compute stream wait on the copy's event; the
buckets then read their shards from that device tensor.  The host waits only before it refills the buffer,
a publish two steps old, instead of one blocking copy from pageable memory per parameter.
"""

from __future__ import annotations

import torch
from torch.overrides import TorchFunctionMode

from rayzero.comm import Communicator, Handle
from rayzero.zero.layout import ParamEntry, copy_from_rows
from rayzero.zero.partition import GroupPartition, Partitions


# Stages 1-2 in fp32: a parameter with at least this many elements per rank gets a partition group of its own,
# so its master can alias its shared weights (engine.py).  Each group costs an optimizer call (~20 us on CPU);
# a copy of a shard this large costs about as much.
ALIAS_ALONE_FROM = 1 << 16


class WeightPublisher:
    """After a step, copies the updated fp32 masters into the model's compute-dtype parameters.

    ``params`` restricts it to a subset (stage 3 refreshes only its persistent parameters): their shards
    are packed into one send buffer per bucket, so only their elements travel.  ``share`` lets the ranks
    of a host share one copy of the weights (module docstring).
    """

    MAX_INFLIGHT = 2

    def __init__(
        self,
        partitions: Partitions,
        bucket_elements: int,
        compute_dtype: torch.dtype,
        params: set[torch.nn.Parameter] | None = None,
        share: bool = False,
        only_if_shared: set[torch.nn.Parameter] | None = None,
        alias_masters: bool = False,
        overlap: bool = False,
    ):
        self.partitions = partitions
        # overlap_param_gather: publish() leaves its all-gathers running; the next forward waits for each
        # parameter as an operation first reads it (WaitForWeights), and finish() for whatever is left
        self.overlap = overlap
        self._pending: list[_Gather] = []
        self._pending_of: dict[int, _Gather] = {}  # id(parameter) -> the gather that fills it
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
        self._staging = None  # optimizer offload: host shards reach the device through it (made on first use)
        # parameters whose storage every rank of their communicator shares: (world, chunk) rows of it
        self._shared_rows: dict[torch.nn.Parameter, torch.Tensor] = {}
        self._shared_comms: list[Communicator] = []
        # shared parameters whose fp32 master is this rank's row of the shared weights (nothing to copy)
        self._aliased: set[torch.nn.Parameter] = set()
        self._alias_masters = alias_masters
        if share:
            self._share_weights()
        if only_if_shared:
            # (stage 3) these are published only where a host's ranks share them; elsewhere they are gathered
            self.buckets = [(g, kept) for g, members in self.buckets
                            if (kept := [(e, p) for e, p in members
                                         if p in self._shared_rows or p not in only_if_shared])]

    # ---- weights shared by the ranks of a host -------------------------------------------------------------
    def _share_weights(self) -> None:
        """Move the parameters of every communicator whose ranks share a host into one tensor they all map
        (a collective, in bucket order); each rank writes its own shards into it."""
        by_comm: dict[int, list] = {}
        for g, members in self.buckets:
            if g.world > 1:
                by_comm.setdefault(id(g.comm), [g.comm, []])[1].extend((g, e, p) for e, p in members)
        for comm, members in by_comm.values():
            if not self._shareable([p for _, _, p in members]):
                continue
            total = sum(g.world * e.chunk for g, e, _ in members)
            shared = comm.shared_tensor(total, self.compute_dtype)
            if shared is None:
                continue
            offset = 0
            with torch.no_grad():
                for g, e, p in members:
                    padded = shared[offset : offset + g.world * e.chunk]
                    offset += g.world * e.chunk
                    rows = padded.view(g.world, e.chunk)
                    rows[g.rank].copy_(self.partitions.weight_shard(e))  # the padding is zero on every rank
                    self._shared_rows[p] = rows
                    p.data = padded[: e.numel].view(e.shape)
                    owner = self.partitions.group_of(e)  # (a bucket's g is its last group)
                    if self._alias_masters and self._can_alias(owner):
                        owner.master = rows[g.rank]  # the optimizer steps the shared weights themselves
                        self._aliased.add(p)
            comm.barrier()  # every rank wrote its shards: the shared weights are whole
            self._shared_comms.append(comm)
        self.partitions.aliased_comms = [c for c in self._shared_comms
                                         if any(p in self._aliased for _, _, p in by_comm[id(c)][1])]

    def _can_alias(self, g: GroupPartition) -> bool:
        """A group of one parameter, whose fp32 master is the compute dtype's and a plain host tensor: its
        partition is exactly the rank's row of that parameter's shared weights."""
        return (len(g.params) == 1 and g.weights is None and g.master.dtype == self.compute_dtype
                and g.master.device.type == "cpu" and g.master.numel() == g.layout.entries[0].chunk)

    def _shareable(self, params: list[torch.nn.Parameter]) -> bool:
        """Host tensors of the compute dtype, no two of which share memory (re-pointing one of two views of
        the same storage would untie them)."""
        spans = []
        for p in params:
            if p.device.type != "cpu" or p.dtype != self.compute_dtype:
                return False
            start = p.data_ptr()
            spans.append((start, start + p.numel() * p.element_size()))
        spans.sort()
        return all(a_end <= b_start for (_, a_end), (b_start, _) in zip(spans, spans[1:]))

    @property
    def shared_params(self) -> list[torch.nn.Parameter]:
        return list(self._shared_rows)

    @property
    def shares_weights(self) -> bool:
        return bool(self._shared_rows)

    def unshare(self, drop=()) -> None:
        """Give every shared parameter a private copy of its current value (no collective); those in
        ``drop`` (stage 3's, about to become stand-ins) get none.  Masters that alias the shared weights
        keep doing so: this is for ``Engine.destroy``, which drops the masters next."""
        drop = set(drop)
        with torch.no_grad():
            for p in self._shared_rows:
                if p not in drop:
                    p.data = p.data.clone()
        self._shared_rows.clear()
        self._shared_comms = []
        self._aliased.clear()
        self.partitions.aliased_comms = []

    # ---- publishing ------------------------------------------------------------------------------------------
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
        packed = [(g.world, sum(e.chunk for e, _ in m)) for g, m in self.buckets
                  if not self._direct(g, m) and m[0][1] not in self._shared_rows]
        send = max([c for _, c in packed] + [cols, 1])
        recv = max([w * c for w, c in packed] + [world * cols, 1])
        device = self.partitions.device
        return (torch.empty(send, dtype=self.compute_dtype, device=device),
                torch.empty(recv, dtype=self.compute_dtype, device=device))

    def _staged_shards(self) -> dict[int, torch.Tensor]:
        """Optimizer offload: every host shard this publish sends to the device, packed and copied over at
        once (module docstring); ``id(entry)`` -> its shard on the device, in the compute dtype."""
        host = []
        for g, members in self.buckets:
            if members[0][1] in self._shared_rows:  # written on the host: nothing goes to the device
                continue
            for e, p in members:
                if p.device.type != "cpu" and self.partitions.weight_shard(e).device.type == "cpu":
                    host.append(e)
        if not host:
            return {}
        if self._staging is None:
            from rayzero.offload.staging import HostStaging

            self._staging = HostStaging(self.partitions.device, self.compute_dtype)
        shards = [self.partitions.weight_shard(e) for e in host]
        packed = self._staging.pack(shards)
        staged, at = {}, 0
        for e, shard in zip(host, shards):
            staged[id(e)] = packed[at : at + shard.numel()]
            at += shard.numel()
        return staged

    @torch.no_grad()
    def publish(self) -> None:
        self.finish()
        staged = self._staged_shards()

        def shard_of(e: ParamEntry) -> torch.Tensor:
            return staged.get(id(e), self.partitions.weight_shard(e)) if staged else self.partitions.weight_shard(e)

        for comm in self._shared_comms:  # nobody still reads the weights about to be overwritten
            comm.barrier()
        inflight: list[_Gather] = []
        for g, members in self.buckets:
            world = g.world
            if world == 1:
                for e, p in members:
                    p.data.view(-1).copy_(shard_of(e)[: e.numel])
                continue
            if members[0][1] in self._shared_rows:  # the ranks' one copy: write my shards into it
                for e, p in members:
                    if p not in self._aliased:  # (an aliased master was updated in place)
                        self._shared_rows[p][g.rank].copy_(self.partitions.weight_shard(e))
                continue
            if self._direct(g, members):
                e, p = members[0]
                shard = shard_of(e)
                if shard.dtype != self.compute_dtype or shard.device != p.device or not shard.is_contiguous():
                    shard = shard.to(device=p.device, dtype=self.compute_dtype)
                inflight.append(_Gather(members, None, None, g.comm.all_gather(p.data.view(world, e.chunk), shard)))
            else:
                cols = sum(e.chunk for e, _ in members)
                buffers = self._buffers(world, cols)
                mine, rows = buffers[0][:cols], buffers[1][: world * cols].view(world, cols)
                col = 0
                for e, _ in members:
                    mine[col : col + e.chunk].copy_(shard_of(e))
                    col += e.chunk
                inflight.append(_Gather(members, rows, buffers, g.comm.all_gather(rows, mine)))
            # at most MAX_INFLIGHT gathers at once (each holds its buckets' buffers, or gloo's own); with
            # overlap the last ones are left running into the next forward, which reads their (last) layers last
            while len(inflight) > self.MAX_INFLIGHT:
                self._unpack(inflight.pop(0))
        if self.overlap:
            self._pending = inflight
            self._pending_of = {id(p): x for x in inflight for _, p in x.members}
        while inflight and not self.overlap:
            self._unpack(inflight.pop(0))
        for comm in self._shared_comms:  # nobody runs a forward before every shard is written
            comm.barrier()

    @property
    def pending(self) -> int:
        """How many of the last publish()'s gathers are still left running (overlap_param_gather)."""
        return len(self._pending)

    def wait_for(self, p: torch.nn.Parameter) -> None:
        """Complete the gather that fills ``p``, if one is still running."""
        x = self._pending_of.get(id(p))
        if x is not None:
            self._unpack(x)

    def finish(self) -> None:
        """Complete every gather still running: the parameters hold the updated weights."""
        while self._pending:
            self._unpack(self._pending[0])

    def _unpack(self, x: "_Gather") -> None:
        x.handle.wait()
        if x in self._pending:
            self._pending.remove(x)
            for _, p in x.members:
                self._pending_of.pop(id(p), None)
        if x.rows is None:  # gathered straight into the parameter
            return
        col = 0
        for e, p in x.members:
            copy_from_rows(p.data.view(-1), x.rows, col, e.chunk)
            col += e.chunk
        self._free_buffers.append(x.buffers)


class _Gather:
    """One bucket's all-gather in flight: ``rows``/``buffers`` None where it gathers straight into its
    one parameter."""

    __slots__ = ("members", "rows", "buffers", "handle")

    def __init__(self, members, rows: torch.Tensor | None, buffers, handle: Handle):
        self.members, self.rows, self.buffers, self.handle = members, rows, buffers, handle


class WaitForWeights(TorchFunctionMode):
    """Around a forward that follows an overlapped publish: before any operation reads a parameter whose
    gather is still running, that gather completes (an operation, not a module: a weight read by another
    module's forward, as tied weights are, is waited for too)."""

    def __init__(self, publisher: WeightPublisher):
        super().__init__()
        self.publisher = publisher

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        pending = self.publisher._pending_of
        if pending:
            for a in (*args, *kwargs.values()):
                if isinstance(a, torch.nn.Parameter):
                    if id(a) in pending:
                        self.publisher.wait_for(a)
                elif isinstance(a, (list, tuple)):
                    for b in a:
                        if isinstance(b, torch.nn.Parameter) and id(b) in pending:
                            self.publisher.wait_for(b)
        return func(*args, **kwargs)
