"""The per-node owner of a run's NVMe swap directory: one ``NodeSwapStore`` actor per node and run.

It owns ``<nvme_path>/rayzero-swap/<run>/`` on its node and leases each rank of the run a subdirectory
(``rank<r>-pid<pid>``), which the worker hands to the engine through ``$RAYZERO_SWAP_DIR``
(``rayzero/offload/swap_dirs.py``).  The workers of a node run on the same host as its actor, so the actor
can tell which leases are held by a live process: whenever a rank leases (and every few seconds), it removes
the subdirectories of leases whose process died (SIGKILL, node trouble) and of ranks no longer leased by a live
process (an elastic resize gave the rank to a new worker, or the rank is gone).  So restarts and resizes
leave no swap files behind, and ``shutdown()`` (called by the driver when ``fit`` ends, however it ends)
removes the run's directory.  ``capacity()`` tells the driver the free disk space there before launch.

The actor is named ``rayzero-swap-<node id>`` in the namespace ``rayzero-swap-<run name>``, pinned to its
node (``NodeAffinitySchedulingStrategy``, hard) with ``num_cpus=0`` (``rayzero/train/node_actors.py``).  The
driver's stores are not detached: they go when the driver goes, and the next actor on that node removes what
one left (the run directory records the owning process).  A worker on a node that joined after launch
creates its node's store detached; the driver ends it with the others when ``fit`` ends.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import threading
from pathlib import Path

import ray

from rayzero.offload.swap_dirs import pid_alive, prepare_root, process_start_time, remove_stale, write_owner
from rayzero.train.node_actors import actor_name, actor_namespace, node_actor, shutdown_node_actors

logger = logging.getLogger("rayzero")

_RANK_DIR = re.compile(r"^rank(?P<rank>\d+)-pid(?P<pid>\d+)$")


def _used_bytes(path: Path) -> int:
    used = 0
    for dirpath, _dirs, files in os.walk(path):
        for name in files:
            try:
                used += os.lstat(os.path.join(dirpath, name)).st_blocks * 512
            except OSError:
                pass
    return used


@ray.remote(num_cpus=0)
class NodeSwapStore:
    """Owns ``<nvme_path>/rayzero-swap/<run_name>/`` on this node; leases one subdirectory per rank."""

    def __init__(self, nvme_path: str, run_name: str, sweep_interval_s: float = 5.0):
        self.nvme_path = nvme_path
        self.node_id = ray.get_runtime_context().get_node_id()
        self.hostname = os.uname().nodename
        self.error: str | None = None
        self.leases: dict[int, tuple[int, float | None]] = {}  # rank -> (pid, its start time)
        self.lock = threading.Lock()
        self.stop = threading.Event()
        try:
            root = prepare_root(nvme_path)
            self.run_dir = root / run_name
            self.run_dir.mkdir(exist_ok=True)
            write_owner(self.run_dir, kind="ray-run", run=run_name)
            # runs whose actor is gone and local engines that died, on this host; then this run's own leftovers
            for gone in remove_stale(root):
                logger.info("removed stale swap directory %s", gone)
            self._adopt()
        except (OSError, ValueError) as e:  # a bad nvme_path on this node: say so on every call
            self.error = f"{type(e).__name__}: {e}"
            self.run_dir = Path(nvme_path) / "rayzero-swap" / run_name
            return
        if sweep_interval_s > 0:
            threading.Thread(target=self._sweep_every, args=(sweep_interval_s,), daemon=True,
                             name="rayzero-swap-sweep").start()

    # ---- the leases ------------------------------------------------------------------------------------
    def _rank_dirs(self) -> list[tuple[Path, int, int]]:
        out = []
        try:
            entries = list(self.run_dir.iterdir())
        except OSError:
            return out
        for entry in entries:
            m = _RANK_DIR.match(entry.name)
            if m and entry.is_dir():
                out.append((entry, int(m["rank"]), int(m["pid"])))
        return out

    def _adopt(self) -> None:
        """A new actor of a run (its previous one died): keep the directories of live workers, drop the rest."""
        for path, rank, pid in self._rank_dirs():
            started = process_start_time(pid)
            if started is not None and rank not in self.leases:
                self.leases[rank] = (pid, started)
            else:
                shutil.rmtree(path, ignore_errors=True)

    def _sweep(self) -> list[str]:
        """Forget leases whose process died; remove every subdirectory that is not a live lease's."""
        for rank, (pid, started) in list(self.leases.items()):
            if not pid_alive(pid, started):
                del self.leases[rank]
        removed = []
        for path, rank, pid in self._rank_dirs():
            if self.leases.get(rank, (None,))[0] != pid:
                shutil.rmtree(path, ignore_errors=True)
                removed.append(str(path))
        return removed

    def _sweep_every(self, interval_s: float) -> None:
        while not self.stop.wait(interval_s):
            with self.lock:
                try:
                    self._sweep()
                except Exception:  # never let the thread die; the next lease sweeps again
                    logger.exception("swap sweep failed")

    def _check(self) -> None:
        if self.error is not None:
            raise RuntimeError(
                f"the swap directory under nvme_path {self.nvme_path!r} cannot be used on node {self.hostname} "
                f"({self.error}); point nvme_path at a writable local directory that exists on every node"
            )

    def lease(self, rank: int, pid: int) -> str:
        """The subdirectory for ``rank`` held by process ``pid`` (on this node), empty and ready.  First removes
        the subdirectories of dead processes and of ranks no longer leased (a previous holder of ``rank``)."""
        self._check()
        started = process_start_time(pid)
        if started is None:
            raise ValueError(f"process {pid} is not running on node {self.hostname}; a rank leases its swap "
                             "directory from its own node's NodeSwapStore")
        with self.lock:
            self.leases[rank] = (pid, started)
            self._sweep()
            path = self.run_dir / f"rank{rank}-pid{pid}"
            path.mkdir(parents=True, exist_ok=True)
            return str(path)

    def release(self, rank: int, pid: int | None = None) -> None:
        """``rank`` is done: remove its subdirectory (unless ``pid`` is given and no longer holds the lease)."""
        with self.lock:
            held = self.leases.get(rank)
            if held is None or (pid is not None and held[0] != pid):
                return
            del self.leases[rank]
            self._sweep()

    def sweep(self) -> list[str]:
        """Sweep now (it also runs every few seconds); returns the removed directories."""
        with self.lock:
            return self._sweep() if self.error is None else []

    def alive(self) -> dict[int, int]:
        """``{rank: pid}`` of the leases held by live processes."""
        with self.lock:
            if self.error is None:
                self._sweep()
            return {rank: pid for rank, (pid, _) in sorted(self.leases.items())}

    def capacity(self) -> dict:
        """``free_bytes`` on the disk holding the run's swap directory, ``used_bytes`` by it, its ``path``;
        ``error`` when nvme_path cannot be used on this node."""
        out = {"path": str(self.run_dir), "node_id": self.node_id, "hostname": self.hostname,
               "free_bytes": 0, "used_bytes": 0, "error": self.error}
        if self.error is None:
            usage = shutil.disk_usage(self.run_dir)
            out.update(free_bytes=usage.free, total_bytes=usage.total, used_bytes=_used_bytes(self.run_dir))
        return out

    def shutdown(self) -> None:
        """Remove the run's swap directory (and ``rayzero-swap`` when that leaves it empty)."""
        self.stop.set()
        with self.lock:
            self.leases.clear()
            shutil.rmtree(self.run_dir, ignore_errors=True)
            try:
                self.run_dir.parent.rmdir()
            except OSError:
                pass


