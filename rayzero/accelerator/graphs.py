"""Graph capture as an accelerator capability: which device kinds capture, how, and the graph objects.

A *graph* is recorded work that can be replayed without re-running the Python that produced it.  The
calls are the same on every accelerator::

    graph = acc.create_graph()
    with acc.capture_to_graph(graph) as recorder:
        recorder.record(fn, *static_tensors)   # fn reads and writes only the tensors it is given (or
                                               # tensors that live as long as the graph); returns nothing
    acc.replay_graph(graph)                    # runs the recorded work; recording itself runs nothing

Recording never runs the work (on CUDA, stream capture queues nothing; on CPU the compile happens at the
first replay), so the caller replays once for the step it recorded, and every replay after that.  The
work must be in-place on static tensors: replay writes to the same storage each time.

Whether a device kind captures is declared here, per name, with how it does it.  A kind whose capture is
not known to work with rayzero is declared off: asking it to capture raises :class:`GraphCaptureError`
naming the device kind, never a silent eager run or a replay that does nothing.
"""

from __future__ import annotations

import itertools
import shutil
import threading
import types
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch


class GraphCaptureError(RuntimeError):
    """Graph capture was asked of a device kind (or in a setting) where rayzero cannot do it."""


@dataclass(frozen=True)
class CaptureSupport:
    """How one device kind captures graphs, and whether rayzero enables it there."""

    mechanism: str  # what capture is on this device kind
    enabled: bool  # known to work with rayzero: the engine may use it
    note: str = ""  # why it is off, or what it needs


_lock = threading.Lock()
_CAPTURE: dict[str, CaptureSupport] = {
    "cpu": CaptureSupport("torch.compile (inductor C++ kernels)", True, "needs a C++ compiler on PATH"),
    "cuda": CaptureSupport("CUDA graphs (torch.cuda.CUDAGraph, private memory pool)", True),
    "npu": CaptureSupport("NPU graphs (torch_npu.npu.NPUGraph)", False, "not verified with rayzero"),
    "xpu": CaptureSupport("XPU graphs (torch.xpu.XPUGraph)", False, "not verified with rayzero"),
    "hpu": CaptureSupport("HPU graphs (habana_frameworks.torch.hpu.HPUGraph)", False, "not verified with rayzero"),
}


def capture_support(name: str) -> CaptureSupport:
    """What the registry says about graph capture on device kind ``name`` (unknown kinds: off)."""
    with _lock:
        return _CAPTURE.get(name.strip().lower(), CaptureSupport("none declared", False, "no entry in the registry"))


def register_graph_capture(name: str, mechanism: str, enabled: bool, note: str = "") -> None:
    """Declare (or change) how device kind ``name`` captures graphs and whether rayzero may use it."""
    if not name.strip():
        raise ValueError("device kind name must be a non-empty string")
    with _lock:
        _CAPTURE[name.strip().lower()] = CaptureSupport(mechanism, bool(enabled), note)


def capture_off_error(name: str, what: str = "graph capture") -> GraphCaptureError:
    s = capture_support(name)
    why = f" ({s.note})" if s.note else ""
    return GraphCaptureError(
        f"{what} is off for accelerator {name!r}: its mechanism is {s.mechanism}{why}. Set "
        "\"graph_capture\": {\"enabled\": false} to train eagerly there, or declare the mechanism working with "
        "rayzero.accelerator.graphs.register_graph_capture(name, mechanism, enabled=True) once it is"
    )


def cpu_compiler_available() -> bool:
    """Inductor's CPU backend compiles C++: it needs a compiler."""
    return any(shutil.which(c) for c in ("g++", "c++", "clang++"))


# ---- CPU: graphs compiled by torch.compile ---------------------------------------------------------------


class CompiledGraph:
    """CPU graph: the recorded functions, each compiled by inductor at its first replay."""

    def __init__(self) -> None:
        self.calls: list[tuple[Callable[..., Any], tuple]] = []
        self.capturing = False

    def record(self, fn: Callable[..., Any], *args: Any) -> None:
        if not self.capturing:
            raise GraphCaptureError("record() is only valid inside capture_to_graph(graph)")
        # Not fullgraph: torch's optimizer step breaks the graph at its own boundaries (and runs a fused
        # kernel as the one kernel it is); the code around it compiles.  A private code object per record
        # gives each graph its own dynamo cache, so engines in one process never use up each other's
        # recompile budget.
        self.calls.append((torch.compile(_own_code(fn), dynamic=False), args))

    def replay(self) -> None:
        if self.capturing:
            raise GraphCaptureError("replay_graph() inside capture_to_graph() of the same graph")
        if not self.calls:
            raise GraphCaptureError("replay_graph() of a graph that recorded nothing")
        for fn, args in self.calls:
            fn(*args)


_counter = itertools.count()


def _own_code(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` with a code object of its own (same body, closure and globals)."""
    if not isinstance(fn, types.FunctionType):
        return fn
    code = fn.__code__.replace(co_name=f"{fn.__code__.co_name}_graph{next(_counter)}")
    out = types.FunctionType(code, fn.__globals__, code.co_name, fn.__defaults__, fn.__closure__)
    out.__kwdefaults__ = fn.__kwdefaults__
    return out


@contextmanager
def capture_compiled(graph: CompiledGraph) -> Iterator[CompiledGraph]:
    if not isinstance(graph, CompiledGraph):
        raise GraphCaptureError(f"expected a graph from the CPU accelerator's create_graph(), got {type(graph).__name__}")
    if graph.calls:
        raise GraphCaptureError("this graph already holds a capture; create a new graph to capture again")
    graph.capturing = True
    try:
        yield graph
    finally:
        graph.capturing = False


# ---- CUDA: stream capture into torch.cuda.CUDAGraph -------------------------------------------------------


class CudaGraphRecorder:
    """Inside ``torch.cuda.graph(...)``: recording a function is calling it (its kernels are captured)."""

    def __init__(self, graph: Any) -> None:
        self.graph = graph
        self.recorded = 0

    def record(self, fn: Callable[..., Any], *args: Any) -> None:
        fn(*args)
        self.recorded += 1


@contextmanager
def capture_cuda(graph: Any, pool: Any = None, stream: Any = None) -> Iterator[CudaGraphRecorder]:
    recorder = CudaGraphRecorder(graph)
    # a private pool per graph unless the caller shares one (graph.pool() of another graph)
    with torch.cuda.graph(graph, pool=pool, stream=stream):
        yield recorder
    if not recorder.recorded:
        raise GraphCaptureError("capture_to_graph() recorded nothing: call recorder.record(fn, *args) inside it")
