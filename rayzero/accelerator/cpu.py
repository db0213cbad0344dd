"""CPU accelerator: host tensors, gloo, and memory limits that respect containers.

CPU work is synchronous, so streams and events are stand-ins that keep the
engine's overlap code path identical on CPU and GPU: a side stream is just
the one host thread, waiting is immediate, and events record wall-clock time.
"""

from __future__ import annotations

import contextlib
import resource
import sys
import time
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any, Iterator

import psutil
import torch

from rayzero.accelerator.base import Accelerator
from rayzero.accelerator.memory_limits import (
    DEFAULT_CGROUP_ROOT,
    DEFAULT_PROC_CGROUP,
    MemoryLimit,
    detect_memory_limit,
)

_PROC_STATUS = Path("/proc/self/status")
_PROC_CLEAR_REFS = Path("/proc/self/clear_refs")


class CpuStream:
    """A stream on the host: all work is already ordered, so every wait is a no-op."""

    def synchronize(self) -> None:
        pass

    def wait_stream(self, stream: Any) -> None:
        pass

    def wait_event(self, event: Any) -> None:
        pass

    def record_event(self, event: Any = None) -> CpuEvent:
        event = event if event is not None else CpuEvent()
        event.record(self)
        return event

    def query(self) -> bool:
        return True

    def __repr__(self) -> str:
        return "CpuStream()"


class CpuEvent:
    """An event on the host: completes when recorded; can time intervals like a CUDA event."""

    def __init__(self, enable_timing: bool = False) -> None:
        self.enable_timing = enable_timing
        self._recorded_at: float | None = None

    def record(self, stream: Any = None) -> None:
        self._recorded_at = time.perf_counter()

    def wait(self, stream: Any = None) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True

    def elapsed_time(self, end_event: CpuEvent) -> float:
        """Milliseconds from this event to ``end_event``, as ``torch.cuda.Event`` reports it."""
        if not (self.enable_timing and end_event.enable_timing):
            raise RuntimeError(
                "elapsed_time needs both events created with Event(enable_timing=True)"
            )
        if self._recorded_at is None or end_event._recorded_at is None:
            raise RuntimeError("elapsed_time needs both events recorded first; call record() on each")
        return (end_event._recorded_at - self._recorded_at) * 1000.0


def _proc_status_kib(field: str) -> int | None:
    try:
        for line in _PROC_STATUS.read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


