"""Count what would make a GPU's host wait for the device (a *host sync*), and say where each came from.

On an accelerator these operations block the calling thread until the device has run everything queued
before them:

* a scalar read: ``.item()``, ``bool()`` / ``float()`` / ``int()`` of a tensor (``aten._local_scalar_dense``);
* ``.tolist()`` (a device-to-host copy of the whole tensor);
* operators whose output shape depends on the values: ``nonzero``, indexing with a boolean mask (reading
  or writing), ``masked_select``, ``unique*``, ``repeat_interleave`` with tensor repeats and no
  ``output_size``, ``bincount`` (sized by the input's maximum), ``equal``;
* a copy between host and device with ``non_blocking=False`` (torch's blocking copies wait for the stream
  in both directions).

Two scopes:

* ``SyncCounter("device")`` counts operations on tensors of the ``standin`` device (tests/standin_device.py),
  which shows every operator on its tensors to ``standin_device.op_hooks``.  Host tensors are the host's
  business there: only what crosses to or waits on the device counts, as on a GPU.
* ``SyncCounter("all")`` is for the CPU-storage stand-in accelerator (``device_cases.StandInAccelerator``),
  where ZeRO stage 3 runs (the ``standin`` device cannot resize storages).  Every tensor lives on the host
  there, so it counts the scalar reads, ``tolist`` and value-dependent shapes of *all* tensors, through a
  torch dispatch mode; copies between host and device cannot be told apart and are not counted.

Each counted sync records its kind and a short stack summary (the innermost rayzero frames, else the
innermost frames outside torch), so a failing assertion names the line to fix.
"""

from __future__ import annotations

import collections
import os
import traceback
from dataclasses import dataclass

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

import standin_device

aten = torch.ops.aten

_DATA_DEPENDENT = {
    aten.nonzero.default: "nonzero",
    aten.masked_select.default: "masked_select",
    aten._unique.default: "unique",
    aten._unique2.default: "unique",
    aten.unique_dim.default: "unique",
    aten.unique_consecutive.default: "unique_consecutive",
    aten.unique_dim_consecutive.default: "unique_consecutive",
    aten.bincount.default: "bincount (its size reads the input's maximum)",
    aten.equal.default: "equal (a host bool)",
}
_INDEXING = {aten.index.Tensor, aten.index_put.default, aten.index_put_.default, aten._index_put_impl_.default}
_COPIES = {aten._to_copy.default, aten.copy_.default, aten._copy_from.default, aten._copy_from_and_resize.default}
_HERE = (os.path.abspath(__file__), os.path.abspath(standin_device.__file__))


@dataclass(frozen=True)
class Sync:
    kind: str
    where: str  # innermost caller first: "rayzero/moe/dispatch.py:93 expert_parallel_apply <- ..."

    def __str__(self) -> str:
        return f"{self.kind} at {self.where}"


def _where(frames: int = 3) -> str:
    stack = [f for f in traceback.extract_stack() if os.path.abspath(f.filename) not in _HERE]
    outside_torch = [f for f in stack if f"{os.sep}torch{os.sep}" not in f.filename]
    ours = [f for f in outside_torch if f"{os.sep}rayzero{os.sep}" in f.filename]
    picked = ours[::-1][:frames]
    if outside_torch and (not ours or outside_torch[-1] is not ours[-1]):
        picked = [outside_torch[-1]] + picked[: frames - 1]  # a model's (or the test's) own line first

    def short(f) -> str:
        path = f.filename
        cut = max(path.rfind(f"{os.sep}rayzero{os.sep}"), path.rfind(f"{os.sep}transformers{os.sep}"))
        path = path[cut + 1:] if cut >= 0 else os.path.basename(path)
        return f"{path}:{f.lineno} {f.name}"

    # no Python caller: an operator run by autograd's engine (a backward formula) on its device thread
    return " <- ".join(short(f) for f in picked) or "autograd's backward (no Python caller)"


def _is_bool_index(indices) -> bool:
    return any(isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8) for i in indices or ())


