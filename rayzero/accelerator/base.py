"""The Accelerator protocol: everything rayzero asks of a device kind, in one place.

Engine, ZeRO stages, offload and the node agent talk to the device only through
this class, so adding a device kind means writing one subclass and registering it
(see ``rayzero.accelerator.register_accelerator``), not editing every call site.
"""

from __future__ import annotations

import abc
from contextlib import AbstractContextManager
from typing import Any, Protocol, runtime_checkable

import torch


@runtime_checkable
class StreamLike(Protocol):
    """What rayzero uses of a stream (``torch.cuda.Stream`` satisfies it)."""

    def synchronize(self) -> None: ...

    def wait_stream(self, stream: Any) -> None: ...

    def wait_event(self, event: Any) -> None: ...

    def record_event(self, event: Any = None) -> Any: ...

    def query(self) -> bool: ...


@runtime_checkable
class EventLike(Protocol):
    """What rayzero uses of an event (``torch.cuda.Event`` satisfies it)."""

    def record(self, stream: Any = None) -> None: ...

    def wait(self, stream: Any = None) -> None: ...

    def synchronize(self) -> None: ...

    def query(self) -> bool: ...

    def elapsed_time(self, end_event: Any) -> float: ...


class Accelerator(abc.ABC):
    """One device kind (``cpu``, ``cuda``, ...) as rayzero sees it.

    Memory figures are in bytes and describe what *this process* may use on its
    device, which is what planning (bucket sizes, offload decisions) needs.
    """

    #: Short name used by the registry and in configs: "cpu", "cuda".
    name: str = ""

    # ---- devices -------------------------------------------------------------------

    @abc.abstractmethod
    def device(self, index: int | None = None) -> torch.device:
        """The ``torch.device`` for ``index`` (the current device when ``None``)."""

    @abc.abstractmethod
    def device_count(self) -> int:
        """Number of devices of this kind visible to the process."""

    @abc.abstractmethod
    def current_device_index(self) -> int:
        """Index of the device new tensors go to by default."""

    @abc.abstractmethod
    def set_device(self, index: int) -> None:
        """Make ``index`` the current device (call once per worker, with its local rank)."""

    @abc.abstractmethod
    def synchronize(self, index: int | None = None) -> None:
        """Block until all queued work on the device has finished."""

    # ---- streams and events ----------------------------------------------------------

    @abc.abstractmethod
    def stream(self, index: int | None = None) -> StreamLike:
        """Create a new side stream, e.g. for overlapping communication with compute."""

    @abc.abstractmethod
    def current_stream(self, index: int | None = None) -> StreamLike:
        """The stream kernels are queued on right now."""

    @abc.abstractmethod
    def stream_context(self, stream: StreamLike | None) -> AbstractContextManager[Any]:
        """Context manager that makes ``stream`` current inside the ``with`` block."""

    @abc.abstractmethod
    def Event(self, enable_timing: bool = False) -> EventLike:  # noqa: N802 - mirrors torch.cuda.Event
        """Create an event for ordering streams and (optionally) timing."""

    # ---- memory ----------------------------------------------------------------------

    @abc.abstractmethod
    def pin_memory(self, tensor: torch.Tensor) -> torch.Tensor:
        """Page-locked copy of a host tensor for fast async device copies (or the tensor itself)."""

    def is_pinned(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor`` is host memory that :meth:`pin_memory` pinned (a device copy from it may be
        ``non_blocking``)."""
        return tensor.device.type == "cpu" and tensor.is_pinned()

    def record_stream(self, tensor: torch.Tensor, stream: StreamLike) -> None:
        """Mark ``tensor`` (allocated on another stream) as used by ``stream``: its memory is not reused
        before the work queued on ``stream`` so far has finished.  Devices without streams: nothing to do."""
        if tensor.device.type != "cpu":
            tensor.record_stream(stream)

    @abc.abstractmethod
    def total_memory(self, index: int | None = None) -> int:
        """The most memory this process may use on the device, in bytes."""

    @abc.abstractmethod
    def available_memory(self, index: int | None = None) -> int:
        """Memory this process can still allocate on the device right now, in bytes."""

    @abc.abstractmethod
    def memory_allocated(self, index: int | None = None) -> int:
        """Bytes currently held by tensors (see subclass docs for what is counted)."""

    @abc.abstractmethod
    def max_memory_allocated(self, index: int | None = None) -> int:
        """Peak of :meth:`memory_allocated` since start or the last reset."""

    @abc.abstractmethod
    def reset_peak_memory_stats(self, index: int | None = None) -> None:
        """Restart peak tracking from the current usage."""

    # ---- capabilities ------------------------------------------------------------------

    @abc.abstractmethod
    def communication_backend(self) -> str:
        """The ``torch.distributed`` backend for tensors on this device ("gloo", "nccl")."""

    @abc.abstractmethod
    def is_bf16_supported(self) -> bool:
        """Whether bfloat16 compute works on this device."""

    @abc.abstractmethod
    def is_fp16_supported(self) -> bool:
        """Whether float16 compute works on this device."""

    @abc.abstractmethod
    def supports_fused_optimizer(self) -> bool:
        """Whether torch optimizers accept ``fused=True`` for tensors on this device."""

    def supports_graph_capture(self) -> bool:
        """Whether the engine may capture and replay work as graphs here: the registry
        (``rayzero.accelerator.graphs``) declares this device kind's capture working.  Subclasses add
        what the process itself needs (a compiler, a driver feature)."""
        from rayzero.accelerator.graphs import capture_support

        return capture_support(self.name).enabled

    # ---- graph capture (rayzero.accelerator.graphs has the contract) -----------------------------

    def create_graph(self) -> Any:
        """A new, empty graph to capture into."""
        from rayzero.accelerator.graphs import capture_off_error

        raise capture_off_error(self.name)

    def capture_to_graph(self, graph: Any, pool: Any = None, stream: Any = None) -> AbstractContextManager[Any]:
        """Context manager that records into ``graph``; it yields a recorder with ``record(fn, *args)``.
        ``pool``: a memory pool shared with another graph (where the device has pools); ``stream``:
        the stream to capture on (where it has streams)."""
        from rayzero.accelerator.graphs import capture_off_error

        raise capture_off_error(self.name)

    def replay_graph(self, graph: Any) -> None:
        """Run the work recorded in ``graph``."""
        from rayzero.accelerator.graphs import capture_off_error

        raise capture_off_error(self.name)

    # ---- randomness and determinism --------------------------------------------------

    @abc.abstractmethod
    def manual_seed(self, seed: int) -> None:
        """Seed the device's random generator(s)."""

    @abc.abstractmethod
    def get_rng_state(self, index: int | None = None) -> torch.Tensor:
        """The device generator's state (a CPU ``ByteTensor``), for checkpoints."""

    @abc.abstractmethod
    def set_rng_state(self, state: torch.Tensor, index: int | None = None) -> None:
        """Restore a state returned by :meth:`get_rng_state`."""

    def set_deterministic(self, enabled: bool) -> None:
        """Switch deterministic kernels on or off.

        The device-independent part lives here (torch's global switch, which makes
        nondeterministic ops raise instead of silently varying); subclasses add their
        device's own knobs and call ``super()``.
        """
        torch.use_deterministic_algorithms(enabled)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r})"
