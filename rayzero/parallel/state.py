"""The parallel layout in force for one engine: DP x EP x TP process groups, and each parameter's domain.

A parameter's *domain* says over which ranks its gradient is summed and its ZeRO partition is split, and
whether this rank is the one that counts (and saves) its elements:

============================  ==========================  ============================================
parameter                     reduced and partitioned     counted in the norm / saved by
============================  ==========================  ============================================
dense, replicated over TP     DP group                    TP rank 0 of each TP group (TP copies once)
dense, TP slice ("shard")     DP group                    every rank (each holds distinct elements)
dense, TP partial gradient    DP x TP (the world)         every rank (the partition spans the world)
expert, replicated over TP    EDP group                   TP rank 0
expert, TP slice              EDP group                   every rank
============================  ==========================  ============================================

Every gradient is divided by the data-parallel size ``dp`` (the number of distinct data shards), whatever
group reduced it: an expert's gradient on its owner already sums the tokens of its whole EP group, and the
EDP reduction adds the other EP groups', so ``1/dp`` makes it the gradient of the mean loss over all data,
exactly as one process training on every shard would compute it.

**Stage-3 gathers on a group of their own.**  A device backend (NCCL) runs each process group's collectives
in order on one stream of that group, so stage 3's prefetched all-gathers would queue behind the bucket
reduce-scatters of the same ranks (and the other way round).  Where the groups go through the backend's own
collectives (the ``native`` transport of a device backend), each domain also gets ``gather_comm``: a second
group over the same ranks, which stage 3 gathers parameters on (zero/stage3.py).  On gloo (the pairwise and
shared-memory transports of one host) the two kinds of work already run on the caller's thread in order, so
``gather_comm`` is the domain's own communicator and nothing changes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from rayzero.comm import Communicator, NativeTransport, group_backend
from rayzero.config import ConfigError
from rayzero.topology import ParallelDims, ProcessGroups, build_process_groups, destroy_process_groups


@dataclass(frozen=True, eq=False)
class ReduceDomain:
    kind: str  # "dense", "dense_tp", "dense_partial", "expert", "expert_tp"
    comm: Communicator  # the ranks this domain's gradients are summed over and its partitions split over
    primary: bool  # this rank holds the canonical copy of the domain's elements (TP replicas count once)
    gather_comm: Communicator | None = None  # the same ranks on a second group, for stage-3 gathers (or None)

    @property
    def param_gather_comm(self) -> Communicator:
        """Where stage 3 gathers this domain's parameters: the second group where there is one."""
        return self.gather_comm if self.gather_comm is not None else self.comm


#: Whether the domains get a second group for stage-3 gathers: None decides by the transport (module
#: docstring); True / False force it (tests run the second group on gloo with True).
SEPARATE_GATHER_GROUPS: bool | None = None


def wants_gather_groups(comm: Communicator) -> bool:
    if SEPARATE_GATHER_GROUPS is not None:
        return SEPARATE_GATHER_GROUPS and comm.world > 1
    return comm.world > 1 and type(comm.transport) is NativeTransport and dist.get_backend(comm.group) != "gloo"


def param_kind(p: torch.Tensor) -> str:
    expert = bool(getattr(p, "_rayzero_expert", False))
    tp = getattr(p, "_rayzero_tp", None)
    if tp not in (None, "shard", "partial"):
        raise ValueError(f"unknown tensor-parallel mark {tp!r} on a parameter; use 'shard' or 'partial'")
    if expert:
        if tp == "partial":
            raise ConfigError("expert parameters with partial tensor-parallel gradients are not supported")
        return "expert_tp" if tp == "shard" else "expert"
    return {None: "dense", "shard": "dense_tp", "partial": "dense_partial"}[tp]


