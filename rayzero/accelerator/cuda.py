"""CUDA accelerator over ``torch.cuda``.

Importing this module never touches the CUDA driver; only constructing
:class:`CudaAccelerator` does, and it fails with a clear message without a GPU.
"""

from __future__ import annotations

import os
from contextlib import AbstractContextManager
from typing import Any

import torch

from rayzero.accelerator.base import Accelerator

# cuBLAS needs a fixed workspace layout for reproducible GEMMs; ":16:8" is the
# smaller documented alternative, so either counts as already configured.
_DETERMINISTIC_CUBLAS_CONFIGS = (":4096:8", ":16:8")


class CudaAccelerator(Accelerator):
    """NVIDIA GPUs through ``torch.cuda``; one device per worker (its local rank)."""

    name = "cuda"

    def __init__(self) -> None:
        if not torch.cuda.is_available():
            raise RuntimeError(
                "CUDA accelerator requested but torch.cuda.is_available() is False "
                f"(torch {torch.__version__}, built for CUDA {torch.version.cuda}, "
                f"CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')!r}); "
                "run on a GPU node or select the CPU with RAYZERO_ACCELERATOR=cpu"
            )

    def _index(self, index: int | None) -> int:
        return torch.cuda.current_device() if index is None else index

    # ---- devices -------------------------------------------------------------------

    def device(self, index: int | None = None) -> torch.device:
        return torch.device("cuda", self._index(index))

    def device_count(self) -> int:
        return torch.cuda.device_count()

    def current_device_index(self) -> int:
        return torch.cuda.current_device()

    def set_device(self, index: int) -> None:
        count = torch.cuda.device_count()
        if not isinstance(index, int) or not 0 <= index < count:
            raise ValueError(
                f"CUDA device index {index!r} is out of range: {count} device(s) visible "
                f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')!r}); "
                f"use 0..{count - 1}, normally the worker's local rank"
            )
        torch.cuda.set_device(index)

    def synchronize(self, index: int | None = None) -> None:
        torch.cuda.synchronize(index)

    # ---- streams and events ----------------------------------------------------------

    def stream(self, index: int | None = None) -> torch.cuda.Stream:
        return torch.cuda.Stream(device=self._index(index))

    def current_stream(self, index: int | None = None) -> torch.cuda.Stream:
        return torch.cuda.current_stream(index)

    def stream_context(self, stream: Any) -> AbstractContextManager[Any]:
        return torch.cuda.stream(stream)

    def Event(self, enable_timing: bool = False) -> torch.cuda.Event:  # noqa: N802 - mirrors torch.cuda.Event
        return torch.cuda.Event(enable_timing=enable_timing)

    # ---- memory ----------------------------------------------------------------------

    def pin_memory(self, tensor: torch.Tensor) -> torch.Tensor:
        if tensor.device.type != "cpu" or tensor.is_pinned():
            return tensor
        return tensor.pin_memory()

    def _fraction_limit(self, index: int, device_total: int) -> int:
        # torch.cuda.set_per_process_memory_fraction caps what the caching allocator
        # may reserve; honour it so planning does not assume memory it will be refused.
        try:
            fraction = torch.cuda.get_per_process_memory_fraction(index)
        except (AttributeError, RuntimeError):
            return device_total
        return int(device_total * fraction)

    def total_memory(self, index: int | None = None) -> int:
        """Device memory (the MIG slice where MIG is on), capped by the per-process fraction."""
        index = self._index(index)
        _free, device_total = torch.cuda.mem_get_info(index)
        return min(device_total, self._fraction_limit(index, device_total))

    def available_memory(self, index: int | None = None) -> int:
        """Free device memory plus what torch's caching allocator holds but does not use."""
        index = self._index(index)
        free, device_total = torch.cuda.mem_get_info(index)
        allocated = torch.cuda.memory_allocated(index)
        cached_unused = torch.cuda.memory_reserved(index) - allocated
        under_fraction = self._fraction_limit(index, device_total) - allocated
        return max(min(free + cached_unused, under_fraction), 0)

    def memory_allocated(self, index: int | None = None) -> int:
        """Bytes held by live tensors in torch's caching allocator."""
        return torch.cuda.memory_allocated(self._index(index))

    def max_memory_allocated(self, index: int | None = None) -> int:
        return torch.cuda.max_memory_allocated(self._index(index))

    def reset_peak_memory_stats(self, index: int | None = None) -> None:
        torch.cuda.reset_peak_memory_stats(self._index(index))

    # ---- capabilities ------------------------------------------------------------------

    def communication_backend(self) -> str:
        return "nccl"

    def is_bf16_supported(self) -> bool:
        # Emulated bf16 (pre-Ampere) works but is slow; report native support only.
        return torch.cuda.is_bf16_supported(including_emulation=False)

    def is_fp16_supported(self) -> bool:
        # Native half arithmetic starts at compute capability 5.3.
        return torch.cuda.get_device_capability() >= (5, 3)

    def supports_fused_optimizer(self) -> bool:
        return True

    def create_graph(self) -> torch.cuda.CUDAGraph:
        if not self.supports_graph_capture():
            from rayzero.accelerator.graphs import capture_off_error

            raise capture_off_error(self.name)
        return torch.cuda.CUDAGraph()

    def capture_to_graph(self, graph: Any, pool: Any = None, stream: Any = None) -> AbstractContextManager[Any]:
        from rayzero.accelerator.graphs import capture_cuda

        return capture_cuda(graph, pool=pool, stream=stream)

    def replay_graph(self, graph: Any) -> None:
        graph.replay()

    # ---- randomness and determinism --------------------------------------------------

    def manual_seed(self, seed: int) -> None:
        """Seed the CPU generator and every CUDA device's generator."""
        torch.manual_seed(seed)
        torch.cuda.manual_seed_all(seed)

    def get_rng_state(self, index: int | None = None) -> torch.Tensor:
        return torch.cuda.get_rng_state(self._index(index))

    def set_rng_state(self, state: torch.Tensor, index: int | None = None) -> None:
        torch.cuda.set_rng_state(state, self._index(index))

    def set_deterministic(self, enabled: bool) -> None:
        super().set_deterministic(enabled)
        if enabled and os.environ.get("CUBLAS_WORKSPACE_CONFIG") not in _DETERMINISTIC_CUBLAS_CONFIGS:
            # Read when cuBLAS creates its handle, so this must run before the first GEMM.
            os.environ["CUBLAS_WORKSPACE_CONFIG"] = ":4096:8"
        torch.backends.cudnn.deterministic = enabled
        if enabled:
            # Autotuning picks kernels by timing, which can differ run to run.
            torch.backends.cudnn.benchmark = False
