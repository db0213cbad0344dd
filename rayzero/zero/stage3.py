"""ZeRO stage 3: parameters live only as fp32 shards in the master partition between uses.

Parameters are gathered per *unit* (``zero_optimization.stage3_gather_unit``): by default the model's
repeated block (a module the user marked with :func:`mark_gather_unit`, else HF's ``_no_split_modules``,
else the module class that repeats over most of the model: ``buckets.repeated_block``), so one
transformer layer is one gather, and each module outside every block that directly owns partitioned
parameters is a unit of its own (``"module"``: every such module is a unit, one leaf at a time; with
parameters on NVMe ``"auto"`` cuts leaf units too unless blocks are marked, :func:`auto_units_are_blocks`).
A unit's parameters are gathered (all-gather of the ranks' shards, cast to the compute dtype on the way out)
just before its forward and again just before its backward, and released right after.  A released
parameter's ``data`` is an empty placeholder (any use outside its unit's forward fails loudly instead of
reading freed memory).

Each managed parameter owns one storage for its whole (padded) value, which is the only place it is ever
gathered into.  Releasing resizes that storage to 0 bytes; gathering resizes it back and fills it.  This
matters because autograd keeps *views* of parameters alive from forward to backward (``F.linear`` saves
``weight.t()``, a view of the gathered storage): were a release to only re-point ``param.data``, those
views would keep every gathered weight of the forward alive until backward, the whole model.  With the
storage emptied in place they hold nothing in between, and the backward's gather refills the very storage
they view.  The parameter itself never points at an emptied storage (its ``data`` is the placeholder
then), so a stray use raises instead of reading a null pointer.

While one unit runs, the gathers of the units after it are already in flight (forward order, recorded on
the first forward, and its reverse in backward): as many units ahead as fit in ``stage3_prefetch_bucket_size``
elements, and always the next one (with parameters on NVMe their shards' disk reads, and the next unit's,
start before any of these gathers waits on one).  A unit gathered ahead that the pass then goes past
without using (a forward that skipped it) is released as soon as the pass is beyond it.  The last units
of a forward, as many as fit in the same budget, stay gathered for the backward that starts with them; a
unit run again inside backward (a checkpointed block's recompute, where units are smaller than the block)
gathers nothing ahead and stays gathered for its own backward, which follows at once.  Parameters at or
under ``stage3_param_persistence_threshold`` elements stay whole on every rank and are refreshed after
each step like stage 1/2 weights.

Where every rank of a communicator runs on one host, its ranks may instead keep one copy of the weights
they all map (``zero_optimization.stage3_share_weights``; zero/publish.py): each rank's part of it is its
own shards, so it still holds 1/W of the weights, and nothing is gathered.  The engine hands the
parameters it shared to :meth:`ParamGatherer.adopt`: they are whole for good, and a unit left without
parameters loses its hooks.  Unset, the key shares where that costs no more memory than gathering
(:meth:`ParamGatherer.sharing_costs_no_more`).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import torch
from torch.utils._pytree import tree_flatten

from rayzero.comm import Handle
from rayzero.offload.staging import HostStaging
from rayzero.zero.partition import Partitions


GATHER_UNIT_ATTR = "_rayzero_gather_unit"
# a parameter of at least this many (padded) elements is gathered on its own, straight into its storage;
# smaller ones of a unit share one packed gather (one collective's latency for all of them)
DIRECT_GATHER_NUMEL = 1 << 18


def _in_backward() -> bool:
    """Whether autograd's engine is running a backward on this thread (a checkpointed block's recompute)."""
    return torch._C._current_graph_task_id() != -1


def mark_gather_unit(*modules: torch.nn.Module) -> None:
    """Make each of ``modules`` one stage-3 gather unit: all partitioned parameters under it are gathered
    together before its forward (and its backward) and released after.  Marks win over every other rule of
    ``stage3_gather_unit: "auto"``."""
    for m in modules:
        setattr(m, GATHER_UNIT_ATTR, True)


def auto_units_are_blocks(zero) -> bool:
    """Whether ``stage3_gather_unit: "auto"`` finds the model's repeated block for ``zero`` (the config's
    ``zero_optimization``).  Not with parameters on NVMe: there each gather reads its unit's shards from the
    disk, so the step waits on the disk however the units are cut, and what the rank holds at once (the
    running unit and those gathered ahead) is the point of the config.  Leaf units hold a fraction of a
    block's (bench/README.md, "Leaf units with parameters on NVMe"); modules the user marked still win."""
    return zero.offload_param.device != "nvme"


