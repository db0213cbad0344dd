"""Host-to-device staging for stage-3 gathers: host shards reach the compute device through a few reusable
(pinned) host buffers, copied on a stream of their own.

A stage-3 gather sends this rank's shard of each parameter in the compute dtype.  Where the shard already
is what is sent, nothing is copied:

* a shard on the compute device, in the compute dtype, is sent as it is;
* with the CPU as the compute device, a host shard is cast with ``.to(dtype)``, which is the partition
  itself when the dtype already matches;
* on an accelerator, a host shard already in the compute dtype in pinned memory is copied to the device
  straight from the partition (``non_blocking``).

Any other host shard on an accelerator (an fp32 master while the model computes in bf16, a shard read
from the swap files, an unpinned partition) is cast into one of :class:`HostStaging`'s host buffers (two by
default, used in turn, each grown when a larger shard comes and pinned through the accelerator), then
copied to the device with ``non_blocking=True``.  Several shards sent together are packed into one buffer
side by side and go over in one copy.

Every copy runs on the staging's own copy stream, so it is queued behind other copies only, not behind the
compute stream's kernels.  After a copy the staging records an event on the copy stream: the compute
stream waits on it (a device-side wait: the host never blocks for the tensor to arrive), and the buffer's
fence keeps it so that the host waits on it only before filling that buffer again, which with two buffers
is a copy two gathers old and long finished.  The tensor on the device is allocated on the copy stream and
marked as used by the compute stream (``Accelerator.record_stream``), so its memory is not handed to the
copy stream again while compute kernels still read it.

On the CPU the accelerator's streams and events are no-ops: the same code runs, and every wait returns at
once.  :class:`BufferFence` keeps a log of its records and waits for tests.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch


class BufferFence:
    """The last copy out of one host buffer (or out of pinned partitions): ``record(stream)`` notes an event
    recorded on ``stream`` after the copy, ``wait()`` blocks the host until that copy has finished, and only
    if one was recorded since the last wait.

    With ``log`` (a list), every ``record()`` and ``wait()`` is appended to it as ``("record", n)`` or
    ``("wait", n)``, ``n`` being the number of records so far; ``host_waits`` counts the waits that blocked.
    """

    def __init__(self, accelerator: Any = None, log: list | None = None, name: str = ""):
        self.accelerator = accelerator
        self.log = log
        self.name = name
        self.records = 0
        self.waits = 0
        self.host_waits = 0
        self.events: list = []  # recorded and not waited for

    @property
    def pending(self) -> bool:
        """Whether a copy was recorded and not waited for since."""
        return self.records > self.waits

    def record(self, event: Any = None) -> None:
        if event is not None:
            self.events.append(event)
        self.records += 1
        if self.log is not None:
            self.log.append(("record", self.name, self.records) if self.name else ("record", self.records))

    def wait(self) -> None:
        # all on one stream, in order: the newest covers the others; one known finished needs no wait
        if self.pending:
            if self.events and not self.events[-1].query():
                self.events[-1].synchronize()
                self.host_waits += 1
            self.waits = self.records
        self.events = []
        if self.log is not None:
            self.log.append(("wait", self.name, self.records) if self.name else ("wait", self.records))

    def settled(self) -> None:
        """A later event on the same stream was waited for: this fence's copies are finished too."""
        self.waits = self.records
        self.events = []


