"""A rank's partitions: fp32 master weights and fp32 gradient partitions, one pair per optimizer param group."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch

from rayzero.comm import Communicator
from rayzero.parallel.state import ReduceDomain
from rayzero.zero.layout import GroupLayout, ParamEntry, shard_of


@dataclass
class GroupPartition:
    layout: GroupLayout
    params: list[torch.nn.Parameter]
    master: torch.Tensor  # fp32 [partition_numel]: the optimizer steps this tensor
    grad: torch.Tensor  # fp32 [partition_numel]: gradients accumulate here until the boundary
    domain: ReduceDomain  # where these parameters' gradients are reduced (DP, EDP, ...), see parallel/state.py
    user_group: int = 0  # the user's param group this partition group belongs to
    overrides: dict = field(default_factory=dict)  # the user's per-group hyper-parameters
    # Where published / gathered weights are read from when the master is not the source: a copy in the
    # compute dtype, on the compute device while NVMe offload swaps the master out between steps, or in
    # host memory with offload_param "cpu", or exposed to the other ranks of a host at stage 3
    # (expose_weight_sources).  None: the master itself is the source (no second copy).
    weights: torch.Tensor | None = None

    @property
    def weight_source(self) -> torch.Tensor:
        return self.weights if self.weights is not None else self.master

    @property
    def comm(self) -> Communicator:
        return self.domain.comm

    @property
    def world(self) -> int:
        """Ranks the partition is split over (1: this rank holds the whole group, as in stage 0)."""
        return self.layout.world

    @property
    def rank(self) -> int:
        return self.domain.comm.rank if self.layout.world > 1 else 0


# set on a param group by the engine: its index in the groups the user gave (all-frozen groups are dropped)
USER_GROUP_KEY = "_rayzero_user_group"


def _sub_groups(params: list, world: int, limit: int | None, alone: int | None = None) -> list[list]:
    """Consecutive runs of ``params`` whose partitions hold at most ``limit`` elements each (a larger
    parameter is a run of its own): the unit the optimizer steps and offload swaps (``sub_group_size``).
    With ``alone``, a parameter whose shard has at least that many elements is a run of its own too (its
    master can then be the rank's row of weights the ranks share: zero/publish.py)."""
    if not limit and not alone:
        return [params]
    runs: list[list] = []
    current: list = []
    size = 0
    for p in params:
        chunk = -(-p.numel() // world)
        single = bool(alone) and chunk >= alone
        if current and (single or (limit and size + chunk > limit)):
            runs.append(current)
            current, size = [], 0
        current.append(p)
        size += chunk
        if single:
            runs.append(current)
            current, size = [], 0
    if current or not runs:
        runs.append(current)
    return runs


def single_domain(comm: Communicator) -> Callable[[torch.Tensor], ReduceDomain]:
    """Every parameter reduced over ``comm`` (plain data parallelism)."""
    domain = ReduceDomain("dense", comm, True)
    return lambda p: domain


class Partitions:
    """Owns the fp32 master and gradient partitions of every param group, and maps params to entries.

    A user's param group is split further by reduction domain (dense parameters over data parallelism,
    experts over expert-data parallelism, ...), in the order the domains first appear in the group: each
    (user group, domain) pair is one partition group with its own layout, master and optimizer group.
    """

    def __init__(
        self,
        param_groups: list[dict],
        names: dict[torch.nn.Parameter, str],
        domain_of: Callable[[torch.Tensor], ReduceDomain] | Communicator,
        partitioned: bool,
        device: torch.device | None = None,
        sub_group_size: int | None = None,
        state_device: torch.device | None = None,
        pin_memory: bool = False,
        alone_from: int | None = None,
        swapped: bool = False,
        deferred_masters: bool = False,
    ):
        if isinstance(domain_of, Communicator):
            domain_of = single_domain(domain_of)
        # Partitions live where the model computes (the accelerator), masters included, unless the
        # optimizer is offloaded: then the masters and gradient accumulators live on ``state_device``.
        self.device = device if device is not None else torch.device("cpu")
        self.state_device = state_device if state_device is not None else self.device
        self._host_scalar: torch.Tensor | None = None  # pinned slot for the offloaded norm part
        self.partitioned = partitioned
        self.param_swap = None  # offload/params.py NvmeParamSwap, with offload_param on NVMe
        # offload/gradients.py GradientSwap, with the optimizer on NVMe (``swapped``): the gradient partitions
        # live in the swap store between backward and step, so none is allocated here
        self.grad_swap = None
        # ``deferred_masters``: the masters are filled and written to the swap store one group at a time by the
        # optimizer swap (offload/optimizer.py), so no moment holds the whole master partition: each is an empty
        # placeholder here (the optimizer is built over it; the swap gives it storage while it steps)
        # reads a swapped-out group's fp32 master (offload/optimizer.py), for exports between steps
        self.master_reader: Callable[[int], torch.Tensor] | None = None
        self.groups: list[GroupPartition] = []
        self.entry_of: dict[torch.nn.Parameter, ParamEntry] = {}
        # communicators whose ranks share weights that some masters alias (zero/publish.py): an update or
        # a load writes those weights in place, so it waits until no rank of the host still reads them
        self.aliased_comms: list[Communicator] = []
        for position, group in enumerate(param_groups):
            ui = group.get(USER_GROUP_KEY, position)
            by_domain: dict[str, tuple[ReduceDomain, list]] = {}
            for p in group["params"]:
                d = domain_of(p)
                by_domain.setdefault(d.kind, (d, []))[1].append(p)
            overrides = {k: v for k, v in group.items() if k not in ("params", USER_GROUP_KEY)}
            for domain, params in by_domain.values():
                # Stage 0 lays every group out over a world of one: the rank owns the whole group.
                world = domain.comm.world if partitioned else 1
                for run in _sub_groups(params, world, sub_group_size, alone_from if world > 1 else None):
                    gi = len(self.groups)
                    layout = GroupLayout.build(gi, [(names[p], p) for p in run], world)
                    # the master is left unwritten: load_masters_from_params writes every element of it (each
                    # shard zero padded), so its pages are first touched there, as the zero_init shards it copies
                    # are dropped one by one (no moment holds a whole zeroed master beside every shard)
                    if deferred_masters:
                        master = torch.empty(0, dtype=torch.float32, device=self.state_device)
                    else:
                        master = self._zeros(layout.partition_numel, pin_memory, zero=False)
                    if swapped:
                        grad = torch.empty(0, dtype=torch.float32, device=self.state_device)
                    else:
                        grad = self._zeros(layout.partition_numel, pin_memory)
                    self.groups.append(GroupPartition(layout, run, master, grad, domain, ui, dict(overrides)))
                    for p, e in zip(run, layout.entries):
                        self.entry_of[p] = e

    def _zeros(self, numel: int, pin_memory: bool, zero: bool = True) -> torch.Tensor:
        t = (torch.zeros if zero else torch.empty)(numel, dtype=torch.float32, device=self.state_device)
        if not (pin_memory and self.state_device.type == "cpu"):
            return t
        # pinned by the compute device's accelerator: a device kind torch cannot pin for (a PrivateUse1
        # backend without a pinned allocator) may still have its own way, or none (then pageable memory)
        from rayzero.offload.staging import accelerator_for

        acc = accelerator_for(self.device)
        return acc.pin_memory(t) if acc is not None else t.pin_memory()

    def all_params(self) -> list[torch.nn.Parameter]:
        return [p for g in self.groups for p in g.params]

    def group_of(self, entry: ParamEntry) -> GroupPartition:
        return self.groups[entry.group_index]

    def master_shard(self, entry: ParamEntry) -> torch.Tensor:
        return self.group_of(entry).master[entry.partition_offset : entry.partition_offset + entry.chunk]

    def weight_shard(self, entry: ParamEntry) -> torch.Tensor:
        """This rank's shard of a parameter's current weights, read by publishing and stage-3 gathers."""
        if self.param_swap is not None:  # offload_param to NVMe: read from the rank's swap files
            return self.param_swap.shard(entry)
        return self.group_of(entry).weight_source[entry.partition_offset : entry.partition_offset + entry.chunk]

    def prefetch_weights(self, entries: list[ParamEntry]) -> None:
        """Start reading these shards ahead of ``weight_shard`` (only parameter offload reads anything)."""
        if self.param_swap is not None:
            self.param_swap.prefetch(entries)

    def grad_shard(self, entry: ParamEntry) -> torch.Tensor:
        g = self.group_of(entry)
        grad = g.grad
        if self.grad_swap is not None and not self.grad_swap.resident(entry.group_index):
            grad = self.grad_swap.read(entry.group_index)  # between backward and step: in the swap store
        return grad[entry.partition_offset : entry.partition_offset + entry.chunk]

    @torch.no_grad()
    def load_masters_from_params(self) -> None:
        """Fill the fp32 masters from the parameters' current values (or their zero_init shards): every
        element, padding included (the masters are allocated unwritten; the engine calls this right after).
        Groups whose master is deferred (``deferred_masters``) are left to the optimizer swap."""
        from rayzero.accelerator.host_allocator import give_back_now

        for g in self.groups:
            if g.master.numel() != g.layout.partition_numel:
                continue
            if self.load_master_group(g, g.master):  # with offload, the shards just dropped leave the process
                give_back_now()

    @torch.no_grad()
    def load_master_group(self, g: GroupPartition, master: torch.Tensor) -> bool:
        """Write group ``g``'s fp32 master into ``master`` (``partition_numel`` elements) from its parameters
        or their zero_init shards, dropping each shard once copied; returns whether any shard was dropped."""
        dropped = False
        for p, e in zip(g.params, g.layout.entries):
            out = master[e.partition_offset : e.partition_offset + e.chunk]
            pre_sharded = getattr(p, "_rayzero_shard", None)
            if pre_sharded is not None:
                if pre_sharded.numel() != e.chunk:
                    raise RuntimeError(
                        f"parameter {e.name!r} was sharded by rayzero.zero_init for a world of a "
                        f"different size (shard of {pre_sharded.numel()} elements, expected {e.chunk}); "
                        "build the model under zero_init in the same process group it trains in"
                    )
                if hasattr(pre_sharded, "read_into"):  # written to NVMe by zero_init (zero/init.py)
                    pre_sharded.read_into(out)
                else:
                    out.copy_(pre_sharded)
                # the master holds it now: drop the shard at once, so that the rank never holds every
                # shard and the whole master together (the empty tensor still marks a zero_init parameter)
                p._rayzero_shard = torch.empty(0, dtype=torch.float32)
                dropped = True
            else:
                shard_of(p.detach().reshape(-1).float(), e, g.rank, out)
        return dropped

    @torch.no_grad()
    def refresh_weights(self, groups: list[GroupPartition] | None = None) -> None:
        """After the masters changed: copy them into the separate weight partitions, or (parameter offload
        to NVMe) write the shards to the swap files.  Groups whose master is swapped out are skipped."""
        for g in self.groups if groups is None else groups:
            if g.master.numel() != g.layout.partition_numel:
                continue
            if self.param_swap is not None:
                self.param_swap.write_from(g.layout.entries, g.master)
            elif g.weights is not None:
                g.weights.copy_(g.master)

    @torch.no_grad()
    def expose_weight_sources(self, compute_dtype: torch.dtype, groups: list[GroupPartition] | None = None) -> None:
        """Move each group's weight source (what stage-3 gathers read) into memory that the other ranks of
        its communicator read in place, where they share this host (a collective: rayzero/comm/shm.py,
        ExposedRegion).  A gather then copies every rank's shard straight from its owner.  Where the
        compute dtype is not the master's (bf16, fp16) the exposed source is a copy of the partition in the
        compute dtype, refreshed after each step (``refresh_weights``): converted once a step instead of at
        every gather, and half the bytes to read.  ``groups``: only these (the ranks of each decide alike)."""
        for g in self.groups if groups is None else groups:
            if g.world == 1 or g.master.device.type != "cpu":
                continue
            src = g.weight_source
            dtype = compute_dtype if g.weights is None and src.is_floating_point() else src.dtype
            region = g.comm.expose_region(src.numel() * torch.empty(0, dtype=dtype).element_size())
            exposed = region.alloc(src.numel(), dtype) if region is not None else None
            if exposed is None:
                continue
            exposed.copy_(src)
            if g.weights is not None or dtype != g.master.dtype:
                g.weights = exposed
            else:
                g.master = exposed

    def settle_exposed_reads(self) -> None:
        """Before the weight sources are rewritten (a step, a load): every other rank has read what it
        gathered from them, and no rank still runs a forward or backward on weights a master aliases."""
        for comm in self.aliased_comms:
            comm.barrier()
        seen = set()
        for g in self.groups:
            if g.world > 1 and id(g.comm) not in seen:
                seen.add(id(g.comm))
                g.comm.settle_reads()

    def zero_grads(self) -> None:
        if self.grad_swap is not None:
            self.grad_swap.forget()
            return
        for g in self.groups:
            g.grad.zero_()

    def local_grad_sq_sum(self, whole_on_every_rank: bool = False) -> torch.Tensor:
        """Sum of squares of the gradient elements this rank counts, in fp32.

        Summed over all ranks it covers every distinct element exactly once: partitions are disjoint
        inside their domain's group, TP replicas count only on their primary rank, and where every rank of
        a group holds the whole gradient (stage 0) only the group's rank 0 counts it.  With
        ``whole_on_every_rank`` (stage 0 without EP/TP) this rank counts everything: its sum is the global
        one and needs no collective.
        """
        total = torch.zeros((), dtype=torch.float32, device=self.device)
        on_host = None  # offloaded gradients live on the host: their part is summed there
        for gi, g in enumerate(self.groups):
            counted = whole_on_every_rank or (g.domain.primary and (g.world > 1 or g.domain.comm.rank == 0))
            if counted and self.grad_swap is not None:  # swapped out: its sum of squares was taken at the write
                sq = self.grad_swap.sq_sum(gi)
                if sq is not None:
                    on_host = sq if on_host is None else on_host + sq
            elif counted and g.grad.numel():
                sq = torch.dot(g.grad, g.grad)
                if sq.device == total.device:
                    total += sq
                else:
                    on_host = sq if on_host is None else on_host + sq
        if on_host is not None:
            total += self._to_device_without_waiting(on_host)
        return total

    def _to_device_without_waiting(self, scalar: torch.Tensor) -> torch.Tensor:
        """A host scalar on the compute device through a pinned slot kept for it: the copy is queued behind
        the device's work instead of the host waiting for that work (a copy from pageable memory would).
        The slot is rewritten only at the next step, after the norm's read has waited for this copy."""
        if self.device.type == "cpu":
            return scalar
        if self._host_scalar is None:
            self._host_scalar = self._zeros(1, pin_memory=True)[0]
        self._host_scalar.copy_(scalar)
        return self._host_scalar.to(self.device, non_blocking=True)

    @torch.no_grad()
    def gather_full(self, entry: ParamEntry, source: str = "master") -> torch.Tensor:
        """The whole fp32 value of one parameter (``source``: 'master' or 'grad'), on every rank."""
        g = self.group_of(entry)
        if source == "master" and g.master.numel() != g.layout.partition_numel and self.master_reader is not None:
            master = self.master_reader(entry.group_index)  # swapped out to NVMe
            shard = master[entry.partition_offset : entry.partition_offset + entry.chunk]
        else:
            shard = self.master_shard(entry) if source == "master" else self.grad_shard(entry)
        if g.world == 1:
            return shard[: entry.numel].clone().view(entry.shape)
        rows = torch.empty((g.world, entry.chunk), dtype=torch.float32, device=self.device)
        g.comm.all_gather(rows, shard.to(rows.device).contiguous()).wait()  # offloaded masters: host
        # rank r holds elements [r*chunk, (r+1)*chunk): the rows in order are the parameter plus < W padding
        return rows.view(-1)[: entry.numel].view(entry.shape)
