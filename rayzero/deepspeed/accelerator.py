"""``rayzero.deepspeed.accelerator``: DeepSpeed's ``get_accelerator()`` over rayzero's accelerator.

The object answers to DeepSpeed's accelerator names (``device_name(i)``, ``current_device_name()``,
``communication_backend_name()``, ...) with what ``rayzero.accelerator.get_accelerator()`` knows; any other
name falls through to rayzero's accelerator.  As with DeepSpeed's CPU accelerator, every device name on the
CPU is ``"cpu"``.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["get_accelerator", "DeepSpeedAccelerator"]


class DeepSpeedAccelerator:
    """DeepSpeed's accelerator interface on one rayzero ``Accelerator``."""

    def __init__(self, inner):
        self._inner = inner

    # ---- names -------------------------------------------------------------------------------------
    @property
    def _name(self) -> str:
        return self._inner.name

    @property
    def _communication_backend_name(self) -> str:
        return self._inner.communication_backend()

    def device_name(self, device_index: int | None = None) -> str:
        if self._inner.name == "cpu" or device_index is None:
            return self._inner.name
        return f"{self._inner.name}:{device_index}"

    def current_device_name(self) -> str:
        if self._inner.name == "cpu":
            return "cpu"
        return f"{self._inner.name}:{self._inner.current_device_index()}"

    def communication_backend_name(self) -> str:
        return self._inner.communication_backend()

    def is_synchronized_device(self) -> bool:
        """Whether work completes when issued (no streams): true on the CPU."""
        return self._inner.name == "cpu"

    # ---- devices -----------------------------------------------------------------------------------
    def device(self, device_index: int | None = None) -> torch.device:
        return self._inner.device(device_index)

    def current_device(self) -> int:
        return self._inner.current_device_index()

    def set_device(self, device_index: int) -> None:
        self._inner.set_device(device_index)

    def device_count(self) -> int:
        return self._inner.device_count()

    def is_available(self) -> bool:
        return self._inner.name == "cpu" or self._inner.device_count() > 0

    def synchronize(self, device_index: int | None = None) -> None:
        self._inner.synchronize(device_index)

    def on_accelerator(self, tensor: torch.Tensor) -> bool:
        return tensor.device.type == self._inner.name

    # ---- streams and events ------------------------------------------------------------------------
    def Stream(self, *args, **kwargs):  # noqa: N802 - DeepSpeed's name
        return self._inner.stream()

    def stream(self, stream):
        return self._inner.stream_context(stream)

    def current_stream(self, device_index: int | None = None):
        return self._inner.current_stream(device_index)

    def default_stream(self, device_index: int | None = None):
        return self._inner.current_stream(device_index)

    def Event(self, **kwargs):  # noqa: N802 - DeepSpeed's name
        return self._inner.Event(enable_timing=kwargs.get("enable_timing", False))

    # ---- random numbers ----------------------------------------------------------------------------
    def manual_seed(self, seed: int) -> None:
        self._inner.manual_seed(seed)

    def manual_seed_all(self, seed: int) -> None:
        self._inner.manual_seed(seed)

    def initial_seed(self) -> int:
        return torch.initial_seed()

    def get_rng_state(self, device_index: int | None = None) -> torch.Tensor:
        return self._inner.get_rng_state(device_index)

    def set_rng_state(self, new_state: torch.Tensor, device_index: int | None = None) -> None:
        self._inner.set_rng_state(new_state, device_index)

    # ---- memory ------------------------------------------------------------------------------------
    def empty_cache(self) -> None:
        if self._inner.name == "cuda":
            torch.cuda.empty_cache()

    def memory_allocated(self, device_index: int | None = None) -> int:
        return self._inner.memory_allocated(device_index)

    def max_memory_allocated(self, device_index: int | None = None) -> int:
        return self._inner.max_memory_allocated(device_index)

    def reset_peak_memory_stats(self, device_index: int | None = None) -> None:
        self._inner.reset_peak_memory_stats(device_index)

    def total_memory(self, device_index: int | None = None) -> int:
        return self._inner.total_memory(device_index)

    def available_memory(self, device_index: int | None = None) -> int:
        return self._inner.available_memory(device_index)

    def pin_memory(self, tensor: torch.Tensor, align_bytes: int = 1) -> torch.Tensor:
        return self._inner.pin_memory(tensor)

    def is_pinned(self, tensor: torch.Tensor) -> bool:
        return self._inner.is_pinned(tensor)

    # ---- data types --------------------------------------------------------------------------------
    def is_bf16_supported(self) -> bool:
        return self._inner.is_bf16_supported()

    def is_fp16_supported(self) -> bool:
        return self._inner.is_fp16_supported()

    def supported_dtypes(self) -> list[torch.dtype]:
        out = [torch.float32]
        if self.is_fp16_supported():
            out.append(torch.float16)
        if self.is_bf16_supported():
            out.append(torch.bfloat16)
        return out

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def __repr__(self) -> str:
        return f"rayzero.deepspeed accelerator over {self._inner!r}"


def get_accelerator() -> DeepSpeedAccelerator:
    """The accelerator of this process (``rayzero.accelerator.get_accelerator()``), under DeepSpeed's names."""
    from rayzero.accelerator import get_accelerator as rayzero_accelerator

    return DeepSpeedAccelerator(rayzero_accelerator())
