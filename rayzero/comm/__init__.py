"""The only place in rayzero that calls ``torch.distributed`` collectives.

Everything above this module speaks in three operations on ``(world, cols)`` row buffers:

* ``reduce_scatter(out, rows)``: ``out = sum over ranks of rows[my_rank]`` (each rank's contribution to
  row ``j`` is reduced on rank ``j``),
* ``all_gather(rows, mine)``: ``rows[j] = mine`` of rank ``j``,
* ``all_reduce(tensor)``.

A *transport* implements them.  Two ship:

* :class:`NativeTransport` calls torch's own collectives (what NCCL does best).
* :class:`PairwiseTransport` builds reduce-scatter and all-gather from point-to-point sends, one to each
  peer.  On gloo this moves the same bytes as the native ops at roughly twice to four times their speed
  (gloo's reduce-scatter and all-gather are implemented on top of slower primitives), and it reduces in
  a fixed rank order, which makes the result bitwise reproducible.

Every group rayzero communicates over carries the accelerator's tensors: where the default group cannot
(a ``gloo`` group, as Ray Train starts without GPUs, while the accelerator is a device), rayzero makes one
group of the accelerator's backend over the same ranks (:func:`world_group`) and builds its other groups
with that backend (:func:`group_backend`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Callable, Protocol

import torch
import torch.distributed as dist


# torch 2.13 renamed the flat-tensor collectives; older releases have only the previous names.
_reduce_scatter_flat = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


class Handle:
    """An in-flight collective.  ``wait()`` completes it (and runs any local finishing work) exactly once."""

    __slots__ = ("_works", "_finish", "_done")

    def __init__(self, works: list, finish: Callable[[], None] | None = None):
        self._works = works
        self._finish = finish
        self._done = False

    def wait(self) -> None:
        if self._done:
            return
        for w in self._works:
            if w is not None:
                w.wait()
        self._works = []
        if self._finish is not None:
            self._finish()
            self._finish = None
        self._done = True


class Transport(Protocol):
    def reduce_scatter(self, out: torch.Tensor, rows: torch.Tensor) -> Handle: ...
    def all_gather(self, rows: torch.Tensor, mine: torch.Tensor) -> Handle: ...
    def all_reduce(self, tensor: torch.Tensor) -> Handle: ...
    def barrier(self) -> None: ...
    def expose_region(self, nbytes: int): ...
    def shared_tensor(self, numel: int, dtype: torch.dtype) -> torch.Tensor | None: ...
    def shares_memory(self) -> bool: ...
    def settle_reads(self) -> None: ...


class NativeTransport:
    def __init__(self, group: dist.ProcessGroup | None, rank: int, world: int):
        self.group, self.rank, self.world = group, rank, world

    def reduce_scatter(self, out: torch.Tensor, rows: torch.Tensor) -> Handle:
        if self.world == 1:
            out.copy_(rows[0])
            return Handle([])
        return Handle([_reduce_scatter_flat(out, rows.view(-1), group=self.group, async_op=True)])

    def all_gather(self, rows: torch.Tensor, mine: torch.Tensor) -> Handle:
        if self.world == 1:
            rows[0].copy_(mine)
            return Handle([])
        return Handle([_all_gather_flat(rows.view(-1), mine, group=self.group, async_op=True)])

    def all_reduce(self, tensor: torch.Tensor) -> Handle:
        if self.world == 1:
            return Handle([])
        return Handle([dist.all_reduce(tensor, group=self.group, async_op=True)])

    def barrier(self) -> None:
        if self.world > 1:
            dist.barrier(group=self.group)

    # Memory the other ranks read in place exists only where every rank maps it (rayzero/comm/shm.py);
    # here every rank keeps its own tensors and collectives copy them.
    def expose_region(self, nbytes: int) -> None:
        return None

    def shared_tensor(self, numel: int, dtype: torch.dtype) -> None:
        return None

    def shares_memory(self) -> bool:
        return False

    def settle_reads(self) -> None:
        pass


class PairwiseTransport(NativeTransport):
    """Reduce-scatter / all-gather from one send and one receive per peer; reduction in rank order."""

    _TAG_SPACE = 1 << 30

    def __init__(self, group: dist.ProcessGroup | None, rank: int, world: int):
        super().__init__(group, rank, world)
        # Every rank issues collectives in the same order, so a shared counter gives each collective
        # its own tag and messages of two in-flight collectives can never be matched to each other.
        self._seq = 0

    def _tag(self) -> int:
        self._seq = (self._seq + 1) % self._TAG_SPACE
        return self._seq

    def _p2p(self, ops: list[tuple[Callable, torch.Tensor, int]], tag: int) -> list:
        return dist.batch_isend_irecv(
            [dist.P2POp(op, t, group=self.group, tag=tag, group_peer=peer) for op, t, peer in ops]
        )

    def reduce_scatter(self, out: torch.Tensor, rows: torch.Tensor) -> Handle:
        if self.world == 1:
            out.copy_(rows[0])
            return Handle([])
        r, w = self.rank, self.world
        peers = [p for p in range(w) if p != r]
        received = torch.empty((w - 1, rows.shape[1]), dtype=rows.dtype, device=rows.device)
        ops = []
        for i, peer in enumerate(peers):
            ops.append((dist.isend, rows[peer], peer))
            ops.append((dist.irecv, received[i], peer))
        works = self._p2p(ops, self._tag())

        def finish() -> None:
            # Add in rank order, so every run (and every rank that owns a row) sums the same way.
            parts = [rows[r] if j == r else received[j if j < r else j - 1] for j in range(w)]
            out.copy_(parts[0])
            for part in parts[1:]:
                out.add_(part)

        return Handle(works, finish)

    def all_gather(self, rows: torch.Tensor, mine: torch.Tensor) -> Handle:
        if self.world == 1:
            rows[0].copy_(mine)
            return Handle([])
        r, w = self.rank, self.world
        rows[r].copy_(mine)
        ops = []
        for peer in range(w):
            if peer != r:
                ops.append((dist.isend, rows[r], peer))
                ops.append((dist.irecv, rows[peer], peer))
        return Handle(self._p2p(ops, self._tag()))


class OrderedTransport(PairwiseTransport):
    """Pairwise transport whose all-reduce is a reduce-scatter plus an all-gather, so that every sum in
    rayzero (gradients, norms) is taken in rank order: the deterministic policy's transport."""

    def all_reduce(self, tensor: torch.Tensor) -> Handle:
        if self.world == 1:
            return Handle([])
        n, w = tensor.numel(), self.world
        chunk = -(-n // w)
        rows = torch.zeros((w, chunk), dtype=tensor.dtype, device=tensor.device)
        rows.view(-1)[:n].copy_(tensor.reshape(-1))
        mine = torch.empty(chunk, dtype=tensor.dtype, device=tensor.device)
        scatter = self.reduce_scatter(mine, rows)

        def finish() -> None:
            scatter.wait()
            self.all_gather(rows, mine).wait()
            tensor.view(-1).copy_(rows.view(-1)[:n])

        return Handle([], finish)


@dataclass
class Communicator:
    """Collectives over one process group, through the transport that suits its backend."""

    group: dist.ProcessGroup | None
    rank: int
    world: int
    transport: Transport
    #: Where this group's collective tensors live: the rank's accelerator device (the CPU for the CPU
    #: accelerator).  Tensors rayzero makes only to communicate (flags, scalars) are made here.
    device: torch.device = torch.device("cpu")

    @staticmethod
    def for_group(
        group: dist.ProcessGroup | None = None, transport: str = "auto", device: torch.device | None = None
    ) -> "Communicator":
        if dist.is_available() and dist.is_initialized():
            if group is None:
                group = world_group()
            else:
                check_carries_device(group)
            rank, world = dist.get_rank(group), dist.get_world_size(group)
            backend = dist.get_backend(group)
        else:
            rank, world, backend = 0, 1, "none"
        if transport in ("auto", "ordered") and backend == "gloo" and world > 1:
            from rayzero.comm.shm import shm_supported

            if shm_supported():  # shared memory between the ranks on this host, gloo to others
                transport = "shm-ordered" if transport == "ordered" else "shm"
        if transport == "auto":
            transport = "pairwise" if backend == "gloo" else "native"
        if transport in ("shm", "shm-ordered"):
            from rayzero.comm.shm import ShmTransport

            impl: Transport = ShmTransport(group, rank, world, ordered=transport == "shm-ordered")
        elif transport == "pairwise":
            impl = PairwiseTransport(group, rank, world)
        elif transport == "ordered":
            impl = OrderedTransport(group, rank, world)
        elif transport == "native":
            impl = NativeTransport(group, rank, world)
        else:
            raise ValueError(
                f"unknown transport {transport!r}; use 'auto', 'native', 'pairwise', 'ordered', 'shm' or 'shm-ordered'"
            )
        if device is None:
            from rayzero.accelerator import get_accelerator

            device = get_accelerator().device()
        return Communicator(group, rank, world, impl, device)

    def reduce_scatter(self, out: torch.Tensor, rows: torch.Tensor, own: torch.Tensor | None = None) -> Handle:
        """``own``: this rank's own contribution where it lies apart from ``rows[rank]`` (whose content is
        then not used), so a caller need not copy it in; a transport that cannot read it there gets a copy."""
        if own is None:
            return self.transport.reduce_scatter(out, rows)
        if getattr(self.transport, "reads_own_row_apart", False):
            return self.transport.reduce_scatter(out, rows, own=own)
        rows[self.rank].copy_(own)
        return self.transport.reduce_scatter(out, rows)

    def all_gather(self, rows: torch.Tensor, mine: torch.Tensor) -> Handle:
        return self.transport.all_gather(rows, mine)

    def all_reduce(self, tensor: torch.Tensor) -> Handle:
        return self.transport.all_reduce(tensor)

    def sum_scalar(self, value: torch.Tensor) -> torch.Tensor:
        """All-reduce a small fp32/fp64 tensor (norms, overflow flags) and return it."""
        self.all_reduce(value).wait()
        return value

    def gather_objects(self, obj: Any) -> list:
        """Every rank's picklable ``obj``, in rank order, on every rank (a collective).  For small records
        (a few hundred bytes a rank, at set-up or a first save): built on the group's own all-reduce of tensors
        on ``device``, each rank's bytes in its own row, so it works on any group rayzero communicates over,
        where torch's object collectives stage through the host and a device-only backend refuses them."""
        import pickle

        data = pickle.dumps(obj)
        if self.world == 1:
            return [obj]
        sizes = torch.zeros(self.world, dtype=torch.float64, device=self.device)
        sizes[self.rank] = len(data)
        sizes = self.sum_scalar(sizes).to("cpu").long().tolist()
        width = max(sizes)
        flat = torch.zeros(self.world * width, dtype=torch.float32, device=self.device)  # bytes are exact in fp32
        flat[self.rank * width : self.rank * width + len(data)] = torch.frombuffer(
            bytearray(data), dtype=torch.uint8).to(self.device)
        rows = self.sum_scalar(flat).to("cpu").to(torch.uint8).view(self.world, width)
        return [pickle.loads(rows[r, : sizes[r]].numpy().tobytes()) for r in range(self.world)]

    def any_rank(self, flag: bool) -> bool:
        """Whether ``flag`` is true on any rank of the group; every rank must call it (so it is also a
        barrier).  Used to agree on failures, so that no rank goes on while another has raised."""
        value = torch.tensor([1.0 if flag else 0.0], device=self.device)
        return self.sum_scalar(value).item() > 0

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> None:
        if self.world > 1:
            dist.broadcast(tensor, group=self.group, group_src=src)

    def barrier(self) -> None:
        self.transport.barrier()

    def expose_region(self, nbytes: int):
        """A region of this rank's memory that the group's collectives read in place (a collective; None
        where the transport has none: rayzero/comm/shm.py, ExposedRegion)."""
        return self.transport.expose_region(nbytes)

    def shared_tensor(self, numel: int, dtype: torch.dtype) -> torch.Tensor | None:
        """A tensor that is the same memory on every rank of the group (a collective; None where the
        transport cannot give one)."""
        return self.transport.shared_tensor(numel, dtype)

    def shares_memory(self) -> bool:
        """Whether ``shared_tensor`` and ``expose_region`` can give memory every rank maps (a collective the
        first time: all of the group's ranks on one host, with a transport that maps memory)."""
        return self.transport.shares_memory()

    def settle_reads(self) -> None:
        """Return once the other ranks have read everything this rank's collectives exposed."""
        self.transport.settle_reads()


def init_distributed(backend: str | None = None, timeout_s: float = 1800.0) -> tuple[int, int, bool]:
    """Use an initialised default process group, else initialise one from the standard environment.

    Returns ``(rank, world_size, created)``.  With no ``RANK``/``WORLD_SIZE`` in the environment and no
    process group, rayzero runs as world size 1 without creating one.  The rank's device is made current
    first (``bind_rank_device``); with a group, every rank checks that no other rank of its host bound the
    same device.
    """
    from rayzero.accelerator import bind_rank_device

    bind_rank_device()
    if dist.is_available() and dist.is_initialized():
        _check_distinct_devices()
        return dist.get_rank(), dist.get_world_size(), False
    if "WORLD_SIZE" not in os.environ or "RANK" not in os.environ:
        return 0, 1, False
    world = int(os.environ["WORLD_SIZE"])
    rank = int(os.environ["RANK"])
    if world == 1 and "MASTER_ADDR" not in os.environ:
        return 0, 1, False
    for var in ("MASTER_ADDR", "MASTER_PORT"):
        if var not in os.environ:
            raise RuntimeError(
                f"RANK and WORLD_SIZE are set but {var} is not: set {var} as torchrun and Ray Train do, "
                "or initialise torch.distributed yourself before rayzero.initialize"
            )
    if backend is None:
        from rayzero.accelerator import get_accelerator

        backend = get_accelerator().communication_backend()
    dist.init_process_group(backend, rank=rank, world_size=world, timeout=timedelta(seconds=timeout_s))
    _check_distinct_devices()
    return rank, world, True


def _backend_for_device(group: dist.ProcessGroup | None, device_type: str) -> str | None:
    """The backend ``group`` sends ``device_type`` tensors through (None: it takes none)."""
    config = dist.get_backend_config(group)  # "gloo", or "cpu:gloo,cuda:nccl"
    if ":" not in config:
        return config
    for item in config.split(","):
        kind, _, name = item.strip().partition(":")
        if kind == device_type:
            return name
    return None


def _device_backend() -> tuple[str, str] | None:
    """``(device type, backend)`` of the accelerator when its tensors live off the host, else None."""
    from rayzero.accelerator import get_accelerator

    acc = get_accelerator()
    device = acc.device()
    if device.type == "cpu":
        return None
    return device.type, acc.communication_backend()


def carries_device(group: dist.ProcessGroup | None) -> bool:
    """Whether ``group``'s collectives take the accelerator's tensors through the accelerator's backend
    (a gloo group also claims CUDA tensors, through host copies and CPU-only point-to-point: not that)."""
    wanted = _device_backend()
    return wanted is None or _backend_for_device(group, wanted[0]) == wanted[1]


def check_carries_device(group: dist.ProcessGroup) -> None:
    """Refuse, at set-up, a group that cannot carry the accelerator's tensors."""
    if group is dist.GroupMember.NON_GROUP_MEMBER or carries_device(group):
        return
    device_type, backend = _device_backend()
    raise ValueError(
        f"rayzero was given a process group on the {dist.get_backend_config(group)!r} backend, which does not "
        f"carry {device_type} tensors through {backend!r}, the accelerator's backend; create the group with "
        f"torch.distributed.new_group(ranks, backend={backend!r}) (rayzero's own groups get that backend)"
    )


# The group over the default group's ranks that rayzero's world collectives use, for one default group.
_world: dict = {"default": None, "group": None, "checked": False}


def world_group() -> dist.ProcessGroup | None:
    """The group rayzero's world-wide collectives go through: the default group (None) where it carries
    the accelerator's tensors, else one group of the accelerator's backend over all ranks, made once per
    default group.  Every rank must make its first call at the same point (``new_group`` is collective)."""
    if not (dist.is_available() and dist.is_initialized()):
        return None
    default = dist.group.WORLD
    if _world["default"] is not default:
        _world.update(default=default, group=None, checked=False)
        if not carries_device(None):
            _world["group"] = dist.new_group(backend=_device_backend()[1])
    return _world["group"]


def group_backend() -> str | None:
    """The backend for the groups rayzero makes (None: the default group's)."""
    wanted = _device_backend()
    return None if wanted is None or carries_device(None) else wanted[1]


def _check_distinct_devices() -> None:
    """Two ranks of one host on one device is what a device backend refuses (at its first collective, with a
    message about duplicate devices): say so at set-up, with the cause.  Once per default group, where a
    launcher placed the ranks (``LOCAL_RANK``, as torchrun and Ray Train set it, or the device index)."""
    from rayzero.accelerator import (
        DEVICE_INDEX_ENV_VAR, device_identity, get_accelerator, host_identity, identity_hash,
    )

    placed = "LOCAL_RANK" in os.environ or DEVICE_INDEX_ENV_VAR in os.environ
    if _device_backend() is None or dist.get_world_size() == 1 or not placed:
        return
    group = world_group()
    if _world["checked"]:
        return
    acc = get_accelerator()
    index = acc.current_device_index()
    device = acc.device(index)
    mine = torch.tensor([identity_hash(host_identity()), identity_hash(device_identity(acc, index))],
                        dtype=torch.int64, device=device)
    everyone = torch.empty(dist.get_world_size() * 2, dtype=torch.int64, device=device)
    _all_gather_flat(everyone, mine, group=group)
    pairs = everyone.view(-1, 2).tolist()
    _world["checked"] = True
    rank = dist.get_rank()
    same = [r for r, pair in enumerate(pairs) if pair == pairs[rank] and r != rank]
    if same:
        raise RuntimeError(
            f"rank {rank} and rank(s) {same} of the same host are bound to one {acc.name} device ({device}: "
            f"LOCAL_RANK={os.environ.get('LOCAL_RANK', 'unset')}, {acc.device_count()} device(s) visible), which "
            f"the {_device_backend()[1]} backend refuses. Start at most one rank per device: on Ray give each "
            "worker a whole GPU (resources_per_worker={'GPU': 1}) and no more workers per node than it has "
            "GPUs; with torchrun, --nproc-per-node at most the node's device count"
        )
