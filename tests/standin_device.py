"""A second device kind for CPU-only machines, and a collective backend that accepts only its tensors.

``install()`` registers torch's PrivateUse1 key as the device ``standin``.  A ``standin`` tensor is a
wrapper whose values live in a CPU tensor (its payload); every operator unwraps, runs on the payloads and
wraps the result, so training on ``standin`` computes exactly what the CPU computes.  Like an accelerator,
an operator that mixes a ``standin`` tensor with a host tensor of one or more dimensions fails (0-dim host
scalars are allowed, as CUDA allows them); only copies cross between the two.

The process-group backend ``standin`` runs gloo on the payloads and refuses any tensor that is not on a
``standin`` device, with an error naming the collective, the way NCCL refuses host tensors.  An engine
that builds a flag, a norm or a loss on the host and hands it to a collective fails here on a CPU-only CI
machine, instead of first failing on a GPU node.

Every operator that reaches a ``standin`` tensor is first shown to each callable in ``op_hooks`` as
``hook(func, args, kwargs)`` (``.tolist()`` as ``hook("tolist", (tensor,), {})``): tests/sync_count.py counts
host syncs there.

Call ``install()`` once per process, before any tensor is created on the device (the PrivateUse1 key can
be named only once per process, so each test that uses it runs in its own worker processes).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

DEVICE = "standin"
_COPIES = {"_to_copy", "copy_", "_copy_from", "_copy_from_and_resize", "copy"}
_installed = False
_libraries: list = []  # registrations live as long as these objects
op_hooks: list = []  # callables shown every operator on this device's tensors (see the module docstring)


class HostTensorError(RuntimeError):
    pass


class StandInTensor(torch.Tensor):
    """A tensor on the ``standin`` device; ``_payload`` holds its values on the CPU."""

    _payload: torch.Tensor

    @staticmethod
    def __new__(cls, payload: torch.Tensor, index: int = 0):
        t = torch.Tensor._make_wrapper_subclass(
            cls, payload.shape, strides=payload.stride(), storage_offset=payload.storage_offset(),
            dtype=payload.dtype, device=torch.device(DEVICE, index), requires_grad=False,
        )
        t._payload = payload
        return t

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        return _run(func, args, kwargs or {})

    # ``t.data = other`` swaps the tensor's contents in C++, which knows nothing of the payload: the
    # payload follows, so the two keep sharing memory as they would on a real device
    @property
    def data(self):
        return torch.Tensor.data.__get__(self)

    @data.setter
    def data(self, new: torch.Tensor) -> None:
        torch.Tensor.data.__set__(self, new)
        if isinstance(new, StandInTensor):
            self._payload = new._payload

    def tolist(self):  # a device-to-host read, as on any accelerator
        for hook in op_hooks:
            hook("tolist", (self,), {})
        return self._payload.tolist()

    def data_ptr(self) -> int:  # the payload's address, so identity checks on addresses still work
        return self._payload.data_ptr()

    def __repr__(self) -> str:
        return f"StandInTensor({self._payload!r})"


def _unwrap(x, strict: bool, name: str):
    if isinstance(x, StandInTensor):
        return x._payload
    if isinstance(x, torch.Tensor):
        if strict and x.dim() > 0:
            raise HostTensorError(
                f"{name}: a host tensor of shape {tuple(x.shape)} met a {DEVICE} tensor; move it to the device"
            )
        return x
    if isinstance(x, (list, tuple)):
        return type(x)(_unwrap(y, strict, name) for y in x)
    if isinstance(x, torch.device) and x.type == DEVICE:
        return torch.device("cpu")
    return x


def _index_of(args, kwargs) -> int:
    for a in list(args) + list(kwargs.values()):
        if isinstance(a, StandInTensor):
            return a.device.index or 0
        if isinstance(a, (list, tuple)):
            for y in a:
                if isinstance(y, StandInTensor):
                    return y.device.index or 0
    return 0


def _run(func, args, kwargs):
    for hook in op_hooks:
        hook(func, args, kwargs)
    name = func._opname
    if func.namespace == "c10d":  # a collective of another backend (gloo, say) was handed device tensors
        raise HostTensorError(f"c10d.{name}: {DEVICE} tensors can only go through the {DEVICE} backend's groups")
    strict = name not in _COPIES
    uargs = [_unwrap(a, strict, name) for a in args]
    ukwargs = {k: _unwrap(v, strict, name) for k, v in kwargs.items()}
    index = _index_of(args, kwargs)
    if kwargs.get("device") is not None:
        target = torch.device(kwargs["device"])
        ukwargs["device"] = torch.device("cpu")
        if target.type == "cpu":  # a copy to the host: the result is a plain CPU tensor
            return func(*uargs, **ukwargs)
        index = target.index or 0
    out = func(*uargs, **ukwargs)
    # an in-place or out= operator returns its own argument: give back the wrapper, not the payload
    mine = {id(u): a for a, u in zip(args, uargs) if isinstance(a, StandInTensor)}
    mine.update({id(ukwargs[k]): v for k, v in kwargs.items() if isinstance(v, StandInTensor)})

    def wrap(o):
        if isinstance(o, torch.Tensor):
            same = mine.get(id(o))
            return same if same is not None else StandInTensor(o, index)
        if isinstance(o, (list, tuple)):
            return type(o)(wrap(y) for y in o)
        return o

    return wrap(out)


def _fallback(op, *args, **kwargs):  # factories (torch.empty(..., device="standin")) arrive here
    return _run(op, args, kwargs)


# ---- the collective backend ------------------------------------------------------------------------


def _payloads(tensors, what: str) -> list[torch.Tensor]:
    out = []
    for t in tensors:
        if not isinstance(t, StandInTensor):
            raise HostTensorError(
                f"{DEVICE} backend: {what} was given a tensor on {t.device}; collectives of this group take "
                f"only {DEVICE} tensors"
            )
        out.append(t._payload)
    return out


class StandInProcessGroup(dist.ProcessGroup):
    """gloo underneath, on the payloads; anything not on the ``standin`` device is refused."""

    def __init__(self, store, rank: int, size: int, timeout):
        super().__init__(rank, size)
        self._gloo = dist.ProcessGroupGloo(store, rank, size, timeout)

    def rank(self) -> int:
        return self._gloo.rank()

    def size(self) -> int:
        return self._gloo.size()

    def getBackendName(self) -> str:  # noqa: N802 - torch's name
        return DEVICE

    # torch keeps a group's name in its C++ backends, which a Python group has none of
    def _set_group_name(self, name: str) -> None:
        self._name = name

    @property
    def group_name(self) -> str:
        return self._name

    def allreduce(self, tensors, opts):
        return self._gloo.allreduce(_payloads(tensors, "all_reduce"), opts)

    def broadcast(self, tensors, opts):
        return self._gloo.broadcast(_payloads(tensors, "broadcast"), opts)

    def allgather(self, outputs, inputs, opts):
        return self._gloo.allgather([_payloads(o, "all_gather") for o in outputs], _payloads(inputs, "all_gather"), opts)

    def all_gather_single(self, out, inp, opts):
        return self._gloo._allgather_base(*_payloads([out, inp], "all_gather_single"), opts)

    _allgather_base = all_gather_single

    def reduce_scatter_single(self, out, inp, opts):
        return self._gloo._reduce_scatter_base(*_payloads([out, inp], "reduce_scatter_single"), opts)

    _reduce_scatter_base = reduce_scatter_single

    def alltoall_base(self, out, inp, out_splits, in_splits, opts):
        return self._gloo.alltoall_base(*_payloads([out, inp], "all_to_all_single"), out_splits, in_splits, opts)

    def send(self, tensors, dst: int, tag: int):
        return self._gloo.send(_payloads(tensors, "send"), dst, tag)

    def recv(self, tensors, src: int, tag: int):
        return self._gloo.recv(_payloads(tensors, "recv"), src, tag)

    def barrier(self, opts):
        return self._gloo.barrier(opts)


def install() -> None:
    """Register the ``standin`` device and the ``standin`` process-group backend in this process."""
    global _installed
    if _installed:
        return
    from torch.utils.backend_registration import _setup_privateuseone_for_python_backend

    _setup_privateuseone_for_python_backend(DEVICE)
    library = torch.library.Library("_", "IMPL")
    library.fallback(_fallback, "PrivateUse1")
    # torch.tensor(data, device=...) copies in with the Python key excluded, and the generic fallback
    # cannot serve that copy_: it gets a kernel of its own
    _aten = torch.library.Library("aten", "IMPL")
    _aten.impl("copy_", lambda dst, src, non_blocking=False: _run(torch.ops.aten.copy_.default, (dst, src),
                                                                   {"non_blocking": non_blocking}), "PrivateUse1")
    _libraries.extend([library, _aten])
    dist.Backend.register_backend(DEVICE, StandInProcessGroup, devices=[DEVICE])
    _installed = True

