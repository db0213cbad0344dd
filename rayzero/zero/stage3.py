"""ZeRO stage 3: parameters live only as fp32 shards in the master partition between uses.

Each module that directly owns partitioned parameters is a *unit*.  A unit's parameters are gathered (all-
gather of the ranks' shards, cast to the compute dtype on the way out) just before its forward and again
just before its backward, and released right after.  A released parameter's ``data`` is an empty
placeholder (any use outside its module's forward fails loudly instead of reading freed memory);
autograd saves parameters by reference, so re-pointing ``data`` before backward serves saved tensors too.  While one
unit runs, the next unit's gather is already in flight (forward order, recorded on the first forward, and
its reverse in backward).  Parameters at or under ``stage3_param_persistence_threshold`` elements stay
whole on every rank and are refreshed after each step like stage 1/2 weights.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch.utils._pytree import tree_flatten

from rayzero.comm import Handle
from rayzero.zero.partition import Partitions


@dataclass(eq=False)
class Unit:
    module: torch.nn.Module
    params: list[torch.nn.Parameter]
    index: int = -1  # position in the recorded forward order
    hooks: list = field(default_factory=list)


class ParamGatherer:
    def __init__(
        self,
        module: torch.nn.Module,
        partitions: Partitions,
        compute_dtype: torch.dtype,
        persistence_threshold: int,
        prefetch: bool = True,
    ):
        self.partitions = partitions
        self.compute_dtype = compute_dtype
        self.prefetch = prefetch
        params = partitions.all_params()
        self.persistent = {p for p in params if p.numel() <= persistence_threshold}
        self.managed = [p for p in params if p not in self.persistent]
        self.managed_set = set(self.managed)
        self._placeholder = torch.empty(0, dtype=compute_dtype, device=partitions.device)
        for p in self.managed:
            self._free(p)
        for p in self.persistent:
            p.data = p.data.to(compute_dtype)
        self.gathered: set[torch.nn.Parameter] = set()
        # unit id -> the unit's gathers in flight, one per partition group its parameters belong to
        self.inflight: dict[int, list[tuple[Handle, torch.Tensor, list, dict]]] = {}
        self.units: list[Unit] = []
        seen: set[torch.nn.Parameter] = set()
        for m in module.modules():
            own = [p for p in m._parameters.values() if p is not None and p in self.managed_set]
            own = list(dict.fromkeys(own))
            if own:
                seen.update(own)
                unit = Unit(m, own)
                unit.hooks.append(m.register_forward_pre_hook(self._make_pre_forward(unit)))
                unit.hooks.append(m.register_forward_hook(self._make_post_forward(unit)))
                self.units.append(unit)
        self.order: list[Unit] = []
        self.recording = True

    # ---- storage ---------------------------------------------------------------------------------------
    def _free(self, p: torch.nn.Parameter) -> None:
        p.data = self._placeholder

    # ---- gathering -------------------------------------------------------------------------------------
    def _launch(self, unit: Unit) -> None:
        members = [p for p in unit.params if p not in self.gathered]
        if not members or id(unit) in self.inflight:
            return
        # one gather per communicator: partition groups over the same ranks (a user's decay / no-decay
        # groups) share it
        by_comm: dict[int, tuple] = {}
        for p in members:
            g = self.partitions.group_of(self.partitions.entry_of[p])
            by_comm.setdefault(id(g.comm), (g, []))[1].append(p)
        launched = []
        for g, params in by_comm.values():
            col_of, cols = {}, 0
            for p in params:
                col_of[p] = cols
                cols += self.partitions.entry_of[p].chunk
            mine = torch.empty(cols, dtype=self.compute_dtype, device=self.partitions.device)
            for p in params:
                e = self.partitions.entry_of[p]
                mine[col_of[p] : col_of[p] + e.chunk].copy_(self.partitions.weight_shard(e))
            rows = torch.empty((g.world, cols), dtype=self.compute_dtype, device=self.partitions.device)
            launched.append((g.comm.all_gather(rows, mine), rows, params, col_of))
        self.inflight[id(unit)] = launched

    def _complete(self, unit: Unit) -> None:
        for handle, rows, members, col_of in self.inflight.pop(id(unit), []):
            handle.wait()
            world = rows.shape[0]
            for p in members:
                if p in self.gathered:  # gathered meanwhile through another unit that shares it
                    continue
                e = self.partitions.entry_of[p]
                padded = torch.empty((world, e.chunk), dtype=self.compute_dtype, device=self.partitions.device)
                padded.copy_(rows[:, col_of[p] : col_of[p] + e.chunk])
                p.data = padded.view(-1)[: e.numel].view(e.shape)
                self.gathered.add(p)

    @torch.no_grad()
    def gather(self, unit: Unit, prefetch_next: Unit | None = None) -> None:
        self._launch(unit)
        if prefetch_next is not None and self.prefetch:
            self._launch(prefetch_next)
        self._complete(unit)

    def release(self, params) -> None:
        for p in params:
            if p in self.gathered:
                self._free(p)
                self.gathered.discard(p)

    def release_all(self) -> None:
        """End of a backward (or of an aborted step): settle prefetches and free every gathered parameter."""
        for uid in list(self.inflight):
            for launched in self.inflight.pop(uid):
                launched[0].wait()
        self.release(list(self.gathered))

    def on_param_reduced(self, p: torch.nn.Parameter) -> None:
        # Its gradient is complete, so backward will not read this parameter again.
        if p in self.managed_set:
            self.release([p])

    # ---- hooks -----------------------------------------------------------------------------------------
    def _neighbour(self, unit: Unit, step: int) -> Unit | None:
        if self.recording or unit.index < 0:
            return None
        i = unit.index + step
        return self.order[i] if 0 <= i < len(self.order) else None

    def _make_pre_forward(self, unit: Unit):
        def hook(module, args):
            if self.recording and torch.is_grad_enabled() and unit.index < 0:
                unit.index = len(self.order)
                self.order.append(unit)
            self.gather(unit, self._neighbour(unit, +1))

        return hook

    def _make_post_forward(self, unit: Unit):
        def hook(module, args, output):
            self.release(unit.params)
            if torch.is_grad_enabled():
                tensors = [t for t in tree_flatten(output)[0] if isinstance(t, torch.Tensor) and t.requires_grad]
                if tensors:
                    torch.autograd.graph.register_multi_grad_hook(
                        tensors, lambda grads: self.gather(unit, self._neighbour(unit, -1)), mode="any"
                    )
            return None

        return hook

    def end_first_step(self) -> None:
        """The forward order seen so far is the order to prefetch in from now on."""
        if self.order:
            self.recording = False

    def remove_hooks(self) -> None:
        self.release_all()
        for u in self.units:
            for h in u.hooks:
                h.remove()
            u.hooks = []

    @torch.no_grad()
    def materialize_all(self) -> None:
        """Make every parameter whole again (used by destroy, so the model stays usable on its own)."""
        for p in self.managed:
            e = self.partitions.entry_of[p]
            full = self.partitions.gather_full(e).to(self.compute_dtype)
            p.data = full
        self.managed_set.clear()
        self.gathered.clear()