# ---- handles (driver and workers) ----------------------------------------------------------------------
KIND = "rayzero-swap"


def store_name(node_id: str) -> str:
    return actor_name(KIND, node_id)


def store_namespace(run_name: str) -> str:
    return actor_namespace(KIND, run_name)


def node_swap_store(nvme_path: str, run_name: str, node_id: str | None = None, detached: bool = False):
    """The run's NodeSwapStore on ``node_id`` (default: this process's node), created if it does not exist.

    Workers pass ``detached=True``: the store a worker creates (on a node that joined after launch) must
    outlive that worker; the driver's ``shutdown_stores`` ends it with the rest (``node_actors``)."""
    return node_actor(NodeSwapStore, KIND, run_name, nvme_path, run_name, node_id=node_id, detached=detached)


def start_stores(nvme_path: str, run_name: str, node_ids: list[str], handles: dict, timeout_s: float = 60.0
                 ) -> dict[str, dict]:
    """Start the run's store on each node, put the handles in ``handles`` (``{node_id: handle}``, which the
    caller keeps until ``shutdown_stores``) and return ``{node_id: capacity()}``."""
    for node in node_ids:
        handles[node] = node_swap_store(nvme_path, run_name, node)
    reports = ray.get([handles[node].capacity.remote() for node in node_ids], timeout=timeout_s)
    return dict(zip(node_ids, reports))


def shutdown_stores(run_name: str, handles: dict | None = None, timeout_s: float = 30.0) -> int:
    """Shut down the run's stores (those in ``handles`` and any other found by name on an alive node), which
    removes the run's swap files, and end them; returns how many."""
    return shutdown_node_actors(KIND, run_name, handles, timeout_s)
