"""Optimizer offload: the fp32 master partitions and the optimizer state outside the compute device.

``offload_optimizer.device``:

* ``cpu``: masters, optimizer state and the fp32 gradient accumulators live in host memory (pinned with
  ``pin_memory`` when the model computes on an accelerator); the optimizer steps them there.
* ``nvme``: as ``cpu``, but between steps each sub-group's master and optimizer state tensors live in the
  rank's swap files (``swap_store.py``), not in memory.  A step brings one sub-group (``sub_group_size``
  elements) at a time into a bounded pool of aligned buffers, reads the next sub-group while the current
  one is stepped, and writes each stepped sub-group back.  A resident copy of every sub-group's weights in
  the compute dtype (``GroupPartition.weights``) serves publishing (stages 1-2) and stage-3 gathers.

Offloaded gradients are reduced into the fp32 gradient partitions every backward (one accumulator per
group, so stage 1 reduces like stage 2 under offload).  With ``cpu`` they stay in host memory; with ``nvme``
each sub-group's gradient goes to the swap store as soon as its last bucket is reduced (``gradients.py``),
and the step reads it back with the sub-group's master and state.

With ``nvme`` at stage 3 the masters are not filled at set-up: each sub-group's master is built in one pool
buffer from the parameters (or their zero_init shards), its weights are written or copied from it, and it
goes to the swap store before the next one is built, so no moment holds the whole master partition.
"""

from __future__ import annotations

import contextlib
import logging
from concurrent.futures import Future
from typing import Iterator

import torch

from rayzero.zero.partition import GroupPartition, Partitions

logger = logging.getLogger("rayzero")


class _Slot:
    """One pool entry: aligned buffers for a sub-group's master and its optimizer state tensors."""

    def __init__(self) -> None:
        self.buffers: dict[str, torch.Tensor] = {}
        self.owner: int | None = None  # the sub-group being stepped (or read for it) with these buffers
        # the sub-group whose current values the buffers still hold after it was written back (None: none):
        # a later step takes the slot as it is instead of reading the files again
        self.holds: int | None = None
        self.reads: list[Future] = []
        self.writes: list[Future] = []

    def buffer(self, name: str, numel: int) -> torch.Tensor:
        from rayzero.offload.swap_store import aligned_empty

        buf = self.buffers.get(name)
        if buf is None or buf.numel() < numel:
            buf = self.buffers[name] = aligned_empty(numel, torch.float32)
        return buf[:numel]

    def settle_writes(self) -> None:
        for f in self.writes:
            f.result()
        self.writes = []


