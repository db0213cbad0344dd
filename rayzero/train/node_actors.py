"""Handles of a run's per-node actors (the NVMe swap store, the compile cache): one actor of a kind per node
and run, named ``<kind>-<node id>`` in the namespace ``<kind>-<run name>``, pinned to its node, taking no CPU.

Such an actor is not detached when the driver creates it: it goes when the driver goes.  A worker on a node
that joined after launch creates its node's actor detached (it must outlive that worker); the driver's
:func:`shutdown_node_actors` finds every actor of the run by name and ends it, however the run ended."""

from __future__ import annotations

import logging

import ray

logger = logging.getLogger("rayzero")


def actor_name(kind: str, node_id: str) -> str:
    return f"{kind}-{node_id}"


def actor_namespace(kind: str, run_name: str) -> str:
    return f"{kind}-{run_name}"


def node_actor(cls, kind: str, run_name: str, *args, node_id: str | None = None, detached: bool = False):
    """The run's actor of ``kind`` on ``node_id`` (default: this process's node), created from
    ``cls(*args)`` if it does not exist.  A non-detached actor ends when the last handle of its creator goes
    (Ray counts them), so the creator keeps the handle for as long as the run uses it."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    node_id = node_id or ray.get_runtime_context().get_node_id()
    return cls.options(
        name=actor_name(kind, node_id),
        namespace=actor_namespace(kind, run_name),
        get_if_exists=True,
        lifetime="detached" if detached else None,
        scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False),
    ).remote(*args)


def shutdown_node_actors(kind: str, run_name: str, handles: dict | None = None, timeout_s: float = 30.0) -> int:
    """Call ``shutdown()`` on every actor of ``kind`` of the run (those in ``handles``, ``{node_id: handle}``,
    and any other found by name on an alive node), then end it; returns how many."""
    found = dict(handles or {})
    for node in ray.nodes():
        if node["NodeID"] in found or not node.get("Alive"):
            continue
        try:
            found[node["NodeID"]] = ray.get_actor(actor_name(kind, node["NodeID"]),
                                                  namespace=actor_namespace(kind, run_name))
        except ValueError:  # no actor of this run on that node
            continue
    for handle in found.values():
        try:
            ray.get(handle.shutdown.remote(), timeout=timeout_s)
        except Exception as e:  # a node that went away: its next actor cleans up after it
            logger.warning("could not shut down a %s actor of run %s: %s", kind, run_name, e)
        ray.kill(handle)
    return len(found)
