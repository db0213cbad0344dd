"""ZeRO stage 3: parameters live only as fp32 shards in the master partition between uses.

Each module that directly owns partitioned parameters is a *unit*.  A unit's parameters are gathered (all-
gather of the ranks' shards, cast to the compute dtype on the way out) just before its forward and again
just before its backward, and released right after.  A released parameter's ``data`` is an empty
placeholder (any use outside its module's forward fails loudly instead of reading freed memory).

Each managed parameter owns one storage for its whole (padded) value, which is the only place it is ever
gathered into.  Releasing resizes that storage to 0 bytes; gathering resizes it back and fills it.  This
matters because autograd keeps *views* of parameters alive from forward to backward (``F.linear`` saves
``weight.t()``, a view of the gathered storage): were a release to only re-point ``param.data``, those
views would keep every gathered weight of the forward alive until backward, the whole model.  With the
storage emptied in place they hold nothing in between, and the backward's gather refills the very storage
they view.  The parameter itself never points at an emptied storage (its ``data`` is the placeholder
then), so a stray use raises instead of reading a null pointer.

While one unit runs, the next unit's gather is already in flight (forward order, recorded on the first
forward, and its reverse in backward).  Parameters at or under ``stage3_param_persistence_threshold``
elements stay whole on every rank and are refreshed after each step like stage 1/2 weights.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import torch
from torch.utils._pytree import tree_flatten

from rayzero.comm import Handle
from rayzero.offload.staging import HostStaging
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
        accelerator=None,
    ):
        self.partitions = partitions
        self.compute_dtype = compute_dtype
        self.prefetch = prefetch
        # host shards (offloaded masters and weights, swap reads) reach the device through one reusable
        # pinned buffer; shards already on the device in the compute dtype are sent as they are
        self.staging = HostStaging(partitions.device, compute_dtype, accelerator)
        params = partitions.all_params()
        # by the layout's element count: a parameter built under zero_init has no storage of its own yet
        self.persistent = {p for p in params if partitions.entry_of[p].numel <= persistence_threshold}
        self.managed = [p for p in params if p not in self.persistent]
        self.managed_set = set(self.managed)
        self._placeholder = torch.empty(0, dtype=compute_dtype, device=partitions.device)
        # each managed parameter's whole padded value lives here while it is gathered; 0 bytes otherwise
        self._storage: dict[torch.nn.Parameter, torch.UntypedStorage] = {
            p: torch.empty(0, dtype=compute_dtype, device=partitions.device).untyped_storage() for p in self.managed
        }
        for p in self.managed:
            self._free(p)
        for p in self.persistent:
            p.data = p.data.to(compute_dtype)
        self.gathered: set[torch.nn.Parameter] = set()
        # unit id -> the unit's gathers in flight, one per partition group its parameters belong to
        self.inflight: dict[int, list[tuple[Handle, torch.Tensor, list, dict | None]]] = {}
        self.units: list[Unit] = []
        units_of: dict[torch.nn.Parameter, int] = {}
        for m in module.modules():
            own = [p for p in m._parameters.values() if p is not None and p in self.managed_set]
            own = list(dict.fromkeys(own))
            if own:
                for p in own:
                    units_of[p] = units_of.get(p, 0) + 1
                unit = Unit(m, own)
                unit.hooks.append(m.register_forward_pre_hook(self._make_pre_forward(unit)))
                unit.hooks.append(m.register_forward_hook(self._make_post_forward(unit)))
                self.units.append(unit)
        # a parameter of one unit only may be all-gathered straight into its own storage; one shared by
        # several units (tied weights) could be in flight for two of them at once, so it goes through a
        # unit's own receive buffer
        self._shared = {p for p, n in units_of.items() if n > 1}
        self.order: list[Unit] = []
        self.recording = True

    # ---- storage ---------------------------------------------------------------------------------------
    def _whole(self, p: torch.nn.Parameter) -> torch.Tensor:
        """``p``'s padded storage, allocated, as a ``(world, chunk)`` tensor of the compute dtype."""
        e = self.partitions.entry_of[p]
        world = self.partitions.group_of(e).world
        storage = self._storage[p]
        nbytes = world * e.chunk * self._placeholder.element_size()
        if storage.nbytes() != nbytes:
            storage.resize_(nbytes)
        out = torch.empty(0, dtype=self.compute_dtype, device=self.partitions.device)
        return out.set_(storage, 0, (world, e.chunk))

    def _free(self, p: torch.nn.Parameter) -> None:
        p.data = self._placeholder
        # views autograd saved during a forward share this storage: emptying it frees them too
        self._storage[p].resize_(0)

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
        # parameter offload to NVMe: start reading every shard of the unit at once
        self.partitions.prefetch_weights([self.partitions.entry_of[p] for p in members])
        launched = []
        for g, params in by_comm.values():
            if len(params) == 1 and params[0] not in self._shared:
                # straight into the parameter's own storage: no receive buffer, no copy
                p = params[0]
                # (the shard itself when it is already in the compute dtype and device: no copy)
                mine = self.staging.to_device(self.partitions.weight_shard(self.partitions.entry_of[p]))
                rows = self._whole(p)
                launched.append((g.comm.all_gather(rows, mine), rows, params, None))
                continue
            col_of, cols = {}, 0
            for p in params:
                col_of[p] = cols
                cols += self.partitions.entry_of[p].chunk
            # packed side by side (host shards: in the staging buffer, then one copy to the device)
            mine = self.staging.pack([self.partitions.weight_shard(self.partitions.entry_of[p]) for p in params])
            rows = torch.empty((g.world, cols), dtype=self.compute_dtype, device=self.partitions.device)
            launched.append((g.comm.all_gather(rows, mine), rows, params, col_of))
        self.inflight[id(unit)] = launched

    def _complete(self, unit: Unit) -> None:
        for handle, rows, members, col_of in self.inflight.pop(id(unit), []):
            handle.wait()
            for p in members:
                if p in self.gathered:  # gathered meanwhile through another unit that shares it
                    continue
                e = self.partitions.entry_of[p]
                if col_of is None:
                    whole = rows
                else:
                    whole = self._whole(p)
                    whole.copy_(rows[:, col_of[p] : col_of[p] + e.chunk])
                p.data = whole.view(-1)[: e.numel].view(e.shape)
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
            for handle, _, members, col_of in self.inflight.pop(uid):
                handle.wait()
                if col_of is None:  # received straight into a parameter's storage that was never used
                    for p in members:
                        if p not in self.gathered:
                            self._free(p)
        # the step may rewrite host partitions next: no copy to the device may still read them
        self.staging.synchronize()
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

    def close(self) -> None:
        """Engine.destroy(): remove the hooks and free every managed parameter for good, without gathering.

        Each managed parameter is left as a one-element NaN stand-in expanded to its shape (so
        ``model.load_state_dict(state, assign=True)`` and ``model.to_empty(...)`` still see the right
        shapes, and a stray read gives NaN rather than plausible numbers), and each unit gets a forward
        pre-hook that says what happened if the model is run while any of them is still a stand-in.
        """
        self.remove_hooks()
        for p in self.managed:
            self._free(p)
        self._storage.clear()
        stand_in = torch.full((1,), float("nan"), dtype=self.compute_dtype, device=self.partitions.device)
        for p in self.managed:
            p.data = stand_in.expand(self.partitions.entry_of[p].shape)
            p._rayzero_destroyed = True
        for u in self.units:
            handle: list = []
            handle.append(u.module.register_forward_pre_hook(functools.partial(_destroyed_guard, handle)))
        self.units = []
        self.order = []
        self.managed_set.clear()
        self.gathered.clear()


def freed_by_destroy(p: torch.Tensor) -> bool:
    """Whether ``p`` is still the stand-in a stage-3 ``Engine.destroy()`` left (not yet loaded or replaced)."""
    return getattr(p, "_rayzero_destroyed", False) and p.untyped_storage().nbytes() < p.numel() * p.element_size()


def _destroyed_guard(handle: list, module: torch.nn.Module, args) -> None:
    # a plain function: the destroyed engine must stay collectable
    freed = [n for n, p in module._parameters.items() if p is not None and freed_by_destroy(p)]
    if not freed:  # the freed parameters were replaced: the module works again
        handle[0].remove()
        return
    raise RuntimeError(
        f"the parameters {freed} of this {type(module).__name__} were freed by Engine.destroy(): at ZeRO "
        "stage 3 an engine's parameters live only as shards in its partitions, and destroy() does not "
        "gather them back. Before destroy(), take the weights with engine.full_state_dict() (or stream "
        "them with rayzero.zero.export.iter_full_state_dict, or save a checkpoint), then load them into "
        "this model with model.load_state_dict(state, assign=True) or into a fresh one"
    )
