"""Where a rank's NVMe swap files live, and how they are cleaned up after the rank is gone.

Two ways a rank gets its directory:

* **Under Ray** (``rayzero.fit``): the node's ``NodeSwapStore`` actor (``rayzero/train/swap_actor.py``) owns
  ``<nvme_path>/rayzero-swap/<run>/`` on that node and leases each rank a subdirectory.  The worker puts it
  in ``$RAYZERO_SWAP_DIR`` before building the engine; :func:`acquire_swap_dir` then uses exactly that
  directory, and :meth:`SwapDirLease.release` empties it but leaves the directory to the actor (which also
  removes the directories of ranks that died).
* **Without Ray** (torchrun, gloo processes): the engine makes ``<nvme_path>/rayzero-swap/<host>-<pid>-rank<r>/``
  itself, with a marker file recording the owner's pid and process start time, and ``release()`` (from
  ``Engine.destroy``) removes it.  Before making it, it removes the directories of this host's owners that
  are no longer running (compared by pid *and* start time, so a reused pid does not keep a dead run's files),
  so a SIGKILLed run leaves nothing behind once the next one starts.

Only directories whose owner is on this host are ever judged: ``nvme_path`` may be shared between hosts.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import threading
from dataclasses import dataclass, field
from pathlib import Path

import psutil

from rayzero.config import ConfigError

SWAP_DIR_ENV = "RAYZERO_SWAP_DIR"
SWAP_ROOT = "rayzero-swap"  # the one directory rayzero makes under nvme_path
OWNER_FILE = ".rayzero-owner"  # JSON {"hostname", "pid", "create_time", ...}: who owns the directory
_ENGINE_DIR = re.compile(r"^(?P<host>.+)-(?P<pid>\d+)-rank(?P<rank>\d+)(?:\.(?P<n>\d+))?$")

_held_lock = threading.Lock()
_held: set[Path] = set()  # engine-owned directories this process holds now (two engines of one rank)


def hostname() -> str:
    """This host's name as it appears in swap directory names (path-safe)."""
    return re.sub(r"[^A-Za-z0-9._]", "_", socket.gethostname() or "host")


def process_start_time(pid: int) -> float | None:
    """``pid``'s start time (seconds since the epoch), or None when it is not running (a zombie is not)."""
    try:
        proc = psutil.Process(pid)
        if proc.status() == psutil.STATUS_ZOMBIE:
            return None
        return proc.create_time()
    except (psutil.NoSuchProcess, ValueError):
        return None
    except psutil.AccessDenied:  # running, owned by someone else
        return float("nan")


def pid_alive(pid: int, start_time: float | None = None) -> bool:
    """Whether process ``pid`` runs, and, when ``start_time`` is given, is the same process that started then
    (not a later process that got the pid again)."""
    if pid <= 0 or not psutil.pid_exists(pid):
        return False
    started = process_start_time(pid)
    if started is None:
        return False
    if start_time is None or started != started:  # nan: cannot tell, so assume it is the same one
        return True
    return abs(started - start_time) < 0.05


def write_owner(directory: Path, pid: int | None = None, **extra) -> None:
    """Record ``pid`` (default: this process) and its start time as ``directory``'s owner."""
    pid = os.getpid() if pid is None else pid
    record = {"hostname": hostname(), "pid": pid, "create_time": process_start_time(pid), **extra}
    tmp = directory / f"{OWNER_FILE}.{os.getpid()}.tmp"
    tmp.write_text(json.dumps(record))
    os.replace(tmp, directory / OWNER_FILE)


def read_owner(directory: Path) -> dict | None:
    try:
        record = json.loads((directory / OWNER_FILE).read_text())
        return record if isinstance(record, dict) else None
    except (OSError, ValueError):
        return None


def owner_gone(directory: Path) -> bool:
    """Whether ``directory`` belongs to a process of this host that no longer runs.  A directory of another
    host, or one without a readable owner, is never judged gone (except an engine directory by its name)."""
    owner = read_owner(directory)
    if owner is not None:
        if owner.get("hostname") != hostname():
            return False
        try:
            pid = int(owner["pid"])
        except (KeyError, TypeError, ValueError):
            return False
        start = owner.get("create_time")
        return not pid_alive(pid, float(start) if isinstance(start, (int, float)) else None)
    match = _ENGINE_DIR.match(directory.name)  # made but the marker not written yet: judge by the pid alone
    if match is None or match["host"] != hostname():
        return False
    return not pid_alive(int(match["pid"]))