def unit_modules(model: torch.nn.Module, rule, numel, blocks: bool = True) -> list[torch.nn.Module]:
    """The modules whose whole subtree is one gather unit under ``rule`` (outermost first; see the module
    docstring): ``"auto"``, ``"module"`` or class names separated by commas.  ``blocks`` False
    (:func:`auto_units_are_blocks`): ``"auto"`` takes the marked modules only, else every module is a
    unit of its own, as ``"module"``."""
    if rule == "module":
        return []
    if rule == "auto":
        marked = [m for m in model.modules() if getattr(m, GATHER_UNIT_ATTR, False)]
        if marked:
            return _outermost(model, lambda m: getattr(m, GATHER_UNIT_ATTR, False))
        if not blocks:
            return []
        from rayzero.zero.buckets import repeated_block

        block = repeated_block(model, numel, containers_only=True)
        if block is None:
            return []
        names = {block[0]}
    else:
        names = {c.strip() for c in rule.split(",")}
        present = {type(m).__name__ for m in model.modules()}
        if not names & present:
            from rayzero.config import ConfigError

            raise ConfigError(
                f"config key 'zero_optimization.stage3_gather_unit' = {rule!r} names no module of this model "
                f"(its module classes: {', '.join(sorted(present))}); name the model's repeated block, or "
                'write "auto"'
            )
    return _outermost(model, lambda m: m is not model and type(m).__name__ in names)


def _outermost(model: torch.nn.Module, chosen) -> list[torch.nn.Module]:
    out: list[torch.nn.Module] = []

    def walk(m: torch.nn.Module) -> None:
        if chosen(m):
            out.append(m)
            return
        for child in m.children():
            walk(child)

    walk(model)
    return out


# Tensor methods that read only a released parameter's metadata, or register hooks on it: allowed.  Every
# other torch call on it (a read of its values) raises ``ReleasedParameterError``.
_METADATA_CALLS = frozenset({
    "size", "dim", "ndimension", "numel", "nelement", "element_size", "is_floating_point", "is_complex",
    "data_ptr", "untyped_storage", "_typed_storage", "storage_offset", "is_contiguous", "stride", "get_device",
    "is_pinned", "_is_view", "register_hook", "register_post_accumulate_grad_hook", "requires_grad_",
    "__hash__", "__reduce_ex__", "__deepcopy__", "__setstate__",
})


# Tensor attributes that are views of a released parameter's values (every other attribute reads metadata)
_VALUE_ATTRIBUTES = frozenset({"T", "mT", "H", "mH", "real", "imag"})


class ReleasedParameterError(RuntimeError):
    """A ZeRO stage-3 parameter's values were read where it is not gathered (outside its module's forward)."""


