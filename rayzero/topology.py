"""Parallel layout: degrees -> rank lists -> process groups. The one source of truth.

Ranks are laid out with tensor parallelism fastest-varying, so a TP group is a
block of consecutive ranks (on one node when ``tp`` <= GPUs per node, where its
heavy traffic belongs), then data parallelism::

    rank = dp_index * tp + tp_index

Data parallelism is split further for mixture-of-experts: the ``dp`` replicas of
each TP shard form ``edp`` consecutive blocks of ``ep`` replicas. Inside a block
(an *expert-parallel* group) each replica holds different experts; replicas at
the same position of different blocks (an *expert-data-parallel* group, stride
``ep``) hold the same experts and average their gradients.

Every rank's index inside each of its groups equals its coordinate, which is
what :meth:`ParallelDims.coords` returns.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

import torch.distributed as dist

GROUP_KINDS: tuple[str, ...] = ("tp", "dp", "ep", "edp")


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _format_divisors(n: int) -> str:
    return ", ".join(str(d) for d in _divisors(n))


class RankCoords(NamedTuple):
    """A rank's index inside each of its groups (equal to its group rank there)."""

    dp: int
    tp: int
    ep: int
    edp: int


class GroupRanks(NamedTuple):
    """The global ranks of each group containing one rank."""

    dp: list[int]
    tp: list[int]
    ep: list[int]
    edp: list[int]