def remove_stale(root: Path) -> list[Path]:
    """Remove every directory under ``root`` whose owner (on this host) is gone; returns what was removed."""
    removed = []
    try:
        entries = list(root.iterdir())
    except OSError:
        return removed
    for entry in entries:
        if entry.is_dir() and not entry.is_symlink() and owner_gone(entry):
            shutil.rmtree(entry, ignore_errors=True)
            if not entry.exists():
                removed.append(entry)
    return removed


def empty_dir(directory: Path) -> None:
    """Delete everything inside ``directory`` but keep the directory."""
    try:
        entries = list(directory.iterdir())
    except FileNotFoundError:
        return
    for entry in entries:
        if entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry, ignore_errors=True)
        else:
            try:
                entry.unlink()
            except FileNotFoundError:
                pass


def prepare_root(nvme_path: str | os.PathLike) -> Path:
    """``<nvme_path>/rayzero-swap``, created; errors name the path and the fix."""
    base = Path(nvme_path).expanduser()
    if base.exists() and not base.is_dir():
        raise ConfigError(
            f"nvme_path {str(base)!r} is not a directory; set zero_optimization.offload_optimizer.nvme_path "
            "(and offload_param.nvme_path) to a directory on a local disk"
        )
    root = base / SWAP_ROOT
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise PermissionError(
            f"cannot create the swap directory {str(root)!r} under nvme_path ({type(e).__name__}: {e}); point "
            "nvme_path at a directory this process can write, or fix its permissions"
        ) from None
    if not os.access(root, os.W_OK | os.X_OK):
        raise PermissionError(
            f"the swap directory {str(root)!r} under nvme_path is not writable by this process (uid {os.getuid()}); "
            "point nvme_path at a directory this process can write, or fix its permissions"
        )
    return root


@dataclass
class SwapDirLease:
    """A rank's swap directory.  ``release()`` removes the swap files: the whole directory when the engine
    made it (``owned_by_engine``), else only what is inside (the Ray node's actor owns the directory)."""

    path: Path
    owned_by_engine: bool
    released: bool = field(default=False, compare=False)

    def release(self) -> None:
        if self.released:
            return
        self.released = True
        if not self.owned_by_engine:
            empty_dir(self.path)
            return
        shutil.rmtree(self.path, ignore_errors=True)
        with _held_lock:
            _held.discard(self.path)
        try:  # leave nvme_path as it was when this was the last swap directory in it
            self.path.parent.rmdir()
        except OSError:
            pass


def acquire_swap_dir(nvme_path: str | os.PathLike, rank: int) -> SwapDirLease:
    """This rank's swap directory: ``$RAYZERO_SWAP_DIR`` when set (leased by the Ray node's actor), else a fresh
    ``<nvme_path>/rayzero-swap/<host>-<pid>-rank<rank>/`` after removing the directories of dead owners."""
    leased = os.environ.get(SWAP_DIR_ENV)
    if leased:
        path = Path(leased)
        try:
            path.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise PermissionError(
                f"cannot create the swap directory {leased!r} from ${SWAP_DIR_ENV} ({type(e).__name__}: {e}); "
                f"point nvme_path at a writable local directory, or unset {SWAP_DIR_ENV} outside rayzero.fit"
            ) from None
        if not os.access(path, os.W_OK | os.X_OK):
            raise PermissionError(f"the swap directory {leased!r} from ${SWAP_DIR_ENV} is not writable; point "
                                  "nvme_path at a writable local directory")
        return SwapDirLease(path, owned_by_engine=False)
    root = prepare_root(nvme_path)
    remove_stale(root)
    name = f"{hostname()}-{os.getpid()}-rank{rank}"
    for attempt in range(100):
        path = root / (name if attempt == 0 else f"{name}.{attempt}")
        with _held_lock:
            if path in _held:  # another engine of this process and rank holds it: take the next name
                continue
            try:
                path.mkdir(parents=True)
            except FileExistsError:  # left by an engine of this process that was never destroyed: reuse it
                empty_dir(path)
            _held.add(path)
        write_owner(path, rank=rank)
        return SwapDirLease(path, owned_by_engine=True)
    raise RuntimeError(f"this process already holds 100 swap directories for rank {rank} under {root}")