class NvmeOptimizerSwap:
    """Keeps every sub-group's master and optimizer state in the swap store between steps."""

    def __init__(self, partitions: Partitions, optimizer: torch.optim.Optimizer, store, slots: int,
                 compute_dtype: torch.dtype, weights_device: torch.device, keep_weights: bool = True):
        self.partitions = partitions
        self.optimizer = optimizer
        self.store = store
        self.slots = [_Slot() for _ in range(max(2, slots))]  # memory.pool_slots
        self.slot_of: dict[int, _Slot] = {}
        self.state_names: dict[int, list[str]] = {}  # per group: the state tensors it keeps on disk
        self._empty = torch.empty(0, dtype=torch.float32)
        self.grads = partitions.grad_swap  # gradients.py: the gradient partitions, in the same store
        build: torch.Tensor | None = None  # one buffer for the deferred masters, built one group at a time
        for gi, g in enumerate(partitions.groups):
            numel = self._numel(gi)
            if g.master.numel() != numel:  # deferred (Partitions(deferred_masters=True)): built here
                from rayzero.accelerator.host_allocator import give_back_now
                from rayzero.offload.swap_store import aligned_empty

                if build is None:
                    build = aligned_empty(max(self._numel(i) for i in range(len(partitions.groups))), torch.float32)
                g.master.set_(build[:numel])
                dropped = partitions.load_master_group(g, g.master)
                if not keep_weights:
                    partitions.refresh_weights([g])  # the shards to the parameter swap files
                if dropped:
                    give_back_now()
            if keep_weights:  # else the weights are in the swap files too (parameter offload)
                g.weights = g.master.detach().to(device=weights_device, dtype=compute_dtype, copy=True)
            self.store.write(self._key(gi, "master"), g.master).result()
            g.master.set_(self._empty)
        del build
        self._read_back: tuple[int, torch.Tensor] | None = None
        self._reverse = False  # every other step runs the sub-groups backwards: the pool's last ones go first
        self._loading: tuple | None = None  # (sub-group, slot, buffers) while a checkpoint load fills one
        self.reads_skipped = 0  # sub-groups taken from the pool instead of the files (for tests and benches)
        partitions.master_reader = self.read_master

    def read_master(self, gi: int) -> torch.Tensor:
        """A swapped-out group's fp32 master, read from its file (the last one read is kept for the next
        parameter of the same group: an export reads group by group)."""
        if self._read_back is None or self._read_back[0] != gi:
            self.flush()
            self._read_back = None
            from rayzero.offload.swap_store import aligned_empty

            buf = aligned_empty(self._numel(gi), torch.float32)
            self.store.read(self._key(gi, "master"), buf).result()
            self._read_back = (gi, buf)
        return self._read_back[1]

    # ---- keys and slots --------------------------------------------------------------------------------
    @staticmethod
    def _key(gi: int, name: str) -> str:
        return f"group{gi}.{name}"

    def _numel(self, gi: int) -> int:
        return self.partitions.groups[gi].layout.partition_numel

    def _take_slot(self, soon: set[int]) -> _Slot:
        """A free slot for a read, preferring one whose buffers exist and whose writes are done, so the pool
        grows only to what the step really keeps in flight (one slot when the partition is one sub-group),
        and one that does not hold a sub-group in ``soon`` (still to be stepped this step)."""
        free = [s for s in self.slots if s.owner is None]
        if not free:
            raise RuntimeError("every swap buffer holds a sub-group in use; raise offload_optimizer.buffer_count "
                               "(tensor buffers: a slot takes the master and each optimizer state tensor)")
        spare = lambda s: s.holds is None or s.holds not in soon
        ready = [s for s in free if s.buffers and all(f.done() for f in s.writes)]
        empty = [s for s in free if not s.buffers]
        slot = ([s for s in ready if spare(s)] or empty or [s for s in free if spare(s)] or ready or free)[0]
        slot.settle_writes()
        slot.holds = None
        return slot

    # ---- swapping ----------------------------------------------------------------------------------------
    def prefetch(self, gi: int, soon: set[int] = frozenset()) -> None:
        """Start reading sub-group ``gi`` into a buffer; a sub-group that already holds one keeps it, and one
        whose values are still in a free slot takes that slot back without reading."""
        if gi in self.slot_of:
            return
        kept = [s for s in self.slots if s.owner is None and s.holds == gi]
        if kept:
            slot = kept[0]
            slot.owner = gi
            self.slot_of[gi] = slot
            self.reads_skipped += 1
            return
        slot = self._take_slot(soon)
        slot.owner = gi
        slot.holds = gi
        numel = self._numel(gi)
        slot.reads = [self.store.read(self._key(gi, "master"), slot.buffer("master", numel))]
        for name in self.state_names.get(gi, []):
            slot.reads.append(self.store.read(self._key(gi, name), slot.buffer(name, numel)))
        self.slot_of[gi] = slot

    def swap_in(self, gi: int) -> None:
        """Make sub-group ``gi``'s master and optimizer state tensors real (waits for its reads)."""
        self.prefetch(gi)
        slot = self.slot_of[gi]
        for f in slot.reads:
            f.result()
        slot.reads = []
        slot.settle_writes()  # a slot taken back from the pool: its last write must not see the new step
        g = self.partitions.groups[gi]
        numel = self._numel(gi)
        g.master.set_(slot.buffer("master", numel))
        state = self.optimizer.state.get(g.master)
        if state:
            for name in self.state_names.get(gi, []):
                state[name] = slot.buffer(name, numel)

    def swap_out(self, gi: int, write: bool = True) -> None:
        """Write sub-group ``gi`` back (asynchronously) and drop its tensors from memory."""
        slot = self.slot_of.pop(gi)
        g = self.partitions.groups[gi]
        state = self.optimizer.state.get(g.master) or {}
        names = [k for k, v in state.items() if torch.is_tensor(v) and v.shape == g.master.shape and v.numel() > 1]
        if write:
            numel = self._numel(gi)
            for name in names:
                buf = slot.buffer(name, numel)
                if state[name].data_ptr() != buf.data_ptr():  # created by the optimizer: move into the pool
                    buf.copy_(state[name])
                state[name] = buf
            # the slot's own tensor, not g.master, which is emptied below while the write is in flight
            slot.writes = [self.store.write(self._key(gi, "master"), slot.buffer("master", numel))]
            slot.writes += [self.store.write(self._key(gi, name), state[name]) for name in names]
            self.state_names[gi] = names
            slot.holds = gi
        for name in names:
            state[name] = self._empty
        g.master.set_(self._empty)
        slot.owner = None

    def flush(self) -> None:
        """Wait until every write has reached the files."""
        for slot in self.slots:
            slot.settle_writes()

    # ---- the step ----------------------------------------------------------------------------------------
    def step(self, groups: list[GroupPartition], grad_multiplier: float | None = None) -> None:
        """Step every sub-group in turn, reading the next ones while the current one steps.  The order
        alternates from step to step, so the sub-groups stepped last, whose values are still in the pool,
        are stepped first next time without being read again (the sub-groups are independent).  Swapped
        gradients are read ahead too, scaled by ``grad_multiplier`` when given (an optimizer that does not
        fold the multiplier in), and spent after."""
        self.flush()  # the last step's writes had a forward and backward to finish; a failed one raises here
        n = len(groups)
        order = list(range(n - 1, -1, -1)) if self._reverse else list(range(n))
        self._reverse = not self._reverse
        # read up to this many sub-groups ahead, keeping one buffer for the write of the one just stepped
        ahead = max(1, len(self.slots) - 2)
        for i, gi in enumerate(order):
            soon = set(order[i : i + 1 + ahead])
            for nxt in order[i : i + 1 + ahead]:
                self.prefetch(nxt, soon)
                if self.grads is not None:
                    self.grads.prefetch(nxt)
            self.swap_in(gi)
            g = groups[gi]
            grad = self.grads.acquire(gi, overwrite=False) if self.grads is not None else g.grad
            if grad_multiplier is not None:
                grad.mul_(grad_multiplier)
            g.master.grad = grad
            self.optimizer.step()
            g.master.grad = None
            if self.grads is not None:
                self.grads.discard(gi)
            self.partitions.refresh_weights([g])
            self.swap_out(gi)
        # The last writes finish during the next forward and backward: the next step settles them before it
        # changes any sub-group, and the store runs a later read of the same file after its write.  A write
        # that already failed (a full disk fails before any data moves into a growing file) raises now.
        self.raise_failed_writes()
        self._read_back = None

    def raise_failed_writes(self) -> None:
        for slot in self.slots:
            for f in slot.writes:
                if f.done() and f.exception() is not None:
                    slot.writes = []
                    raise f.exception()

    # ---- checkpoints: one sub-group in memory at a time -------------------------------------------------
    def swapped_out(self, gi: int) -> bool:
        return self.partitions.groups[gi].master.numel() != self._numel(gi)

    def tensor_state_names(self, gi: int) -> list[str]:
        """The optimizer state tensors sub-group ``gi`` keeps in its swap files."""
        return list(self.state_names.get(gi, []))

    @contextlib.contextmanager
    def group_resident(self, gi: int) -> Iterator[None]:
        """Sub-group ``gi``'s master and optimizer state in memory, unchanged (a checkpoint save reads them)."""
        self.prefetch(gi)
        self.swap_in(gi)
        try:
            yield
        finally:
            self.swap_out(gi, write=False)

    @contextlib.contextmanager
    def loading(self, gi: int, names: list[str] | None, keep_master: bool) -> Iterator[dict[str, torch.Tensor]]:
        """Buffers to load sub-group ``gi`` into (a checkpoint load): its master is made a buffer (holding
        the current master when ``keep_master``: parameters the checkpoint does not cover keep their
        values), and the optimizer state tensors ``names`` get zeroed buffers, which are yielded (``None``:
        the optimizer state is not loaded, its files stay as they are).  On
        success the weights are refreshed from the new master and everything is written to the files;
        the optimizer's own state for the group is then only placeholders (``placeholder``)."""
        for slot in self.slots:  # whatever the pool still holds of this sub-group is out of date now
            if slot.holds == gi:
                slot.holds = None
        self._read_back = None
        slot = self._take_slot(set())
        slot.owner = gi
        g = self.partitions.groups[gi]
        numel = self._numel(gi)
        master = slot.buffer("master", numel)
        if keep_master:
            self.store.read(self._key(gi, "master"), master).result()
        else:  # every parameter's slice is overwritten; the padding past them must not be a pool leftover
            master.zero_()
        g.master.set_(master)
        buffers = {name: slot.buffer(name, numel).zero_() for name in names or []}
        self._loading = (gi, slot, buffers)
        ok = False
        try:
            yield buffers
            ok = True
        finally:
            if ok:
                self.partitions.refresh_weights([g])
                slot.writes = [self.store.write(self._key(gi, "master"), master)]
                slot.writes += [self.store.write(self._key(gi, name), buf) for name, buf in buffers.items()]
                if names is not None:
                    self.state_names[gi] = list(buffers)
                    slot.holds = gi  # else the slot has the master but not the state the files keep
            g.master.set_(self._empty)
            slot.owner = None
            self._loading = None

    def zero_state(self, gi: int, name: str) -> torch.Tensor:
        """Inside ``loading(gi, ...)``: a zeroed buffer for one more optimizer state tensor (one the config
        turned on since the save), written to the files with the others."""
        at, slot, buffers = self._loading
        assert at == gi, "zero_state is only for the sub-group being loaded"
        buffers[name] = slot.buffer(name, self._numel(gi)).zero_()
        return buffers[name]

    @property
    def placeholder(self) -> torch.Tensor:
        """What the optimizer's state holds for a swapped-out tensor (``swap_in`` puts the buffer there)."""
        return self._empty


