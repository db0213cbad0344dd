"""Accelerator selection: ``get_accelerator()`` returns the device kind this process trains on.

Selection order: the ``name`` argument, then the ``RAYZERO_ACCELERATOR`` environment
variable, then auto-detection (CUDA when ``torch.cuda.is_available()``, else CPU).
New device kinds plug in with ``register_accelerator(name, factory)``.
"""

from __future__ import annotations

import os
import threading
from typing import Callable

import torch

from rayzero.accelerator.base import Accelerator, EventLike, StreamLike
from rayzero.accelerator.memory_limits import MemoryLimit, detect_memory_limit

__all__ = [
    "ACCELERATOR_ENV_VAR",
    "Accelerator",
    "EventLike",
    "MemoryLimit",
    "StreamLike",
    "detect_memory_limit",
    "get_accelerator",
    "register_accelerator",
    "registered_accelerators",
]

ACCELERATOR_ENV_VAR = "RAYZERO_ACCELERATOR"

AcceleratorFactory = Callable[[], Accelerator]


def _cpu_factory() -> Accelerator:
    from rayzero.accelerator.cpu import CpuAccelerator

    return CpuAccelerator()


def _cuda_factory() -> Accelerator:
    from rayzero.accelerator.cuda import CudaAccelerator

    return CudaAccelerator()


_factories: dict[str, AcceleratorFactory] = {"cpu": _cpu_factory, "cuda": _cuda_factory}
# One instance per name: accelerators hold per-process state (current stream, RSS handle).
_instances: dict[str, Accelerator] = {}
_lock = threading.RLock()  # re-entrant: a factory may itself call get_accelerator


def _normalize(name: str) -> str:
    return name.strip().lower()


def register_accelerator(name: str, factory: AcceleratorFactory, *, replace: bool = False) -> None:
    """Make ``get_accelerator(name)`` build its instance with ``factory()``.

    Re-registering an existing name needs ``replace=True`` (so two plugins cannot
    silently shadow each other); replacing drops the cached instance.
    """
    key = _normalize(name)
    if not key:
        raise ValueError(f"accelerator name must be a non-empty string, got {name!r}")
    if not callable(factory):
        raise TypeError(f"factory for accelerator {key!r} must be callable, got {factory!r}")
    with _lock:
        if key in _factories and not replace:
            raise ValueError(
                f"accelerator {key!r} is already registered; pass replace=True to override it"
            )
        _factories[key] = factory
        _instances.pop(key, None)


def registered_accelerators() -> list[str]:
    """Names ``get_accelerator`` accepts, sorted."""
    with _lock:
        return sorted(_factories)


def get_accelerator(name: str | None = None) -> Accelerator:
    """The (cached) accelerator named ``name``, or the one selected by env/auto-detection."""
    origin = "argument"
    if name is None:
        from_env = os.environ.get(ACCELERATOR_ENV_VAR, "").strip()
        if from_env:
            name, origin = from_env, f"environment variable {ACCELERATOR_ENV_VAR}"
        else:
            name, origin = ("cuda" if torch.cuda.is_available() else "cpu"), "auto-detection"
    key = _normalize(name)
    with _lock:
        instance = _instances.get(key)
        if instance is not None:
            return instance
        factory = _factories.get(key)
        if factory is None:
            raise ValueError(
                f"unknown accelerator {name!r} (from {origin}); registered: "
                f"{', '.join(sorted(_factories))}. Use one of those, or add it with "
                "rayzero.accelerator.register_accelerator(name, factory)"
            )
        instance = factory()
        if not isinstance(instance, Accelerator):
            raise TypeError(
                f"factory for accelerator {key!r} returned {type(instance).__name__}, "
                "expected a rayzero.accelerator.Accelerator subclass instance"
            )
        _instances[key] = instance
        return instance
