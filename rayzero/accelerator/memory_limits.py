"""How much memory this process may really use: host RAM, cgroup limits and rlimits.

A container's view of ``/proc/meminfo`` shows the host's RAM, not the container's
quota, so planning from psutil alone over-commits and gets the worker OOM-killed.
This module reads every limit that can apply and keeps the smallest:

* host RAM (psutil),
* cgroup v2 ``memory.max`` of the process's cgroup and every ancestor,
* cgroup v1 ``memory.limit_in_bytes`` of the memory controller's cgroup and ancestors,
* ``RLIMIT_AS`` (virtual address space) and ``RLIMIT_DATA`` (data segment).

All filesystem locations are parameters so tests can point them at fake trees.
"""

from __future__ import annotations

import logging
import os
import resource
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, NamedTuple

import psutil

logger = logging.getLogger(__name__)

DEFAULT_CGROUP_ROOT = "/sys/fs/cgroup"
DEFAULT_PROC_CGROUP = "/proc/self/cgroup"
DEFAULT_PROC_STATUS = "/proc/self/status"

SOURCE_HOST = "host"
SOURCE_CGROUP_V2 = "cgroup v2 memory.max"
SOURCE_CGROUP_V1 = "cgroup v1 memory.limit_in_bytes"
SOURCE_RLIMIT_AS = "RLIMIT_AS"
SOURCE_RLIMIT_DATA = "RLIMIT_DATA"

# cgroup v1 reports "no limit" as LONG_MAX rounded down to the page size
# (9223372036854771712 with 4 KiB pages); anything this large is not a real limit.
CGROUP_V1_UNLIMITED_THRESHOLD = 2**62
CGROUP_V1_PAGE_ROUNDED_MAX = (2**63 - 1) // os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PAGE_SIZE")


@dataclass(frozen=True)
class MemoryLimit:
    """The memory this process may use.

    ``total_bytes`` is the smallest applicable limit and ``source`` names it.
    ``available_bytes`` is the smallest headroom left under any limit (never more
    than ``total_bytes``); ``available_source`` names the limit that bounds it,
    which can differ from ``source`` (e.g. a roomy cgroup that is nearly full).
    """

    total_bytes: int
    available_bytes: int
    source: str
    available_source: str = ""


@dataclass(frozen=True)
class LimitCandidate:
    """One limit that applies to the process, with the headroom left under it."""

    source: str
    total_bytes: int
    available_bytes: int
    detail: str = ""  # e.g. the cgroup directory the limit was read from


class ProcCgroup(NamedTuple):
    """The cgroup paths named in ``/proc/self/cgroup``; ``None`` where absent."""

    v2_path: str | None
    v1_memory_path: str | None


def parse_proc_cgroup(text: str) -> ProcCgroup:
    """Parse ``/proc/self/cgroup`` into the v2 path (``0::/x``) and the v1 memory path.

    Lines are ``hierarchy-id:controller-list:path``; the path itself may contain
    ``:`` so only the first two separators split.
    """
    v2_path: str | None = None
    v1_memory_path: str | None = None
    for line in text.splitlines():
        parts = line.strip().split(":", 2)
        if len(parts) != 3:
            continue
        hierarchy_id, controllers, path = parts
        if hierarchy_id == "0" and controllers == "":
            v2_path = path
        elif "memory" in controllers.split(","):
            v1_memory_path = path
    return ProcCgroup(v2_path, v1_memory_path)