def engine_states_split(cfg, params: list[torch.Tensor], world_of, stage: int, offload: str, on_accelerator: bool,
                        preallocated: int = 0) -> tuple[int, int]:
    """``(bytes on the compute device, bytes in host memory)`` of this rank's model states for ``params``
    (partitioned over ``world_of(p)`` ranks each) with the optimizer offloaded to ``offload``:
    ``rayzero.memory.states_bytes``, less ``preallocated`` (what the model's parameters already hold of them
    on the compute device).  On the CPU both are host memory: ``(0, all of it)``."""
    from rayzero.memory import engine_shares, states_bytes

    shares = engine_shares(params, world_of)
    device = states_bytes(shares, cfg, offload, "device", stage=stage)
    host = states_bytes(shares, cfg, offload, "host", stage=stage)
    if not on_accelerator:
        return 0, max(0, device + host - preallocated)
    return max(0, device - preallocated), host


def resolve_offload_device(cfg, params: list[torch.Tensor], stage: int, world_of, accelerator=None) -> str:
    """``offload_optimizer.device`` with ``auto`` decided.  On the CPU: ``none`` when this rank's model states
    fit the memory the process may use (cgroup and rlimit aware), else ``nvme`` (with ``nvme_path``).  On an
    accelerator (``accelerator``, default the process's): ``none`` when they fit the device's free memory
    (``available_memory()``), else ``cpu`` when the offloaded part fits host memory, else ``nvme``.  The
    bytes are ``engine_states_split``'s (``rayzero/memory.py``), as the start-up check counts them."""
    off = cfg.zero_optimization.offload_optimizer
    if off.device != "auto":
        return off.device
    from rayzero.accelerator.memory_limits import detect_memory_limit
    from rayzero.offload.plan import resolve_auto_offload

    if accelerator is None:
        from rayzero.accelerator import get_accelerator

        accelerator = get_accelerator()
    limit = detect_memory_limit()  # headroom left under the tightest limit (the model is built already)
    left = limit.available_bytes
    if accelerator.name != "cpu":
        from rayzero.offload.plan import resolve_auto_offload_on_device

        # what the model's parameters already hold on the device (stages 0-2 keep them) is not free any more,
        # and not needed again
        held = 0 if stage == 3 else sum(p.numel() * p.element_size() for p in params
                                        if p.device.type != "cpu" and not hasattr(p, "_rayzero_shard"))

        def split(device: str) -> tuple[int, int]:
            return engine_states_split(cfg, params, world_of, stage, device, True, held)

        need = split("none")[0]
        device_left = accelerator.available_memory()
        choice = resolve_auto_offload_on_device(need, split("cpu"), split("nvme"), device_left, left, off.nvme_path,
                                                device_source=f"{accelerator.name} available_memory()",
                                                host_source=limit.available_source)
        logger.info("offload_optimizer.device auto -> %s (model states %d bytes, %d bytes free on the %s device)",
                    choice, need, device_left, accelerator.name)
        return choice
    need = engine_states_split(cfg, params, world_of, stage, "none", False)[1]
    need_nvme = engine_states_split(cfg, params, world_of, stage, "nvme", False)[1]
    choice = resolve_auto_offload(need, need_nvme, left, off.nvme_path)
    logger.info("offload_optimizer.device auto -> %s (model states %d bytes, %d bytes left under %s)",
                choice, need, left, limit.available_source)
    return choice