@dataclass(frozen=True)
class ParallelDims:
    """Parallel degrees for ``world_size`` ranks.

    ``tp`` is the tensor-parallel degree and ``ep`` the expert-parallel degree;
    derived are ``dp = world_size // tp`` (dense data-parallel) and
    ``edp = dp // ep`` (expert-data-parallel).
    """

    world_size: int
    tp: int = 1
    ep: int = 1
    dp: int = field(init=False)
    edp: int = field(init=False)

    def __post_init__(self) -> None:
        for label, value in (("world_size", self.world_size), ("tp", self.tp), ("ep", self.ep)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{label} must be an int >= 1, got {value!r}")
        if self.world_size % self.tp != 0:
            raise ValueError(
                f"tp={self.tp} does not divide world_size={self.world_size}; "
                f"valid tp for world_size={self.world_size}: {_format_divisors(self.world_size)}"
            )
        dp = self.world_size // self.tp
        if dp % self.ep != 0:
            raise ValueError(
                f"ep={self.ep} does not divide dp={dp} (world_size={self.world_size} // tp={self.tp}); "
                f"valid ep for dp={dp}: {_format_divisors(dp)}"
                + ("" if self.tp == 1 else ", or change tp so that world_size // tp is a multiple of ep")
            )
        # frozen dataclass: derived fields are set once here.
        object.__setattr__(self, "dp", dp)
        object.__setattr__(self, "edp", dp // self.ep)

    # ---- rank arithmetic ------------------------------------------------------------

    def rank_of(self, dp_index: int, tp_index: int) -> int:
        """Global rank at data-parallel index ``dp_index`` and tensor-parallel index ``tp_index``."""
        return dp_index * self.tp + tp_index

    def _check_rank(self, rank: int) -> None:
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < self.world_size:
            raise ValueError(
                f"rank {rank!r} is outside world_size={self.world_size}; use 0..{self.world_size - 1}"
            )

    def coords(self, rank: int) -> RankCoords:
        """``rank``'s index inside its dp, tp, ep and edp groups."""
        self._check_rank(rank)
        dp_index, tp_index = divmod(rank, self.tp)
        edp_index, ep_index = divmod(dp_index, self.ep)
        return RankCoords(dp=dp_index, tp=tp_index, ep=ep_index, edp=edp_index)

    # ---- group rank lists (each sorted; lists ordered by their first rank) ------------

    def tp_groups(self) -> list[list[int]]:
        """Consecutive blocks of ``tp`` ranks."""
        return [[self.rank_of(d, t) for t in range(self.tp)] for d in range(self.dp)]

    def dp_groups(self) -> list[list[int]]:
        """Ranks sharing a TP index (stride ``tp``)."""
        return [[self.rank_of(d, t) for d in range(self.dp)] for t in range(self.tp)]

    def ep_groups(self) -> list[list[int]]:
        """Within each TP index, consecutive blocks of ``ep`` DP indices."""
        groups = [
            [self.rank_of(block * self.ep + e, t) for e in range(self.ep)]
            for t in range(self.tp)
            for block in range(self.edp)
        ]
        return sorted(groups)

    def edp_groups(self) -> list[list[int]]:
        """Within each TP index, DP indices at the same position of their EP block (stride ``ep``)."""
        groups = [
            [self.rank_of(block * self.ep + e, t) for block in range(self.edp)]
            for t in range(self.tp)
            for e in range(self.ep)
        ]
        return sorted(groups)

    def groups(self, kind: str) -> list[list[int]]:
        """Rank lists of one kind: "tp", "dp", "ep" or "edp"."""
        if kind not in GROUP_KINDS:
            raise ValueError(f"unknown group kind {kind!r}; use one of {', '.join(GROUP_KINDS)}")
        return getattr(self, f"{kind}_groups")()

    def groups_of(self, rank: int) -> GroupRanks:
        """The dp, tp, ep and edp rank lists that contain ``rank``."""
        c = self.coords(rank)
        dp_index, tp_index = c.dp, c.tp
        block_start = c.edp * self.ep
        return GroupRanks(
            dp=[self.rank_of(d, tp_index) for d in range(self.dp)],
            tp=[self.rank_of(dp_index, t) for t in range(self.tp)],
            ep=[self.rank_of(block_start + e, tp_index) for e in range(self.ep)],
            edp=[self.rank_of(b * self.ep + c.ep, tp_index) for b in range(self.edp)],
        )


@dataclass
class ProcessGroups:
    """This rank's process group of each kind, with the global ranks it contains.

    Groups with identical rank lists share one ``ProcessGroup`` object (e.g. edp and
    dp when ``ep`` == 1), and a group spanning the whole world is ``dist.group.WORLD``.
    """

    dims: ParallelDims
    dp: dist.ProcessGroup
    tp: dist.ProcessGroup
    ep: dist.ProcessGroup
    edp: dist.ProcessGroup
    dp_ranks: list[int]
    tp_ranks: list[int]
    ep_ranks: list[int]
    edp_ranks: list[int]
    # Every group this call created with dist.new_group that this rank belongs to.
    created: list[dist.ProcessGroup] = field(default_factory=list, repr=False)


def build_process_groups(
    dims: ParallelDims, rank: int, *, backend: str | None = None
) -> ProcessGroups:
    """Create the dp/tp/ep/edp process groups; every rank must call this, with the same ``dims``.

    ``torch.distributed.new_group`` is collective over the whole world: all ranks
    must create every group in the same order, including groups they are not in.
    The order here depends only on ``dims``, so that holds.
    """
    if not dist.is_initialized():
        raise RuntimeError(
            "build_process_groups needs torch.distributed initialised; "
            "call torch.distributed.init_process_group first"
        )
    world_size = dist.get_world_size()
    if world_size != dims.world_size:
        raise ValueError(
            f"ParallelDims.world_size={dims.world_size} but torch.distributed has "
            f"world_size={world_size}; build ParallelDims(world_size={world_size}, ...)"
        )
    actual_rank = dist.get_rank()
    if rank != actual_rank:
        raise ValueError(
            f"rank={rank} but torch.distributed reports rank {actual_rank}; pass dist.get_rank()"
        )

    from rayzero.comm import group_backend, world_group

    # groups that carry the accelerator's tensors even where the default group cannot (rayzero/comm)
    world = world_group() or dist.group.WORLD
    backend = backend or group_backend()
    by_ranks: dict[tuple[int, ...], dist.ProcessGroup] = {}
    created: list[dist.ProcessGroup] = []
    mine = dims.groups_of(rank)
    for kind in GROUP_KINDS:
        for ranks in dims.groups(kind):
            key = tuple(ranks)
            if key in by_ranks or len(ranks) == world_size:
                continue
            group = dist.new_group(ranks=ranks, backend=backend)
            # Non-members get a sentinel back; only real handles are kept.
            if rank in ranks:
                by_ranks[key] = group
                created.append(group)
            else:
                by_ranks[key] = dist.GroupMember.NON_GROUP_MEMBER

    def handle(ranks: list[int]) -> dist.ProcessGroup:
        return world if len(ranks) == world_size else by_ranks[tuple(ranks)]

    return ProcessGroups(
        dims=dims,
        dp=handle(mine.dp),
        tp=handle(mine.tp),
        ep=handle(mine.ep),
        edp=handle(mine.edp),
        dp_ranks=mine.dp,
        tp_ranks=mine.tp,
        ep_ranks=mine.ep,
        edp_ranks=mine.edp,
        created=created,
    )


def destroy_process_groups(groups: ProcessGroups) -> None:
    """Destroy the groups :func:`build_process_groups` created (never ``WORLD``)."""
    for group in groups.created:
        if group is not dist.group.WORLD:
            dist.destroy_process_group(group)
    groups.created.clear()