def accelerator_for(device: torch.device) -> Any:
    """rayzero's accelerator for ``device``'s kind: the one this process trains on when its tensors live
    there (a plugin named as ``module:attribute`` too), else the one registered under the kind's name, else
    None."""
    from rayzero.accelerator import get_accelerator

    try:
        mine = get_accelerator()
        if mine.device().type == device.type:
            return mine
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
    """Moves host shards to ``device`` in ``dtype`` through ``buffers`` reusable host buffers, used in turn,
    on a copy stream of its own (module docstring).

    ``through_buffer`` (default: only when ``device`` is not the CPU) sends host shards through the buffers
    even to a CPU device; ``fences`` replaces the buffers' fences (one per buffer; their number is then the
    number of buffers).  ``accelerator`` is rayzero's accelerator for ``device`` (looked up by the device's
    kind when not given); it pins the buffers and gives the streams and events.
    """

    def __init__(self, device: torch.device | str, dtype: torch.dtype, accelerator: Any = None, *,
                 through_buffer: bool | None = None, buffers: int = 2, fences: Sequence[BufferFence] | None = None):
        self.device = torch.device(device)
        self.dtype = dtype
        on_host = self.device.type == "cpu"
        if accelerator is None:
            accelerator = accelerator_for(self.device)
        self.accelerator = accelerator
        self.through_buffer = (not on_host) if through_buffer is None else through_buffer
        # pinning only speeds up copies to an accelerator (a CPU staging asked to pin gets it too: tests)
        self.pin = not on_host or (accelerator is not None and self.through_buffer)
        if fences is None:
            fences = [BufferFence(accelerator) for _ in range(max(1, buffers))]
        self.fences = list(fences)
        self.buffers = [torch.empty(0, dtype=dtype) for _ in self.fences]  # grown on demand
        self.turn = 0  # the buffer the next stage fills
        self.direct = BufferFence(accelerator)  # copies straight out of pinned partitions
        self.copy_stream = accelerator.stream(self.device.index) if accelerator is not None else None
        self._newest: BufferFence | None = None  # the fence of the last copy
        self.grown = 0  # times a buffer was (re)allocated
        self.sends = 0  # copies to the device (through a buffer or straight from a pinned partition)

    @property
    def buffer(self) -> torch.Tensor:
        """The buffer filled last."""
        return self.buffers[(self.turn - 1) % len(self.buffers)]

    # ---- the host side, the same on every device ------------------------------------------------------------
    def _reserve(self, index: int, numel: int) -> torch.Tensor:
        if self.buffers[index].numel() < numel:
            # its fence was waited on: no copy reads the old buffer any more
            buf = torch.empty(numel, dtype=self.dtype)
            if self.pin:
                buf = self._pinned(buf)
            self.buffers[index] = buf
            self.grown += 1
        return self.buffers[index][:numel]

    def _pinned(self, buf: torch.Tensor) -> torch.Tensor:
        if self.accelerator is not None:
            return self.accelerator.pin_memory(buf)
        try:  # a device kind without a rayzero accelerator: torch's own pinning, where it has one
            return buf.pin_memory()
        except RuntimeError:
            self.pin = False  # copies from pageable memory then: correct, only slower
            return buf

    def _is_pinned(self, t: torch.Tensor) -> bool:
        if self.accelerator is not None:
            return self.accelerator.is_pinned(t)
        return t.is_pinned()

    def stage(self, shards: Sequence[torch.Tensor]) -> torch.Tensor:
        """Take the next buffer in turn, wait until no copy reads it (a copy ``len(buffers)`` stages old), then
        cast ``shards`` into it side by side; returns the filled part of the buffer (1-D, ``dtype``, on the
        host), valid until the buffer's turn comes again."""
        index = self.turn
        self.turn = (self.turn + 1) % len(self.buffers)
        self.fences[index].wait()
        self._filled = index
        return _pack_into(self._reserve(index, sum(s.numel() for s in shards)), shards)

    def _send(self, host: torch.Tensor, fence: BufferFence) -> torch.Tensor:
        """Copy ``host`` (a buffer, or a pinned partition) to the device on the copy stream; the compute stream
        waits on the copy's event, ``fence`` keeps it for the host."""
        acc = self.accelerator
        pinned = self._is_pinned(host)
        if acc is None:  # a device kind without streams rayzero knows: torch's generic event on its stream
            out = torch.empty(host.shape, dtype=self.dtype, device=self.device)
            out.copy_(host, non_blocking=pinned)
            event = torch.Event(device=self.device)
            event.record()
            fence.record(event)
            self._newest = fence
            self.sends += 1
            return out
        compute = acc.current_stream(self.device.index)
        with acc.stream_context(self.copy_stream):
            # allocated on the copy stream, which writes it; the compute stream reads it after the event
            out = torch.empty(host.shape, dtype=self.dtype, device=self.device)
            out.copy_(host, non_blocking=pinned)
            event = acc.Event()
            event.record(self.copy_stream)
        compute.wait_event(event)
        acc.record_stream(out, compute)
        fence.record(event)
        self._newest = fence
        self.sends += 1
        return out

    # ---- what gathers call ----------------------------------------------------------------------------------
    def to_device(self, src: torch.Tensor) -> torch.Tensor:
        """``src`` on the device in ``dtype``: ``src`` itself, a cast of it, or a copy through a buffer."""
        if _same_device(src, self.device) and not (self.through_buffer and src.device.type == "cpu"):
            return src.to(self.dtype)  # on its device already (or the CPU computes): the shard itself
        if src.device.type != "cpu":  # another device: nothing to stage on the host
            return src.to(device=self.device, dtype=self.dtype)
        if src.dtype == self.dtype and src.is_contiguous() and self._is_pinned(src):
            return self._send(src, self.direct)  # the partition itself is the copy's source
        host = self.stage([src])
        return self._send(host, self.fences[self._filled]).view(src.shape)

    def pack(self, shards: Sequence[torch.Tensor]) -> torch.Tensor:
        """The concatenation of the flattened ``shards`` on the device in ``dtype``: host shards packed in a
        buffer and copied over at once, shards already on the device copied into place there."""
        host = [s.device.type == "cpu" for s in shards]
        if shards and all(host) and (self.through_buffer or self.device.type != "cpu"):
            staged = self.stage(shards)
            return self._send(staged, self.fences[self._filled])
        return _pack_into(torch.empty(sum(s.numel() for s in shards), dtype=self.dtype, device=self.device), shards)

    def synchronize(self) -> None:
        """Wait until no copy to the device reads host memory (a buffer or a partition) any more: one host
        wait, on the newest copy's fence (the copy stream runs its copies in order), when any is pending."""
        fences = self.fences + [self.direct]
        if self._newest is not None and self._newest.pending:
            self._newest.wait()
        for fence in fences:
            fence.settled()

    @property
    def host_waits(self) -> int:
        return sum(f.host_waits for f in self.fences) + self.direct.host_waits