def check_model_states_fit(cfg, params: list[torch.Tensor], world_of, stage: int, device_kind: str,
                           offload: str, preallocated: int, accelerator=None) -> None:
    """Refuse, before allocating, model states that cannot fit the memory this process may still use.

    On the CPU only hard limits are enforced (cgroup, RLIMIT_AS / RLIMIT_DATA, or more than the host has): an
    allocation past them kills the process or fails half-way through set-up.  On an accelerator (``device_kind``
    not ``cpu``; ``accelerator`` defaults to the registered one of that kind) the part that lives on the device
    must fit its free memory (``available_memory()``), and the part offloaded to the host the host's limits.
    ``preallocated`` is what the model's parameters already hold of these bytes (on the compute device).  The
    bytes are ``engine_states_split``'s (``rayzero/memory.py``).
    """
    if not params:
        return
    from rayzero.accelerator.memory_limits import SOURCE_HOST, detect_memory_limit
    from rayzero.config import ConfigError

    on_accelerator = device_kind != "cpu"
    mib = 1 << 20
    count = sum(p.numel() for p in params)

    def split(device: str) -> tuple[int, int]:
        """(bytes on the compute device, bytes in host memory); on the CPU both are host memory."""
        return engine_states_split(cfg, params, world_of, stage, device, on_accelerator, preallocated)

    on_device, wanted = split(offload)
    if on_accelerator:
        if accelerator is None:
            from rayzero.offload.staging import accelerator_for

            accelerator = accelerator_for(torch.device(device_kind))
        device_left = accelerator.available_memory()
        if on_device > device_left:
            fix = ("use a higher ZeRO stage or more ranks" if offload != "none" else
                   f"offload the optimizer to the CPU (zero_optimization.offload_optimizer: {{\"device\": \"cpu\"}} "
                   f"or \"auto\", which then needs about {split('cpu')[0] / mib:.0f} MiB on the device), use a higher "
                   "ZeRO stage, or more ranks")
            raise ConfigError(
                f"this rank's model states need {on_device / mib:.0f} MiB more {device_kind} device memory "
                f"({count:,} trainable parameters, ZeRO stage {stage}, optimizer offload '{offload}'), but only "
                f"{device_left / mib:.0f} MiB are free on the device ({accelerator.name} available_memory()); {fix}"
            )
    if wanted == 0:
        return
    limit = detect_memory_limit()
    hard = limit.available_source != SOURCE_HOST
    left = limit.available_bytes if hard else limit.total_bytes
    if wanted <= left:
        return
    fix = ("use a higher ZeRO stage or more ranks" if offload == "nvme" else
           f"offload the optimizer to NVMe (zero_optimization.offload_optimizer: {{\"device\": \"nvme\", "
           f"\"nvme_path\": ...}}, which needs about {split('nvme')[1] / mib:.0f} MiB here), use a higher ZeRO stage, "
           "or more ranks")
    where = "host memory (the optimizer offloaded there)" if on_accelerator else "memory"
    raise ConfigError(
        f"this rank's model states need {wanted / mib:.0f} MiB more {where} ({count:,} "
        f"trainable parameters, ZeRO stage {stage}, optimizer offload '{offload}'), but only {left / mib:.0f} "
        f"MiB are left under {limit.available_source if hard else limit.source}; {fix}"
    )