def classify(func, args, kwargs, counts) -> str | None:
    """What sync ``func(*args, **kwargs)`` is, or None; ``counts(t)`` says whether tensor ``t`` is in scope.
    Copies are classified only by the device scope (``counts`` is then "on the device")."""
    tensors = [a for a in list(args) + list(kwargs.values()) if isinstance(a, torch.Tensor)]
    if func is aten._local_scalar_dense.default:
        return "scalar read (.item() / bool() / float() / int())" if counts(args[0]) else None
    if not any(counts(t) for t in tensors) and func not in _COPIES:
        return None
    if func in _DATA_DEPENDENT:
        return _DATA_DEPENDENT[func]
    if func is aten.repeat_interleave.Tensor and kwargs.get("output_size") is None and (
            len(args) < 2 or args[-1] is None):
        return "repeat_interleave with tensor repeats and no output_size"
    if func in _INDEXING:
        indices = args[1] if len(args) > 1 else kwargs.get("indices")
        if _is_bool_index(indices):
            return "indexing with a boolean mask"
    return None


def classify_copy(func, args, kwargs, on_device) -> str | None:
    """A blocking copy between host and device (``on_device(t)``: whether ``t`` is a device tensor)."""
    if func not in _COPIES:
        return None
    if func is aten._to_copy.default:
        src = args[0]
        target = kwargs.get("device")
        if target is None:
            return None
        dst_device = torch.device(target).type != "cpu"
        non_blocking = kwargs.get("non_blocking", False)
    else:
        dst, src = args[0], args[1]
        dst_device = on_device(dst)
        non_blocking = kwargs.get("non_blocking", args[2] if len(args) > 2 else False)
    if on_device(src) == dst_device or non_blocking:
        return None
    return "blocking copy device->host" if on_device(src) else "blocking copy host->device"


class _AllTensors(TorchDispatchMode):
    def __init__(self, counter: "SyncCounter"):
        super().__init__()
        self.counter = counter

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        kind = classify(func, args, kwargs, lambda t: True)
        if kind is not None:
            self.counter.record(kind)
        return func(*args, **kwargs)


class _ToList(TorchFunctionMode):  # .tolist() reads the data without an operator
    def __init__(self, counter: "SyncCounter"):
        super().__init__()
        self.counter = counter

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is torch.Tensor.tolist:
            self.counter.record("tolist")
        return func(*args, **(kwargs or {}))


class SyncCounter:
    """``with SyncCounter(scope) as c: ...`` then ``c.syncs`` (see the module docstring for the scopes)."""

    def __init__(self, scope: str = "device"):
        if scope not in ("device", "all"):
            raise ValueError(f"scope must be 'device' or 'all', not {scope!r}")
        self.scope = scope
        self.syncs: list[Sync] = []
        self._modes: list = []

    def record(self, kind: str) -> None:
        self.syncs.append(Sync(kind, _where()))

    def _on_device_op(self, func, args, kwargs) -> None:
        if func == "tolist":
            self.record("tolist")
            return
        on_device = lambda t: isinstance(t, standin_device.StandInTensor)
        kind = classify(func, args, kwargs, on_device) or classify_copy(func, args, kwargs, on_device)
        if kind is not None:
            self.record(kind)

    def __enter__(self) -> "SyncCounter":
        if self.scope == "device":
            standin_device.op_hooks.append(self._on_device_op)
        else:
            self._modes = [_ToList(self), _AllTensors(self)]
            for m in self._modes:
                m.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        if self.scope == "device":
            standin_device.op_hooks.remove(self._on_device_op)
        else:
            for m in reversed(self._modes):
                m.__exit__(*exc)
            self._modes = []

    def __len__(self) -> int:
        return len(self.syncs)

    def summary(self) -> str:
        """One line per distinct sync, most frequent first: ``3 x kind at where``."""
        counted = collections.Counter(str(s) for s in self.syncs)
        return "\n".join(f"{n} x {s}" for s, n in counted.most_common()) or "no host syncs"