class ReleasedParameter(torch.nn.Parameter):
    """The class a managed stage-3 parameter has while it is released (its ``data`` an empty placeholder):
    a torch call that reads its values raises ``ReleasedParameterError`` naming the parameter and the fix,
    instead of computing on the empty tensor.  Gathering gives the parameter back its own class, so
    nothing of this runs inside a forward or backward; attribute access (``.data``, ``.grad``,
    ``.shape``, ...) and the metadata calls above always work."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if name == "__get__":  # an attribute: metadata, except the few that are views of the values
            attr = getattr(getattr(func, "__self__", None), "__name__", "")
            if attr in _VALUE_ATTRIBUTES:
                name = f".{attr}"
        if name in ("__get__", "__set__", "__delete__") or name in _METADATA_CALLS:
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **(kwargs or {}))
        released = [a for a in tree_flatten((args, kwargs or {}))[0] if isinstance(a, ReleasedParameter)]
        raise ReleasedParameterError(_released_message(released[0] if released else None, name))

    def __repr__(self) -> str:
        return (f"<ZeRO stage 3 parameter {getattr(self, '_rayzero_name', '?')!r} of shape "
                f"{tuple(getattr(self, '_rayzero_shape', ()))}, partitioned: not gathered here>")


def _released_message(p, call: str) -> str:
    name = getattr(p, "_rayzero_name", "?")
    shape = tuple(getattr(p, "_rayzero_shape", ()))
    what = call if call.startswith(".") else f"{call}()"  # an attribute (".T") or a call ("sum()")
    return (
        f"{what} read ZeRO stage 3 parameter {name!r} (shape {shape}) where it is not gathered: outside the "
        "forward of its module, each rank holds only its shard and the parameter's data is an empty "
        "placeholder. Read it inside `with rayzero.deepspeed.zero.GatheredParameters(param):` (with "
        "modifier_rank=R to change it), or take the whole weights with engine.full_state_dict()"
    )


def _mark_released(p: torch.nn.Parameter) -> None:
    if type(p) is torch.nn.Parameter:  # (a parameter subclass of the user's keeps its class)
        p.__class__ = ReleasedParameter


def _mark_gathered(p: torch.nn.Parameter) -> None:
    if type(p) is ReleasedParameter:
        p.__class__ = torch.nn.Parameter


@dataclass(eq=False)
class Unit:
    module: torch.nn.Module
    params: list[torch.nn.Parameter]
    numel: int = 0  # elements gathered (the sum of the parameters' padded sizes)
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
        unit_rule="module",
        prefetch_elements: int | None = None,
        auto_blocks: bool = True,
    ):
        self.partitions = partitions
        self.compute_dtype = compute_dtype
        self.prefetch = prefetch
        self.unused_prefetches = 0  # units gathered ahead that the pass went past without using
        self.max_ahead = 0  # the most units in flight ahead of the running one (for tests and the bench)
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
            p._rayzero_name, p._rayzero_shape = partitions.entry_of[p].name, partitions.entry_of[p].shape
            self._free(p)
        for p in self.persistent:
            p.data = p.data.to(compute_dtype)
        self.gathered: set[torch.nn.Parameter] = set()
        # unit id -> the unit's gathers in flight, one per partition group its parameters belong to
        self.inflight: dict[int, list[tuple[Handle, torch.Tensor, list, dict | None]]] = {}
        self.units: list[Unit] = []
        units_of: dict[torch.nn.Parameter, int] = {}
        blocks = unit_modules(module, unit_rule, lambda p: partitions.entry_of[p].numel
                              if p in partitions.entry_of else p.numel(), auto_blocks)
        in_block = {id(sub) for b in blocks for sub in b.modules()}
        owners = [(b, b.parameters()) for b in blocks]
        owners += [(m, m._parameters.values()) for m in module.modules() if id(m) not in in_block]
        for m, params_of in owners:
            own = list(dict.fromkeys(p for p in params_of if p is not None and p in self.managed_set))
            if own:
                for p in own:
                    units_of[p] = units_of.get(p, 0) + 1
                unit = Unit(m, own, sum(partitions.entry_of[p].padded_numel for p in own))
                unit.hooks.append(m.register_forward_pre_hook(self._make_pre_forward(unit)))
                unit.hooks.append(m.register_forward_hook(self._make_post_forward(unit)))
                self.units.append(unit)
        # how far ahead to gather: units while their elements fit (None: two of the largest units)
        largest = max((u.numel for u in self.units), default=0)
        self._derived_prefetch = prefetch_elements is None
        self.prefetch_elements = 2 * largest if prefetch_elements is None else prefetch_elements
        self.ahead: dict[int, Unit] = {}  # units gathered ahead, not used yet
        self.kept_for_backward: set[int] = set()  # units a forward leaves gathered (end_first_step)
        # a parameter of one unit only may be all-gathered straight into its own storage; one shared by
        # several units (tied weights) could be in flight for two of them at once, so it goes through a
        # unit's own receive buffer
        self._shared = {p for p, n in units_of.items() if n > 1}
        self.order: list[Unit] = []
        self.recording = True
        # parameters whose one host copy every rank maps (``adopt``): whole for good, never gathered
        self.shared: set[torch.nn.Parameter] = set()
        self.dropped_units: list[Unit] = []  # units whose parameters are all shared (destroy still guards them)

    def sharing_costs_no_more(self, compute_dtype: torch.dtype) -> bool:
        """Whether a rank's part of one host copy of the weights (its shards, in the compute dtype) takes no
        more memory than gathering would: in bf16/fp16 it replaces the compute-dtype weight partition the
        gathers read, byte for byte; in fp32 (whose gathers read the masters) it must fit in what the
        gathers hold at once, the largest unit and the prefetch budget."""
        if compute_dtype != torch.float32:
            return True
        mine = sum(self.partitions.entry_of[p].chunk for p in self.managed)
        return mine <= max((u.numel for u in self.units), default=0) + self.prefetch_elements

    def adopt(self, params) -> None:
        """``params`` are whole for good now (views of the weights the ranks of a host share,
        zero/publish.py): they leave the managed set, units lose them, and a unit left with none stops
        gathering (its hooks go)."""
        params = [p for p in params if p in self.managed_set]
        if not params:
            return
        for p in params:
            _mark_gathered(p)
        gone = set(params)
        self.shared |= gone
        self.managed = [p for p in self.managed if p not in gone]
        self.managed_set -= gone
        for p in gone:
            self._storage.pop(p, None)
        kept = []
        for u in self.units:
            u.params = [p for p in u.params if p not in gone]
            u.numel = sum(self.partitions.entry_of[p].padded_numel for p in u.params)
            if u.params:
                kept.append(u)
            else:
                for h in u.hooks:
                    h.remove()
                u.hooks = []
                self.dropped_units.append(u)
        self.units = kept
        self._shared -= gone
        if self._derived_prefetch:
            self.prefetch_elements = 2 * max((u.numel for u in self.units), default=0)

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
        _mark_released(p)
        p.data = self._placeholder
        # views autograd saved during a forward share this storage: emptying it frees them too
        self._storage[p].resize_(0)

    # ---- gathering -------------------------------------------------------------------------------------
    def _launch(self, unit: Unit) -> bool:
        """Start gathering ``unit``'s parameters that are not gathered yet; False when there is nothing to start."""
        members = [p for p in unit.params if p not in self.gathered]
        if not members or id(unit) in self.inflight:
            return False
        # one gather per communicator: partition groups over the same ranks (a user's decay / no-decay
        # groups) share it
        by_comm: dict[int, tuple] = {}
        for p in members:
            g = self.partitions.group_of(self.partitions.entry_of[p])
            # on a device backend a second group of the same ranks, so gathers do not queue behind the
            # reduce-scatters (parallel/state.py)
            comm = g.domain.param_gather_comm
            by_comm.setdefault(id(comm), (comm, g, []))[2].append(p)
        # parameter offload to NVMe: start reading every shard of the unit at once
        self.partitions.prefetch_weights([self.partitions.entry_of[p] for p in members])
        launched = []
        for comm, g, params in by_comm.values():
            # large parameters of this unit alone go straight into their own storage (no receive buffer,
            # no copy); the small ones, and any shared with another unit, are packed into one gather
            direct = [p for p in params if p not in self._shared
                      and (len(params) == 1 or self.partitions.entry_of[p].padded_numel >= DIRECT_GATHER_NUMEL)]
            for p in direct:
                # (the shard itself when it is already in the compute dtype and device: no copy)
                mine = self.staging.to_device(self.partitions.weight_shard(self.partitions.entry_of[p]))
                rows = self._whole(p)
                launched.append((comm.all_gather(rows, mine), rows, [p], None))
            direct_ids = {id(p) for p in direct}
            params = [p for p in params if id(p) not in direct_ids]
            if not params:
                continue
            col_of, cols = {}, 0
            for p in params:
                col_of[p] = cols
                cols += self.partitions.entry_of[p].chunk
            shards = [self.partitions.weight_shard(self.partitions.entry_of[p]) for p in params]
            # shards side by side in the partition already (a unit's parameters usually are) are sent from
            # there; others are packed (host shards: in the staging buffer, then one copy to the device)
            # (host shards meant for the device go through the staging even where they lie side by side)
            through_staging = self.staging.through_buffer and shards[0].device.type == "cpu"
            mine = None if through_staging else _adjacent_span(shards, self.compute_dtype, self.partitions.device)
            if mine is None:
                mine = self.staging.pack(shards)
            rows = torch.empty((g.world, cols), dtype=self.compute_dtype, device=self.partitions.device)
            launched.append((comm.all_gather(rows, mine), rows, params, col_of))
        self.inflight[id(unit)] = launched
        return True

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
                _mark_gathered(p)
                self.gathered.add(p)

    @torch.no_grad()
    def gather(self, unit: Unit, direction: int = 0) -> None:
        """Gather ``unit`` (and, ``direction`` +1 in forward, -1 in backward, the units after it in the
        recorded order, as far as the prefetch budget goes)."""
        self.ahead.pop(id(unit), None)
        self._launch(unit)
        if direction and self.prefetch and not self.recording and unit.index >= 0:
            self._drop_passed(unit.index, direction)
            self._prefetch(unit.index, direction)
        self._complete(unit)

    def _prefetch(self, index: int, direction: int) -> None:
        window: list[Unit] = []
        ahead, i = 0, index + direction
        while 0 <= i < len(self.order):
            u = self.order[i]
            if window and ahead + u.numel > self.prefetch_elements:
                break
            window.append(u)
            ahead, i = ahead + u.numel, i + direction
        # parameter offload: the disk reads of the window's units, and of the unit after it, start before any
        # launch waits on one, so a unit's shards are read while the units before it run (the read pool's
        # buffers bound how many are in flight; nothing else reads anything)
        if self.partitions.param_swap is not None:
            beyond = [self.order[i]] if 0 <= i < len(self.order) else []
            self.partitions.prefetch_weights([self.partitions.entry_of[p] for u in window + beyond
                                              if id(u) not in self.inflight
                                              for p in u.params if p not in self.gathered])
        for u in window:
            if self._launch(u):
                self.ahead[id(u)] = u
        self.max_ahead = max(self.max_ahead, len(self.ahead))

    def _drop_passed(self, index: int, direction: int) -> None:
        """Release the units gathered ahead that this pass has gone past without using them."""
        for uid, u in list(self.ahead.items()):
            if (u.index - index) * direction < 0:
                del self.ahead[uid]
                self._settle(uid)
                self.unused_prefetches += 1

    def _settle(self, uid: int) -> None:
        """Wait for a unit's gathers in flight without using them: what they received straight into a
        parameter's storage is freed again (a packed receive buffer just goes)."""
        for handle, _, members, col_of in self.inflight.pop(uid, []):
            handle.wait()
            if col_of is None:
                for p in members:
                    if p not in self.gathered:  # (one gathered meanwhile through another unit stays)
                        self._free(p)

    def release(self, params) -> None:
        for p in params:
            if p in self.gathered:
                self._free(p)
                self.gathered.discard(p)

    def release_all(self) -> None:
        """End of a backward (or of an aborted step): settle prefetches and free every gathered parameter."""
        self.ahead.clear()
        for uid in list(self.inflight):
            self._settle(uid)
        # the step may rewrite host partitions next: no copy to the device may still read them
        self.staging.synchronize()
        self.release(list(self.gathered))

    def on_param_reduced(self, p: torch.nn.Parameter) -> None:
        # Its gradient is complete, so backward will not read this parameter again.
        if p in self.managed_set:
            self.release([p])

    # ---- hooks -----------------------------------------------------------------------------------------
    def _make_pre_forward(self, unit: Unit):
        def hook(module, args):
            if self.recording and torch.is_grad_enabled() and unit.index < 0:
                unit.index = len(self.order)
                self.order.append(unit)
            # inside backward this is a checkpointed block's forward run again (activation_checkpointing.py):
            # the units after this one in forward order have had their backward already, so nothing is
            # gathered ahead of it (backward's own gathers have fetched the block's units)
            self.gather(unit, 0 if _in_backward() else +1)

        return hook

    def _make_post_forward(self, unit: Unit):
        def hook(module, args, output):
            # the last units of a forward are the first of its backward: those within the prefetch budget
            # stay gathered for it instead of being released and gathered again at once; so does a unit
            # run again inside backward, whose own backward comes next (its parameters are released as
            # their gradients are reduced, on_param_reduced)
            if not (torch.is_grad_enabled() and (id(unit) in self.kept_for_backward or _in_backward())):
                self.release(unit.params)
            if torch.is_grad_enabled():
                tensors = [t for t in tree_flatten(output)[0] if isinstance(t, torch.Tensor) and t.requires_grad]
                if tensors:
                    torch.autograd.graph.register_multi_grad_hook(
                        tensors, lambda grads: self.gather(unit, -1), mode="any"
                    )
            return None

        return hook

    def end_first_step(self) -> None:
        """The forward order seen so far is the order to prefetch in from now on."""
        if self.order and self.recording:
            self.recording = False
            kept, total = set(), 0
            for u in reversed(self.order if self.prefetch else []):
                if kept and total + u.numel > self.prefetch_elements:
                    break
                if u.numel > self.prefetch_elements:  # (a budget smaller than the last unit keeps nothing)
                    break
                kept.add(id(u))
                total += u.numel
            self.kept_for_backward = kept

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
        for p in self.managed + list(self.shared):
            _mark_gathered(p)  # (destroy's stand-ins say what happened when the model runs)
            p.data = stand_in.expand(self.partitions.entry_of[p].shape)
            p._rayzero_destroyed = True
        for u in self.units + self.dropped_units:
            handle: list = []
            handle.append(u.module.register_forward_pre_hook(functools.partial(_destroyed_guard, handle)))
        self.units = []
        self.dropped_units = []
        self.order = []
        self.managed_set.clear()
        self.shared.clear()
        self.gathered.clear()


def _adjacent_span(shards: list[torch.Tensor], dtype: torch.dtype, device: torch.device) -> torch.Tensor | None:
    """One view over ``shards`` when they lie one after another in the same memory, in ``dtype`` on
    ``device``; None otherwise."""
    first = shards[0]
    if first.dtype != dtype or first.device != torch.device(device):
        return None
    end = first.data_ptr()
    for s in shards:
        if s.dtype != dtype or not s.is_contiguous() or s.data_ptr() != end \
                or s.untyped_storage().data_ptr() != first.untyped_storage().data_ptr():
            return None
        end += s.numel() * s.element_size()
    total = sum(s.numel() for s in shards)
    return torch.empty(0, dtype=dtype, device=first.device).set_(
        first.untyped_storage(), first.storage_offset(), (total,))


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
