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
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from rayzero.comm import Communicator
from rayzero.config import ConfigError
from rayzero.topology import ParallelDims, ProcessGroups, build_process_groups, destroy_process_groups


@dataclass(frozen=True, eq=False)
class ReduceDomain:
    kind: str  # "dense", "dense_tp", "dense_partial", "expert", "expert_tp"
    comm: Communicator  # the ranks this domain's gradients are summed over and its partitions split over
    primary: bool  # this rank holds the canonical copy of the domain's elements (TP replicas count once)


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
        self._domains = {
            "dense": ReduceDomain("dense", self.dp, self.coords.tp == 0),
            "dense_tp": ReduceDomain("dense_tp", self.dp, True),
            "dense_partial": ReduceDomain("dense_partial", self.world, True),
            "expert": ReduceDomain("expert", self.edp, self.coords.tp == 0),
            "expert_tp": ReduceDomain("expert_tp", self.edp, True),
        }

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
        if self.groups is not None:
            destroy_process_groups(self.groups)
            self.groups = None
