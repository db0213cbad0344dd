"""Accelerator selection: ``get_accelerator()`` returns the device kind this process trains on.

Selection order: the ``name`` argument, then the ``RAYZERO_ACCELERATOR`` environment
variable, then auto-detection (CUDA when ``torch.cuda.is_available()``, else CPU).
New device kinds plug in with ``register_accelerator(name, factory)``, or, in processes rayzero does not
start itself (Ray workers), by naming the factory as ``module:attribute`` in ``RAYZERO_ACCELERATOR``: the
module is imported where the accelerator is first asked for.

``bind_rank_device()`` makes this rank's device current; ``zero_init``, ``init_distributed`` and the engine
call it before any process group or device tensor exists.
"""

from __future__ import annotations

import hashlib
import importlib
import os
import socket
import threading
from typing import Callable

import torch

from rayzero.accelerator.base import Accelerator, EventLike, StreamLike
from rayzero.accelerator.memory_limits import MemoryLimit, detect_memory_limit

__all__ = [
    "ACCELERATOR_ENV_VAR",
    "DEVICE_INDEX_ENV_VAR",
    "Accelerator",
    "EventLike",
    "MemoryLimit",
    "StreamLike",
    "bind_rank_device",
    "detect_memory_limit",
    "device_identity",
    "get_accelerator",
    "register_accelerator",
    "registered_accelerators",
]

ACCELERATOR_ENV_VAR = "RAYZERO_ACCELERATOR"
# The device index this rank binds, where a launcher knows it better than LOCAL_RANK does (the Ray worker
# sets it from the GPU Ray assigned it).
DEVICE_INDEX_ENV_VAR = "RAYZERO_DEVICE_INDEX"

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
        if factory is None and ":" in key:
            factory = _factories[key] = _import_factory(name.strip(), origin)
        if factory is None:
            raise ValueError(
                f"unknown accelerator {name!r} (from {origin}); registered: "
                f"{', '.join(sorted(_factories))}. Use one of those, or add it with "
                "rayzero.accelerator.register_accelerator(name, factory), or name its factory as "
                "module:attribute"
            )
        instance = factory()
        if not isinstance(instance, Accelerator):
            raise TypeError(
                f"factory for accelerator {key!r} returned {type(instance).__name__}, "
                "expected a rayzero.accelerator.Accelerator subclass instance"
            )
        _instances[key] = instance
        return instance


def _import_factory(spec: str, origin: str) -> AcceleratorFactory:
    """The factory ``module:attribute`` names (an Accelerator subclass or a function returning one)."""
    module_name, _, attr = spec.partition(":")
    try:
        factory = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as e:
        raise ValueError(
            f"accelerator {spec!r} (from {origin}) names a factory as module:attribute that cannot be loaded "
            f"({type(e).__name__}: {e}); make the module importable in this process (PYTHONPATH, or the Ray "
            "job's runtime_env) or use a registered name"
        ) from None
    if not callable(factory):
        raise TypeError(f"accelerator {spec!r} (from {origin}): {attr} is not callable")
    return factory


# accelerator instance id -> the index this process bound it to (set_device runs once per process)
_bound: dict[int, int] = {}


def bind_rank_device(accelerator: Accelerator | None = None) -> int | None:
    """Make this rank's device current and return its index (None on the CPU accelerator).

    The index is ``$RAYZERO_DEVICE_INDEX`` where a launcher set it, else ``LOCAL_RANK`` modulo the devices
    this process sees (a launcher that shows each rank only its own device makes it 0).  It must run before
    any process group or device tensor exists: a device backend binds a group to the current device, and
    tensors made before land on device 0.  Calling it again is free."""
    acc = accelerator or get_accelerator()
    if acc.name == "cpu":
        return None
    count = max(1, acc.device_count())
    given = os.environ.get(DEVICE_INDEX_ENV_VAR, "").strip()
    if given:
        if not given.isdigit() or int(given) >= count:
            raise ValueError(
                f"{DEVICE_INDEX_ENV_VAR}={given!r}: this process sees {count} {acc.name} device(s), indices 0 to "
                f"{count - 1}; unset it to bind LOCAL_RANK's device"
            )
        index = int(given)
    else:
        index = int(os.environ.get("LOCAL_RANK", "0")) % count
    with _lock:
        if _bound.get(id(acc)) != index:
            acc.set_device(index)
            _bound[id(acc)] = index
    return index


def device_identity(accelerator: Accelerator, index: int) -> str:
    """What tells this process's device ``index`` apart from the other devices of its host: the
    accelerator's own ``device_identity(index)`` where it has one, else the device's UUID where torch reports
    one (it stays the same whatever each process is shown), else the index."""
    own = getattr(accelerator, "device_identity", None)
    if callable(own):
        return str(own(index))
    module = getattr(torch, accelerator.device(index).type, None)
    try:
        uuid = getattr(module.get_device_properties(index), "uuid", None)
    except Exception:  # noqa: BLE001 - a device kind without properties: the index is all there is
        uuid = None
    return str(uuid) if uuid is not None else f"index {index}"


def host_identity() -> str:
    """This host, as the ranks on it see it (the boot id tells apart containers with one hostname)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = ""
    return f"{socket.gethostname()} {boot}"


def identity_hash(text: str) -> int:
    """A stable 63-bit hash (Python's own hash differs per process)."""
    return int.from_bytes(hashlib.sha1(text.encode()).digest()[:8], "little") >> 1
