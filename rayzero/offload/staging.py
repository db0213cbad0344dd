"""Host-to-device staging for stage-3 gathers: host shards reach the compute device through one reusable
(pinned) host buffer.

A stage-3 gather sends this rank's shard of each parameter in the compute dtype.  Where the shard already
is what is sent, nothing is copied:

* a shard on the compute device, in the compute dtype, is sent as it is;
* with the CPU as the compute device, a host shard is cast with ``.to(dtype)``, which is the partition
  itself when the dtype already matches;
* on an accelerator, a host shard already in the compute dtype in pinned memory is copied to the device
  straight from the partition (``non_blocking``).

Any other host shard on an accelerator (an fp32 master while the model computes in bf16, a shard read
from the swap files, an unpinned partition) is cast into :class:`HostStaging`'s one host buffer (grown when
a larger shard comes, pinned through the accelerator), then copied to the device with ``non_blocking=True``.
Several shards sent together are packed into that buffer side by side and go over in one copy.  After each
copy the staging records a fence (an event on the device's current stream); the next use of the buffer
first waits on it, so the buffer is never overwritten while a copy still reads it.

The host half of this (wait on the fence, cast into the buffer) is one function, :meth:`HostStaging.stage`,
on every device; on the CPU its fence is :class:`HostFence`, whose wait has nothing to wait for (host copies
are done when they return) but which keeps a log of its records and waits.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch


class HostFence:
    """The fence of host-side copies: they are finished when they return, so waiting is immediate.

    With ``log`` (a list), every ``record()`` and ``wait()`` is appended to it as ``("record", n)`` or
    ``("wait", n)``, ``n`` being the number of records so far: the order the staging used its buffer in.
    """

    def __init__(self, log: list | None = None):
        self.log = log
        self.records = 0
        self.waits = 0

    @property
    def pending(self) -> bool:
        """Whether a copy was recorded and not waited for since."""
        return self.records > self.waits

    def record(self) -> None:
        self.records += 1
        if self.log is not None:
            self.log.append(("record", self.records))

    def wait(self) -> None:
        if self.pending:
            self.waits = self.records
        if self.log is not None:
            self.log.append(("wait", self.records))


class DeviceFence(HostFence):
    """Events on the device's current stream, one recorded after each copy out of host memory; ``wait()``
    blocks the host until every copy recorded since the last wait has finished."""

    def __init__(self, device: torch.device, accelerator: Any = None, log: list | None = None):
        super().__init__(log)
        self.device = device
        self.accelerator = accelerator
        self.events: list = []  # one per copy: the copies may have been queued on different streams

    def record(self) -> None:
        if self.accelerator is not None:
            event = self.accelerator.Event()
            event.record(self.accelerator.current_stream(self.device.index))
        else:  # a device kind without a rayzero accelerator: torch's generic event
            event = torch.Event(device=self.device)
            event.record()
        self.events = [e for e in self.events if not e.query()]  # finished: nothing left to wait for
        self.events.append(event)
        super().record()

    def wait(self) -> None:
        for event in self.events:
            event.synchronize()
        self.events = []
        super().wait()


def _accelerator_for(device: torch.device) -> Any:
    """rayzero's accelerator for ``device``'s kind, or None when no accelerator of that name is registered."""
    from rayzero.accelerator import get_accelerator

    try:
        return get_accelerator(device.type)
    except ValueError:
        return None


def _pack_into(out: torch.Tensor, shards: Sequence[torch.Tensor]) -> torch.Tensor:
    """Copy the flattened ``shards`` side by side into ``out`` (cast to its dtype); returns ``out``."""
    offset = 0
    for s in shards:
        n = s.numel()
        out[offset : offset + n].copy_(s.reshape(-1))
        offset += n
    return out


def _same_device(t: torch.Tensor, device: torch.device) -> bool:
    if t.device.type != device.type:
        return False
    return device.index is None or t.device.index is None or t.device.index == device.index


class HostStaging:
    """Moves host shards to ``device`` in ``dtype`` through one reusable host buffer (module docstring).

    ``through_buffer`` (default: only when ``device`` is not the CPU) sends host shards through the buffer
    even to a CPU device; ``fence`` replaces the fence the device kind gets (:class:`HostFence` on the CPU,
    :class:`DeviceFence` elsewhere).  ``accelerator`` is rayzero's accelerator for ``device`` (looked up by
    the device's kind when not given); it pins the buffer and makes the fence's events.
    """

    def __init__(self, device: torch.device | str, dtype: torch.dtype, accelerator: Any = None, *,
                 through_buffer: bool | None = None, fence: HostFence | None = None):
        self.device = torch.device(device)
        self.dtype = dtype
        on_host = self.device.type == "cpu"
        if accelerator is None and not on_host:
            accelerator = _accelerator_for(self.device)
        self.accelerator = accelerator
        self.through_buffer = (not on_host) if through_buffer is None else through_buffer
        # pinning only speeds up copies to an accelerator
        self.pin = not on_host
        self.fence = fence if fence is not None else (HostFence() if on_host else DeviceFence(self.device, accelerator))
        self.buffer = torch.empty(0, dtype=dtype)  # the one host buffer, grown on demand
        self.grown = 0  # times the buffer was (re)allocated
        self.sends = 0  # copies to the device (through the buffer or straight from a pinned partition)

    # ---- the host side, the same on every device ------------------------------------------------------------
    def _reserve(self, numel: int) -> torch.Tensor:
        if self.buffer.numel() < numel:
            # the fence was waited on: no copy reads the old buffer any more
            buf = torch.empty(numel, dtype=self.dtype)
            if self.pin:
                buf = self._pinned(buf)
            self.buffer = buf
            self.grown += 1
        return self.buffer[:numel]

    def _pinned(self, buf: torch.Tensor) -> torch.Tensor:
        if self.accelerator is not None:
            return self.accelerator.pin_memory(buf)
        try:  # a device kind without a rayzero accelerator: torch's own pinning, where it has one
            return buf.pin_memory()
        except RuntimeError:
            self.pin = False  # copies from pageable memory then: correct, only slower
            return buf

    def stage(self, shards: Sequence[torch.Tensor]) -> torch.Tensor:
        """Wait until no copy reads the buffer, then cast ``shards`` into it side by side; returns the filled
        part of the buffer (1-D, ``dtype``, on the host), valid until the next ``stage``."""
        self.fence.wait()
        return _pack_into(self._reserve(sum(s.numel() for s in shards)), shards)

    def _send(self, host: torch.Tensor) -> torch.Tensor:
        """Copy ``host`` (the buffer, or a pinned partition) to the device, and fence the copy."""
        out = torch.empty(host.shape, dtype=self.dtype, device=self.device)
        out.copy_(host, non_blocking=host.is_pinned())
        self.fence.record()
        self.sends += 1
        return out

    # ---- what gathers call ----------------------------------------------------------------------------------
    def to_device(self, src: torch.Tensor) -> torch.Tensor:
        """``src`` on the device in ``dtype``: ``src`` itself, a cast of it, or a copy through the buffer."""
        if _same_device(src, self.device) and not (self.through_buffer and src.device.type == "cpu"):
            return src.to(self.dtype)  # on its device already (or the CPU computes): the shard itself
        if src.device.type != "cpu":  # another device: nothing to stage on the host
            return src.to(device=self.device, dtype=self.dtype)
        if src.dtype == self.dtype and src.is_contiguous() and src.is_pinned():
            return self._send(src)  # the partition itself is the copy's source
        return self._send(self.stage([src])).view(src.shape)

    def pack(self, shards: Sequence[torch.Tensor]) -> torch.Tensor:
        """The concatenation of the flattened ``shards`` on the device in ``dtype``: host shards packed in
        the buffer and copied over at once, shards already on the device copied into place there."""
        host = [s.device.type == "cpu" for s in shards]
        if shards and all(host) and (self.through_buffer or self.device.type != "cpu"):
            return self._send(self.stage(shards))
        return _pack_into(torch.empty(sum(s.numel() for s in shards), dtype=self.dtype, device=self.device), shards)

    def synchronize(self) -> None:
        """Wait until no copy to the device reads host memory (the buffer or a partition) any more."""
        self.fence.wait()
