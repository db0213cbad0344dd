"""A rank's partitions: fp32 master weights and fp32 gradient partitions, one pair per optimizer param group."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from rayzero.comm import Communicator
from rayzero.zero.layout import GroupLayout, ParamEntry, copy_from_rows, shard_of


@dataclass
class GroupPartition:
    layout: GroupLayout
    params: list[torch.nn.Parameter]
    master: torch.Tensor  # fp32 [partition_numel]: the optimizer steps this tensor
    grad: torch.Tensor  # fp32 [partition_numel]: gradients accumulate here until the boundary
    overrides: dict = field(default_factory=dict)  # the user's per-group hyper-parameters


class Partitions:
    """Owns the fp32 master and gradient partitions of every param group, and maps params to entries."""

    def __init__(
        self,
        param_groups: list[dict],
        names: dict[torch.nn.Parameter, str],
        comm: Communicator,
        partitioned: bool,
        device: torch.device | None = None,
    ):
        self.comm = comm
        # Partitions live where the model computes (the accelerator), masters included.
        self.device = device if device is not None else torch.device("cpu")
        # Stage 0 lays every group out over a world of one: the rank owns the whole group.
        self.world = comm.world if partitioned else 1
        self.rank = comm.rank if partitioned else 0
        self.partitioned = partitioned
        self.groups: list[GroupPartition] = []
        self.entry_of: dict[torch.nn.Parameter, ParamEntry] = {}
        for gi, group in enumerate(param_groups):
            params = list(group["params"])
            layout = GroupLayout.build(gi, [(names[p], p) for p in params], self.world)
            master = torch.zeros(layout.partition_numel, dtype=torch.float32, device=self.device)
            grad = torch.zeros(layout.partition_numel, dtype=torch.float32, device=self.device)
            overrides = {k: v for k, v in group.items() if k != "params"}
            self.groups.append(GroupPartition(layout, params, master, grad, overrides))
            for p, e in zip(params, layout.entries):
                self.entry_of[p] = e

    def all_params(self) -> list[torch.nn.Parameter]:
        return [p for g in self.groups for p in g.params]

    def group_of(self, entry: ParamEntry) -> GroupPartition:
        return self.groups[entry.group_index]

    def master_shard(self, entry: ParamEntry) -> torch.Tensor:
        return self.group_of(entry).master[entry.partition_offset : entry.partition_offset + entry.chunk]

    def grad_shard(self, entry: ParamEntry) -> torch.Tensor:
        return self.group_of(entry).grad[entry.partition_offset : entry.partition_offset + entry.chunk]

    @torch.no_grad()
    def load_masters_from_params(self) -> None:
        """Fill the fp32 masters from the parameters' current values (or their zero_init shards)."""
        for g in self.groups:
            for p, e in zip(g.params, g.layout.entries):
                out = g.master[e.partition_offset : e.partition_offset + e.chunk]
                pre_sharded = getattr(p, "_rayzero_shard", None)
                if pre_sharded is not None:
                    if pre_sharded.numel() != e.chunk:
                        raise RuntimeError(
                            f"parameter {e.name!r} was sharded by rayzero.zero_init for a world of a "
                            f"different size (shard of {pre_sharded.numel()} elements, expected {e.chunk}); "
                            "build the model under zero_init in the same process group it trains in"
                        )
                    out.copy_(pre_sharded)
                else:
                    shard_of(p.detach().reshape(-1).float(), e, self.rank, out)

    def zero_grads(self) -> None:
        for g in self.groups:
            g.grad.zero_()

    def local_grad_sq_sum(self) -> torch.Tensor:
        """Sum of squares of this rank's gradient partitions, in fp32."""
        total = torch.zeros((), dtype=torch.float32, device=self.device)
        for g in self.groups:
            if g.grad.numel():
                total += torch.dot(g.grad, g.grad)
        return total

    @torch.no_grad()
    def gather_full(self, entry: ParamEntry, source: str = "master") -> torch.Tensor:
        """The whole fp32 value of one parameter (``source``: 'master' or 'grad'), on every rank."""
        shard = self.master_shard(entry) if source == "master" else self.grad_shard(entry)
        if self.world == 1:
            return shard[: entry.numel].clone().view(entry.shape)
        rows = torch.empty((self.world, entry.chunk), dtype=torch.float32, device=self.device)
        self.comm.all_gather(rows, shard.contiguous()).wait()
        flat = torch.empty(entry.numel, dtype=torch.float32, device=self.device)
        copy_from_rows(flat, rows, 0, entry.chunk)
        return flat.view(entry.shape)