class CpuAccelerator(Accelerator):
    """Host CPU as the training device.

    Memory figures are process-level, because the host has no allocator of its own
    to ask: ``memory_allocated`` is the resident set size (RSS) and
    ``max_memory_allocated`` the peak RSS; both include Python, libraries and
    non-tensor data, not only tensors.
    """

    name = "cpu"

    def __init__(
        self,
        cgroup_root: str = DEFAULT_CGROUP_ROOT,
        proc_cgroup: str = DEFAULT_PROC_CGROUP,
    ) -> None:
        self._cgroup_root = cgroup_root
        self._proc_cgroup = proc_cgroup
        self._stream = CpuStream()
        self._process = psutil.Process()

    # ---- devices -------------------------------------------------------------------

    def device(self, index: int | None = None) -> torch.device:
        # CPU tensors carry no index; every rank on a host shares the one "cpu" device.
        return torch.device("cpu")

    def device_count(self) -> int:
        return 1

    def current_device_index(self) -> int:
        return 0

    def set_device(self, index: int) -> None:
        # Accept any local rank so worker code can call set_device(local_rank) on every
        # accelerator; CPU ranks on one host share the same device.
        if not isinstance(index, int) or index < 0:
            raise ValueError(f"device index must be a non-negative int, got {index!r}")

    def synchronize(self, index: int | None = None) -> None:
        pass  # CPU kernels have finished by the time they return

    # ---- streams and events ----------------------------------------------------------

    def stream(self, index: int | None = None) -> CpuStream:
        return CpuStream()

    def current_stream(self, index: int | None = None) -> CpuStream:
        return self._stream

    def stream_context(self, stream: Any) -> AbstractContextManager[Any]:
        return _null_stream_context(stream)

    def Event(self, enable_timing: bool = False) -> CpuEvent:  # noqa: N802 - mirrors torch.cuda.Event
        return CpuEvent(enable_timing=enable_timing)

    # ---- memory ----------------------------------------------------------------------

    def pin_memory(self, tensor: torch.Tensor) -> torch.Tensor:
        # Pinning only speeds up host->GPU copies; without CUDA there is nothing to copy to,
        # and torch refuses to pin without a CUDA driver.
        if torch.cuda.is_available() and tensor.device.type == "cpu" and not tensor.is_pinned():
            return tensor.pin_memory()
        return tensor

    def record_stream(self, tensor: torch.Tensor, stream: Any) -> None:
        pass  # one host stream: memory is reused only after the work that read it

    def memory_limit(self) -> MemoryLimit:
        """Host RAM, cgroup and rlimit figures combined; ``source`` names the limit that won."""
        return detect_memory_limit(self._cgroup_root, self._proc_cgroup)

    def total_memory(self, index: int | None = None) -> int:
        return self.memory_limit().total_bytes

    def available_memory(self, index: int | None = None) -> int:
        return self.memory_limit().available_bytes

    def memory_allocated(self, index: int | None = None) -> int:
        """Resident set size of this process, in bytes."""
        return int(self._process.memory_info().rss)

    def max_memory_allocated(self, index: int | None = None) -> int:
        """Peak resident set size of this process, in bytes.

        Linux's ``VmHWM`` is read first because :meth:`reset_peak_memory_stats`
        can reset it; elsewhere ``getrusage().ru_maxrss`` is used (KiB on Linux,
        bytes on macOS), which cannot be reset.
        """
        peak = _proc_status_kib("VmHWM")
        if peak is None:
            maxrss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
            peak = maxrss if sys.platform == "darwin" else maxrss * 1024
        # A peak is never below the current usage, even if the counters lag.
        return max(peak, self.memory_allocated())

    def reset_peak_memory_stats(self, index: int | None = None) -> None:
        # Writing "5" to clear_refs resets VmHWM to the current RSS (Linux >= 4.0).
        # Where that is impossible the peak simply keeps counting from process start.
        with contextlib.suppress(OSError):
            _PROC_CLEAR_REFS.write_text("5")

    # ---- capabilities ------------------------------------------------------------------

    def communication_backend(self) -> str:
        return "gloo"

    def is_bf16_supported(self) -> bool:
        return True

    def is_fp16_supported(self) -> bool:
        # torch's CPU kernels cover float16 for training ops; fast fp16 needs
        # AVX512-FP16/AMX, but correctness does not.
        return True

    def supports_fused_optimizer(self) -> bool:
        # torch.optim Adam/AdamW/SGD accept fused=True for CPU tensors since torch 2.4.
        return True

    def supports_graph_capture(self) -> bool:
        from rayzero.accelerator.graphs import cpu_compiler_available

        return super().supports_graph_capture() and cpu_compiler_available()

    def _check_capture(self) -> None:
        from rayzero.accelerator.graphs import capture_off_error, cpu_compiler_available

        if not super().supports_graph_capture():
            raise capture_off_error(self.name)
        if not cpu_compiler_available():
            raise capture_off_error(self.name, "graph capture (no C++ compiler on PATH for inductor)")

    def create_graph(self) -> Any:
        from rayzero.accelerator.graphs import CompiledGraph

        self._check_capture()
        return CompiledGraph()

    def capture_to_graph(self, graph: Any, pool: Any = None, stream: Any = None) -> AbstractContextManager[Any]:
        from rayzero.accelerator.graphs import capture_compiled

        self._check_capture()
        return capture_compiled(graph)  # one host "stream", memory from the process heap: no pool

    def replay_graph(self, graph: Any) -> None:
        graph.replay()

    # ---- randomness and determinism --------------------------------------------------

    def manual_seed(self, seed: int) -> None:
        torch.manual_seed(seed)

    def get_rng_state(self, index: int | None = None) -> torch.Tensor:
        return torch.get_rng_state()

    def set_rng_state(self, state: torch.Tensor, index: int | None = None) -> None:
        torch.set_rng_state(state)


@contextlib.contextmanager
def _null_stream_context(stream: Any) -> Iterator[Any]:
    yield stream