def _read_text(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except OSError:  # missing file, permission denied, or a cgroup removed under us
        return None


def _read_int(path: Path) -> int | None:
    text = _read_text(path)
    if text is None:
        return None
    try:
        return int(text)
    except ValueError:
        logger.debug("ignoring non-integer content %r in %s", text, path)
        return None


def _read_stat_field(stat_file: Path, names: tuple[str, ...]) -> int | None:
    """First of ``names`` found in a ``memory.stat`` file (``key value`` lines)."""
    text = _read_text(stat_file)
    if text is None:
        return None
    fields: dict[str, str] = {}
    for line in text.splitlines():
        key, _, value = line.partition(" ")
        fields[key] = value.strip()
    for name in names:
        if name in fields:
            try:
                return int(fields[name])
            except ValueError:
                return None
    return None


def _cgroup_levels(mount: Path, cgroup_path: str | None) -> list[Path]:
    """The process's cgroup directory under ``mount`` and each ancestor up to ``mount``.

    If the path from /proc does not exist under the mount, the mounted root *is*
    the container's cgroup (cgroup namespaces, or Docker bind-mounting only the
    container's own cgroup), so the walk starts at the mount itself.
    """
    leaf = mount
    if cgroup_path:
        relative = cgroup_path.strip("/")
        candidate = mount / relative if relative else mount
        # "/.." appears when the process sits outside the namespace root; never walk above the mount.
        if ".." not in Path(relative).parts and candidate.is_dir():
            leaf = candidate
    levels = [leaf]
    current = leaf
    while current != mount:
        current = current.parent
        levels.append(current)
    return levels


def _limit_from_levels(
    levels: list[Path],
    *,
    source: str,
    read_limit: Callable[[Path], int | None],
    usage_file: str,
    inactive_file_fields: tuple[str, ...],
    level_applies: Callable[[Path, bool], bool] = lambda level, is_leaf: True,
) -> LimitCandidate | None:
    """Smallest limit over the levels, and the smallest headroom under any of them.

    Headroom at a level is its limit minus its working set (usage less inactive
    page cache, which the kernel reclaims before OOM, as the kubelet counts it).
    A level whose usage cannot be read borrows the nearest descendant's usage,
    a lower bound since a parent's usage includes its children's.
    """
    total: int | None = None
    available: int | None = None
    detail = ""
    known_usage = 0
    for index, level in enumerate(levels):
        usage = _read_int(level / usage_file)
        if usage is not None:
            inactive = _read_stat_field(level / "memory.stat", inactive_file_fields) or 0
            known_usage = max(usage - inactive, 0)
        if not level_applies(level, index == 0):
            continue
        limit = read_limit(level)
        if limit is None:
            continue
        if total is None or limit < total:
            total = limit
            detail = str(level)
        headroom = max(limit - known_usage, 0)
        available = headroom if available is None else min(available, headroom)
    if total is None or available is None:
        return None
    return LimitCandidate(source, total, min(available, total), detail)


def _read_v2_memory_max(level: Path) -> int | None:
    text = _read_text(level / "memory.max")
    if text is None or text == "max":
        return None
    try:
        return int(text)
    except ValueError:
        logger.debug("ignoring unparsable memory.max %r in %s", text, level)
        return None


def _read_v1_limit(level: Path) -> int | None:
    value = _read_int(level / "memory.limit_in_bytes")
    if value is None or value >= CGROUP_V1_UNLIMITED_THRESHOLD or value == CGROUP_V1_PAGE_ROUNDED_MAX:
        return None
    return value


def _read_proc_cgroup(proc_cgroup: str | os.PathLike[str]) -> ProcCgroup:
    text = _read_text(Path(proc_cgroup))
    return parse_proc_cgroup(text) if text is not None else ProcCgroup(None, None)


def cgroup_v2_limit(
    cgroup_root: str | os.PathLike[str] = DEFAULT_CGROUP_ROOT,
    proc_cgroup: str | os.PathLike[str] = DEFAULT_PROC_CGROUP,
) -> LimitCandidate | None:
    """The effective cgroup v2 ``memory.max`` (minimum over the cgroup and its ancestors).

    Returns ``None`` when there is no v2 entry or every level says ``max``. On a
    hybrid host (v1 memory controller, v2 mounted elsewhere) the v2 tree at
    ``cgroup_root`` has no ``memory.max`` files, so this also returns ``None``.
    """
    parsed = _read_proc_cgroup(proc_cgroup)
    if parsed.v2_path is None:
        return None
    root = Path(cgroup_root)
    return _limit_from_levels(
        _cgroup_levels(root, parsed.v2_path),
        source=SOURCE_CGROUP_V2,
        read_limit=_read_v2_memory_max,
        usage_file="memory.current",
        inactive_file_fields=("inactive_file",),
    )


def _v1_memory_mount(root: Path) -> Path | None:
    direct = root / "memory"
    if direct.is_dir():
        return direct
    # Some hosts co-mount controllers, e.g. "/sys/fs/cgroup/cpu,memory".
    try:
        for entry in root.iterdir():
            if entry.is_dir() and "memory" in entry.name.split(","):
                return entry
    except OSError:
        return None
    return None


def cgroup_v1_limit(
    cgroup_root: str | os.PathLike[str] = DEFAULT_CGROUP_ROOT,
    proc_cgroup: str | os.PathLike[str] = DEFAULT_PROC_CGROUP,
) -> LimitCandidate | None:
    """The effective cgroup v1 ``memory.limit_in_bytes`` (minimum over cgroup and ancestors).

    Values >= 2**62 (the kernel's page-rounded LONG_MAX) mean "unlimited". An
    ancestor with ``memory.use_hierarchy`` = 0 does not constrain its children.
    """
    parsed = _read_proc_cgroup(proc_cgroup)
    if parsed.v1_memory_path is None:
        return None
    mount = _v1_memory_mount(Path(cgroup_root))
    if mount is None:
        return None

    def applies(level: Path, is_leaf: bool) -> bool:
        return is_leaf or _read_int(level / "memory.use_hierarchy") != 0

    return _limit_from_levels(
        _cgroup_levels(mount, parsed.v1_memory_path),
        source=SOURCE_CGROUP_V1,
        read_limit=_read_v1_limit,
        usage_file="memory.usage_in_bytes",
        # v1 "total_*" fields are hierarchical (include children), matching usage_in_bytes.
        inactive_file_fields=("total_inactive_file", "inactive_file"),
        level_applies=applies,
    )


class ProcessMemoryUsage(NamedTuple):
    """What the rlimits are charged against: virtual size (AS) and data size (DATA)."""

    virtual_bytes: int
    data_bytes: int


def process_memory_usage(proc_status: str | os.PathLike[str] = DEFAULT_PROC_STATUS) -> ProcessMemoryUsage:
    """Current ``VmSize`` and ``VmData`` of this process.

    ``VmData`` from /proc/self/status is what Linux charges against RLIMIT_DATA
    (private writable mappings); psutil's ``data`` also counts the stack, so it
    is only the fallback where /proc is unavailable.
    """
    fields: dict[str, int] = {}
    text = _read_text(Path(proc_status))
    if text is not None:
        for line in text.splitlines():
            key, _, value = line.partition(":")
            parts = value.split()
            if key in ("VmSize", "VmData") and len(parts) == 2 and parts[1] == "kB":
                fields[key] = int(parts[0]) * 1024
    if "VmSize" in fields and "VmData" in fields:
        return ProcessMemoryUsage(fields["VmSize"], fields["VmData"])
    info = psutil.Process().memory_info()
    return ProcessMemoryUsage(int(info.vms), int(getattr(info, "data", info.vms)))


def rlimit_limits(
    getrlimit: Callable[[int], tuple[int, int]] = resource.getrlimit,
    usage: ProcessMemoryUsage | None = None,
) -> list[LimitCandidate]:
    """``RLIMIT_AS`` and ``RLIMIT_DATA`` soft limits that are set, with headroom under each.

    The soft limit is the one the kernel enforces on allocation; ``RLIM_INFINITY``
    means unset.
    """
    wanted = [(SOURCE_RLIMIT_AS, resource.RLIMIT_AS)]
    if hasattr(resource, "RLIMIT_DATA"):
        wanted.append((SOURCE_RLIMIT_DATA, resource.RLIMIT_DATA))
    candidates: list[LimitCandidate] = []
    for source, which in wanted:
        soft, _hard = getrlimit(which)
        if soft == resource.RLIM_INFINITY or soft < 0:
            continue
        if usage is None:
            usage = process_memory_usage()
        used = usage.virtual_bytes if source == SOURCE_RLIMIT_AS else usage.data_bytes
        candidates.append(LimitCandidate(source, int(soft), max(int(soft) - used, 0)))
    return candidates


def host_limit() -> LimitCandidate:
    """Host RAM as psutil reports it (total and currently available)."""
    vm = psutil.virtual_memory()
    return LimitCandidate(SOURCE_HOST, int(vm.total), int(vm.available))


def combine_limits(candidates: Iterable[LimitCandidate]) -> MemoryLimit:
    """Keep the smallest total and the smallest headroom across all applicable limits.

    On ties the earlier candidate wins, so pass the host first: a cgroup limit equal
    to host RAM is then reported as "host", which is what the operator would expect.
    """
    items = list(candidates)
    if not items:
        raise ValueError("combine_limits needs at least one limit; pass host_limit() at minimum")
    by_total = min(items, key=lambda c: c.total_bytes)  # min() keeps the first on ties
    by_available = min(items, key=lambda c: c.available_bytes)
    total = by_total.total_bytes
    available = min(max(by_available.available_bytes, 0), total)
    return MemoryLimit(total, available, by_total.source, by_available.source)


def detect_memory_limit(
    cgroup_root: str | os.PathLike[str] = DEFAULT_CGROUP_ROOT,
    proc_cgroup: str | os.PathLike[str] = DEFAULT_PROC_CGROUP,
) -> MemoryLimit:
    """The memory this process may use, from host RAM, cgroup v2/v1 and rlimits.

    Both cgroup versions are consulted: a hybrid host lists a v2 path and a v1
    memory path at once, and whichever actually carries a limit should count.
    """
    candidates = [host_limit()]
    for reader in (cgroup_v2_limit, cgroup_v1_limit):
        found = reader(cgroup_root, proc_cgroup)
        if found is not None:
            candidates.append(found)
    candidates.extend(rlimit_limits())
    return combine_limits(candidates)