class ParallelState:
    """Process groups and communicators for ``dims``; every rank builds it with the same dims."""

    def __init__(self, dims: ParallelDims, rank: int, transport: str):
        self.dims = dims
        self.rank = rank
        self.coords = dims.coords(rank)
        self.groups: ProcessGroups | None = None
        self.world = Communicator.for_group(None, transport=transport)
        if dims.world_size > 1 and (dims.tp > 1 or dims.ep > 1):
            self.groups = build_process_groups(dims, rank)
            # One Communicator per process group: two over the same group would hand out the same
            # pairwise tags to collectives in flight together.
            comms: dict = {}

            def comm(group):
                key = None if group is dist.group.WORLD or group is self.world.group else group
                if key is None:
                    return self.world
                return comms.setdefault(key, Communicator.for_group(key, transport=transport))

            self.dp, self.edp = comm(self.groups.dp), comm(self.groups.edp)
            self.tp_group, self.ep_group = self.groups.tp, self.groups.ep
        else:
            self.dp = self.edp = self.world
            self.tp_group = self.ep_group = None if dims.world_size == 1 else (self.world.group or dist.group.WORLD)
        self._gather_groups: list = []
        gather = self._gather_comms(dims, rank, transport) if wants_gather_groups(self.world) else {}
        dp_g, edp_g, world_g = (gather.get(id(c)) for c in (self.dp, self.edp, self.world))
        self._domains = {
            "dense": ReduceDomain("dense", self.dp, self.coords.tp == 0, dp_g),
            "dense_tp": ReduceDomain("dense_tp", self.dp, True, dp_g),
            "dense_partial": ReduceDomain("dense_partial", self.world, True, world_g),
            "expert": ReduceDomain("expert", self.edp, self.coords.tp == 0, edp_g),
            "expert_tp": ReduceDomain("expert_tp", self.edp, True, edp_g),
        }

    def _gather_comms(self, dims: ParallelDims, rank: int, transport: str) -> dict[int, Communicator]:
        """A second group over the ranks of each DP, EDP and world communicator (module docstring):
        ``id(communicator)`` -> its twin.  Collective: every rank creates every group, in the order ``dims``
        gives (as ``build_process_groups`` does)."""
        by_ranks: dict[tuple[int, ...], Communicator] = {}
        seen: set[tuple[int, ...]] = set()
        rank_sets = [list(range(dims.world_size))]
        if self.groups is not None:
            rank_sets += dims.groups("dp") + dims.groups("edp")
        for ranks in rank_sets:
            key = tuple(ranks)
            if key in seen or len(ranks) < 2:
                continue
            seen.add(key)
            group = dist.new_group(ranks=ranks, backend=group_backend())
            if rank in ranks:
                self._gather_groups.append(group)
                by_ranks[key] = Communicator.for_group(group, transport=transport)
        out = {}
        for comm in (self.world, self.dp, self.edp):
            ranks = tuple(dist.get_process_group_ranks(comm.group if comm.group is not None else dist.group.WORLD))
            if ranks in by_ranks:
                out[id(comm)] = by_ranks[ranks]
        return out

    @property
    def dp_size(self) -> int:
        return self.dims.dp

    @property
    def dp_rank(self) -> int:
        return self.coords.dp

    def domain_of(self, p: torch.Tensor) -> ReduceDomain:
        return self._domains[param_kind(p)]

    def slice_index_of(self, rank: int, splits) -> int:
        """Which EP/TP slice (canonical position) ``rank`` holds of a tensor cut by ``splits``."""
        c = self.dims.coords(rank)
        index = 0
        for s in splits:
            index = index * s.parts + (c.ep if s.axis == "ep" else c.tp)
        return index

    def first_holder(self, splits) -> bool:
        """Whether this rank is the lowest rank holding its slice (the one that saves a frozen slice)."""
        mine = self.slice_index_of(self.rank, splits)
        return next(r for r in range(self.dims.world_size) if self.slice_index_of(r, splits) == mine) == self.rank

    def destroy(self) -> None:
        for group in self._gather_groups:
            dist.destroy_process_group(group)
        self._gather_groups = []
        if self.groups is not None:
            destroy_process_groups(self.groups)
            self.groups = None
