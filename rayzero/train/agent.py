"""The per-node agent: one long-lived actor per node that reports what the driver needs to plan."""

from __future__ import annotations

import os

import ray


@ray.remote(num_cpus=0)
class NodeAgent:
    def report(self, swap_path: str | None = None) -> dict:
        from rayzero.accelerator import get_accelerator

        acc = get_accelerator()
        from rayzero.offload.swap_store import free_bytes

        swap = os.path.abspath(swap_path or os.getcwd())
        free = free_bytes(swap)  # of the filesystem that holds it (the nearest existing parent)
        total, available, source, host = _memory_limits(acc)
        return {
            "node_id": ray.get_runtime_context().get_node_id(),
            "hostname": os.uname().nodename,
            "accelerator": acc.name,
            "devices": acc.device_count(),
            "graph_capture": acc.supports_graph_capture(),
            "memory_total": total,
            "memory_available": available,
            "memory_source": source,
            "host_memory_total": host.total_bytes,
            "host_memory_source": host.source,
            "swap_path": swap,
            "swap_free": free,
        }


def _memory_limits(acc):
    """``(usable, available, source, host limit)``: the memory one worker may use.  On a CPU node that is the
    host's RAM capped by the cgroup (v1/v2) and rlimits of the agent's process, which the node's workers share
    (``detect_memory_limit``); on an accelerator it is the device's memory as the accelerator reports it
    (MIG slice, per-process fraction).  The host limit comes too: offloaded state lives there."""
    from rayzero.accelerator.memory_limits import detect_memory_limit

    host = detect_memory_limit()
    if acc.name == "cpu":
        limit = acc.memory_limit() if hasattr(acc, "memory_limit") else host
        return limit.total_bytes, limit.available_bytes, limit.source, host
    return acc.total_memory(), acc.available_memory(), f"{acc.name} device memory", host


def node_table(swap_path: str | None = None, timeout_s: float = 60.0) -> list[dict]:
    """Start (or reuse) one agent per alive node and collect their reports."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    agents = []
    for node in ray.nodes():
        if not node.get("Alive"):
            continue
        name = f"rayzero-agent-{node['NodeID'][:12]}"
        agent = NodeAgent.options(
            name=name,
            namespace="rayzero",
            lifetime="detached",
            get_if_exists=True,
            scheduling_strategy=NodeAffinitySchedulingStrategy(node["NodeID"], soft=False),
        ).remote()
        agents.append(agent)
    return ray.get([a.report.remote(swap_path) for a in agents], timeout=timeout_s)


def format_node_table(rows: list[dict]) -> str:
    gib = 1 << 30
    lines = [
        "node          accelerator  devices  graph-capture  memory (usable / avail GiB)  swap free GiB",
    ]
    for r in rows:
        lines.append(
            f"{r['hostname'][:12]:<13} {r['accelerator']:<12} {r['devices']:>7}  {str(r['graph_capture']):<13}  "
            f"{r['memory_total'] / gib:>10.1f} / {r['memory_available'] / gib:<10.1f}     {r['swap_free'] / gib:>8.1f}"
        )
    return "\n".join(lines)
