"""The per-node owner of a run's compile cache: one ``NodeCompileCache`` actor per node and run.

Graph capture compiles (inductor on CPU, CUDA graphs through inductor on GPUs).  What a compile leaves has
two parts: the ``torch.compiler`` artifacts (generated code, portable) and inductor's built kernels (on CPU
the C++ shared objects, most of a compile's time, which load only on a host with the same architecture,
Python and compiler).  The actor owns, on its node, the cache directory the node's workers compile into
(``<tmp>/rayzero-compile/<run>/``): each worker leases it (``lease``) and hands it to its engine as
``graph_capture.cache_dir``; the first rank of the node writes the artifacts there after its first captured
step, and inductor puts its kernels beside them.

The actor keeps that directory in step with the run's storage (``<run>/compile_cache/``, a path or a URI):

* when it starts, and when a rank leases while it has nothing yet, it fetches the run's artifacts and the
  kernels built on a host like its own (``inductor-...-<host key>.tar``), so a worker group restarted after
  a failure or a resize, or a node the autoscaler just added, compiles nothing the run already compiled;
* every few seconds, and at shutdown, it uploads what its node compiled that the run does not have yet
  (new artifacts, with the node's kernels archived next to them).

``shutdown()`` (the driver calls it when ``fit`` ends, however it ends) uploads a last time and removes the
node's directory, so a run leaves nothing on its nodes; the run's storage keeps the cache.  Handles and the
actor's lifetime: ``rayzero/train/node_actors.py``.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
import threading
from pathlib import Path

import ray

from rayzero.capture.cache import cache_file, kernel_archive_name, kernel_dir, pack_kernels, unpack_kernels
from rayzero.train.node_actors import node_actor, shutdown_node_actors

logger = logging.getLogger("rayzero")

KIND = "rayzero-compile"


class CompileCacheOwner:
    """The node's side of a run's compile cache (the actor's logic; ``NodeCompileCache`` runs it on Ray)."""

    def __init__(self, run_cache: str, run_name: str, root: str | None = None, sync_interval_s: float = 5.0):
        from rayzero.checkpoint.storage import Storage

        self.run = Storage.resolve(run_cache if "://" in run_cache else os.path.expanduser(run_cache))
        self.node_dir = Path(root or tempfile.gettempdir()) / "rayzero-compile" / run_name
        self.node_dir.mkdir(parents=True, exist_ok=True)
        self.lock = threading.Lock()
        self.kinds: set[str] = set()  # device kinds leased so far: the ones to keep in step
        self.synced: dict[str, tuple[int, int] | None] = {}  # kind -> (mtime_ns, size) of the artifacts in step
        self.fetched: dict[str, dict] = {}  # kind -> what the last fetch brought (for the driver and tests)
        self.uploads = 0
        self.stop = threading.Event()
        if sync_interval_s > 0:
            threading.Thread(target=self._sync_every, args=(sync_interval_s,), daemon=True,
                             name="rayzero-compile-sync").start()

    # ---- files ---------------------------------------------------------------------------------------
    def _run_location(self, name: str) -> str:
        return self.run.join(name)

    @staticmethod
    def _stamp(path: Path) -> tuple[int, int] | None:
        try:
            st = path.stat()
        except OSError:
            return None
        return st.st_mtime_ns, st.st_size

    def _fetch(self, kind: str) -> dict:
        """Bring the run's artifacts (and kernels built on a host like this one) into the node's directory,
        when the node has no artifacts of ``kind`` yet."""
        local = cache_file(str(self.node_dir), kind)
        got = {"artifacts_bytes": 0, "kernel_files": 0}
        if local.exists():
            return got
        try:
            archive = self._run_location(kernel_archive_name(kind))
            if self.run.exists(archive):
                got["kernel_files"] = unpack_kernels(self.run.read_bytes(archive), kernel_dir(str(self.node_dir), kind))
            artifacts = self._run_location(local.name)
            if self.run.exists(artifacts):
                data = self.run.read_bytes(artifacts)
                tmp = local.with_suffix(".part")
                tmp.write_bytes(data)
                os.replace(tmp, local)
                got["artifacts_bytes"] = len(data)
        except Exception as e:  # noqa: BLE001 - an unreadable run cache costs a compile, never the run
            logger.warning("rayzero: the run's compile cache %s could not be fetched (%s); compiling afresh",
                           self.run.root, e)
        # what was fetched is in step with the run: not uploaded back
        self.synced[kind] = self._stamp(local)
        self.fetched[kind] = got
        return got

    def _upload(self, kind: str) -> int:
        """Upload the node's artifacts of ``kind`` and its kernels when they changed since the last sync;
        returns the bytes written."""
        local = cache_file(str(self.node_dir), kind)
        stamp = self._stamp(local)
        if stamp is None or stamp == self.synced.get(kind):
            return 0
        written = 0
        try:
            data = local.read_bytes()  # written whole by the engine (renamed into place)
            kernels = kernel_dir(str(self.node_dir), kind)
            self.run.makedirs(self.run.root)
            if kernels.is_dir():  # the kernels first: a reader that sees new artifacts finds their kernels
                archive = pack_kernels(kernels)
                self.run.write_bytes_atomic(self._run_location(kernel_archive_name(kind)), archive, durable=False)
                written += len(archive)
            self.run.write_bytes_atomic(self._run_location(local.name), data, durable=False)
            written += len(data)
        except OSError as e:  # a full disk or an unreachable store: try again at the next sync
            logger.warning("rayzero: the compile cache of this node could not be uploaded to %s (%s)",
                           self.run.root, e)
            return 0
        self.synced[kind] = stamp
        self.uploads += 1
        return written

    # ---- the calls -------------------------------------------------------------------------------------
    def lease(self, device_kind: str) -> str:
        """The node's cache directory for a rank about to capture on ``device_kind``, with what the run has
        already compiled in it."""
        with self.lock:
            self.kinds.add(device_kind)
            self._fetch(device_kind)
            return str(self.node_dir)

    def sync(self) -> int:
        """Upload what the node compiled that the run does not have (it also runs every few seconds)."""
        with self.lock:
            return sum(self._upload(kind) for kind in sorted(self.kinds))

    def _sync_every(self, interval_s: float) -> None:
        while not self.stop.wait(interval_s):
            try:
                self.sync()
            except Exception:  # never let the thread die; the next sync tries again
                logger.exception("compile cache sync failed")

    def info(self) -> dict:
        with self.lock:
            return {"node_dir": str(self.node_dir), "fetched": dict(self.fetched), "uploads": self.uploads}

    def shutdown(self) -> int:
        """Upload a last time, then remove the node's directory; returns the bytes uploaded."""
        self.stop.set()
        written = self.sync()
        with self.lock:
            shutil.rmtree(self.node_dir, ignore_errors=True)
            try:
                self.node_dir.parent.rmdir()  # rayzero-compile/, when no other run uses it
            except OSError:
                pass
        return written


NodeCompileCache = ray.remote(num_cpus=0)(CompileCacheOwner)


# ---- handles (driver and workers) ----------------------------------------------------------------------
def node_compile_cache(run_cache: str, run_name: str, node_id: str | None = None, detached: bool = False):
    """The run's NodeCompileCache on ``node_id`` (default: this process's node), created if it does not exist
    (workers pass ``detached=True``: see ``node_actors``)."""
    return node_actor(NodeCompileCache, KIND, run_name, run_cache, run_name, node_id=node_id, detached=detached)


def start_compile_caches(run_cache: str, run_name: str, node_ids: list[str], handles: dict,
                         timeout_s: float = 60.0) -> None:
    """Start the run's compile cache actor on each node; the caller keeps ``handles`` until the run ends.
    A node whose actor does not start is left out with a warning (its workers compile, and create the actor
    themselves if the node comes back): a cache is never worth a run."""
    def left_out(node: str, e: Exception) -> None:
        logger.warning("rayzero: no compile cache on node %s (%s); its workers compile for themselves", node, e)

    started = {}
    for node in node_ids:
        try:
            started[node] = node_compile_cache(run_cache, run_name, node)
        except Exception as e:  # noqa: BLE001 - a node Ray no longer knows
            left_out(node, e)
    for node, handle in started.items():
        try:
            ray.get(handle.info.remote(), timeout=timeout_s)
        except Exception as e:  # noqa: BLE001 - a dead or unreachable node
            left_out(node, e)
            ray.kill(handle)
            continue
        handles[node] = handle


def shutdown_compile_caches(run_name: str, handles: dict | None = None, timeout_s: float = 120.0) -> int:
    """Upload what each node compiled, remove the nodes' directories and end the actors; returns how many."""
    return shutdown_node_actors(KIND, run_name, handles, timeout_s)
