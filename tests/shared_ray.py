"""One local Ray cluster for the test modules that each want the same one (3 CPUs, workers importing this
checkout): started by the first such module, kept for the next, stopped before any module that starts a
cluster of its own and at the end of the session.  A module opts in with ``SHARED_RAY = True`` and its
fixture calls :func:`start`; conftest.py runs the opted-in modules last, one after another, so the suite
starts the cluster once (``ray.init`` is ~7 s here) instead of once per module."""

from __future__ import annotations

from ray_cases import WORKER_PYTHONPATH

_ours = False


def start() -> str:
    """The shared cluster, started if it is not up; returns its GCS address."""
    global _ours
    import ray

    if ray.is_initialized() and not _ours:
        ray.shutdown()  # a cluster some other module left connected
    if not ray.is_initialized():
        ray.init(num_cpus=3, include_dashboard=False, runtime_env={"env_vars": {"PYTHONPATH": WORKER_PYTHONPATH}})
        _ours = True
    return ray.get_runtime_context().gcs_address


def stop() -> None:
    """Stop the shared cluster if it is up (before a module with a cluster of its own, and at the end)."""
    global _ours
    if not _ours:
        return
    import ray

    if ray.is_initialized():
        ray.shutdown()
    _ours = False


def opted_in(module) -> bool:
    return bool(getattr(module, "SHARED_RAY", False))
