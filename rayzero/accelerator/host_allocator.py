"""The host allocator in a training process: keep freed memory for reuse instead of giving it back.

A training step frees and allocates the same large buffers over and over (stage 3 gathers every parameter
into freshly allocated storage and frees it after use, twice a step). glibc's malloc serves buffers of a
few MiB from its heap and gives freed memory at the top of the heap back to the kernel once more than its
trim threshold (twice its dynamic mmap threshold) is free. The next allocation then takes a page fault per
4 KiB page, and the kernel zeroes each page. On the bench model that is ~18,000 faults a stage-3 step
on CPU (``python bench/bench_faults.py``: 188.5 ms a step with glibc's defaults, 162.8 ms without them).

:func:`keep_freed_memory` raises glibc's trim threshold to 2 GiB and fixes its mmap threshold at the 32 MiB
maximum, so freed buffers up to 32 MiB stay in the heap and are reused without faulting. The process's
peak memory does not change, since those buffers were all alive at once anyway. Its resident memory then
stays near that peak instead of dropping between steps. Larger buffers are still mapped and unmapped.

With the optimizer (or the parameters) offloaded the point of the config is to hold less, and the reverse
holds: :func:`release_freed_memory` fixes glibc's mmap threshold at 1 MiB (and its trim threshold at 1 MiB),
so every buffer of 1 MiB or more is a mapping of its own that goes back to the OS when freed. Kept memory
is what made offload cost RAM: with parameters and optimizer on NVMe the bench model's ranks peaked at
704-751 MB against 589 MB without offload (issue 27), most of the difference freed blocks the heap kept. The step pays page faults for its
large buffers again (offloaded steps are bound by the copies and the disk anyway).

At the end of set-up the engine trims the heap once under either policy (:func:`end_of_set_up`): what set-up
freed is not a step's working set.

Under the keep policy freed heap would still grow over the first steps beyond the step's live buffers:
torch's CPU tensors come from ``posix_memalign(64, n)``, and glibc (2.36) frees the alignment slivers around
each block into its per-thread cache of small blocks, so a freed block of ``n`` bytes cannot merge with its
neighbours and is too small for the next ``posix_memalign(64, n)`` (docs/design.md "Freed memory kept for
reuse"; ``python bench/heap_phases.py``).  The engine therefore computes ``nn.Linear``'s weight gradients,
the step's largest allocations, into buffers it reuses (rayzero/zero/grad_pool.py) wherever this policy
applies.

``rayzero.initialize`` applies one of the two (:func:`configure_host_allocator`) on a CPU device without
offload, and on any device with offload, unless:

- the environment sets ``RAYZERO_KEEP_FREED_MEMORY=0``;
- it sets any of glibc's own ``MALLOC_MMAP_THRESHOLD_``, ``MALLOC_TRIM_THRESHOLD_``, ``MALLOC_TOP_PAD_``
  (the user has chosen; the memory benches set ``MALLOC_MMAP_THRESHOLD_=65536`` to see live tensors);
- the C library is not glibc.
"""

from __future__ import annotations

import ctypes
import logging
import os

logger = logging.getLogger("rayzero")

M_TRIM_THRESHOLD = -1  # glibc's mallopt parameter numbers (malloc.h)
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD = 32 << 20  # glibc's largest (DEFAULT_MMAP_THRESHOLD_MAX on 64-bit)
TRIM_THRESHOLD = (1 << 31) - 1  # mallopt takes an int
RELEASE_MMAP_THRESHOLD = 1 << 20  # with offload: buffers from 1 MiB up are mappings of their own
RELEASE_TRIM_THRESHOLD = 1 << 20
GLIBC_SETTINGS = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_")

_applied: dict | None = None


def configure_host_allocator(offload: bool, device_kind: str = "cpu") -> dict | None:
    """The policy for an engine: with offload, freed memory goes back (:func:`release_freed_memory`); on a CPU
    device without it, freed memory is kept (:func:`keep_freed_memory`); on an accelerator without offload the
    host allocator is left alone.  The settings are the process's: the last engine built decides."""
    if offload:
        return release_freed_memory()
    if device_kind == "cpu":
        return keep_freed_memory()
    return None


def keep_freed_memory() -> dict | None:
    """Keep freed memory for reuse (the settings above); returns what was set, or None where nothing was
    (and why is logged at debug level)."""
    return _apply("keep", MMAP_THRESHOLD, TRIM_THRESHOLD)


def release_freed_memory() -> dict | None:
    """Give buffers of 1 MiB or more back to the OS when freed (offload: module docstring)."""
    return _apply("release", RELEASE_MMAP_THRESHOLD, RELEASE_TRIM_THRESHOLD)


def give_back_now() -> None:
    """Under the give-back policy, return to the OS what the heap holds free now.  The engine calls it at the
    end of set-up: blocks freed there were allocated before the policy applied (``zero_init``'s shards, the
    model's full-size weights as its modules were built) and sit in the heap, which only shrinks from its top."""
    if _applied is not None and _applied["policy"] == "release":
        ctypes.CDLL(None).malloc_trim(0)


def end_of_set_up() -> None:
    """The end of an engine's set-up: what set-up freed goes back to the OS, under either policy.

    Set-up frees buffers that no step allocates again: ``zero_init``'s full-size weights (each module makes
    its parameters whole before they are sharded) and its shards once copied into the masters, the model's
    own weights at stage 3.  Under the keep policy (a 2 GiB trim threshold) those blocks stayed resident for
    the whole run, though a step never needs them: on the bench model (stage 3, config defaults, 3 ranks)
    66-103 MiB of free heap after ``initialize`` (docs/design.md "Freed memory kept for reuse").  The step's
    own buffers are kept from here on as before; the pages a step takes from this freed memory fault in once,
    in the first steps."""
    if _applied is not None:
        ctypes.CDLL(None).malloc_trim(0)


def _apply(policy: str, mmap_threshold: int, trim_threshold: int) -> dict | None:
    global _applied
    if _applied is not None and _applied["policy"] == policy:
        return _applied
    if os.environ.get("RAYZERO_KEEP_FREED_MEMORY", "1") == "0":
        logger.debug("host allocator left as it is: RAYZERO_KEEP_FREED_MEMORY=0")
        return None
    chosen = [k for k in GLIBC_SETTINGS if k in os.environ]
    if chosen:
        logger.debug("host allocator left as it is: the environment sets %s", ", ".join(chosen))
        return None
    try:
        libc = ctypes.CDLL(None)
        libc.gnu_get_libc_version.restype = ctypes.c_char_p
        version = libc.gnu_get_libc_version().decode()
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        logger.debug("host allocator left as it is: the C library is not glibc")
        return None
    if not (mallopt(M_MMAP_THRESHOLD, mmap_threshold) and mallopt(M_TRIM_THRESHOLD, trim_threshold)):
        logger.debug("host allocator left as it is: glibc %s refused mallopt", version)
        return None
    if policy == "release":
        libc.malloc_trim(0)  # what an earlier keep policy (or set-up) left free goes back now
    _applied = {"policy": policy, "glibc": version, "mmap_threshold": mmap_threshold, "trim_threshold": trim_threshold}
    return _applied
