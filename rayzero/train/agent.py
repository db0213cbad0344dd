"""The node's accelerator actor (``NodeAgent``): one per node, for the length of a report, that holds the
node's devices, probes what they really do and says what the driver needs to plan; and what the driver
knows of the cluster's capacity: the worker slots each node has and whether an autoscaler can add more.

Where Ray counts GPUs on a node, its agent asks Ray for all of them, so Ray shows the devices to it (and
marks them in use while it probes); the agent lives only for the report and gives them back before any
worker starts.  If they are busy (another run holds them), a device-less agent reports instead and the
node's row says so."""

from __future__ import annotations

import json
import math
import os
import re
import time

import ray


@ray.remote(num_cpus=0)
class NodeAgent:
    def ping(self) -> bool:
        return True

    def report(self, swap_path: str | None = None) -> dict:
        from rayzero.accelerator import get_accelerator
        from rayzero.accelerator.probe import probe

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
            "gpu_ids": [str(i) for i in ray.get_gpu_ids()],  # the devices Ray gave this agent
            "probe": probe(acc),
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


def _start_agents(nodes: list[dict], device_wait_s: float) -> tuple[list, list[str]]:
    """One agent per node, holding the node's GPUs where Ray counts any.  An agent whose GPUs are not
    granted within ``device_wait_s`` (another run holds them) is replaced by one that asks for none."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    def start(node: dict, gpus: float):
        return NodeAgent.options(
            num_gpus=gpus, scheduling_strategy=NodeAffinitySchedulingStrategy(node["NodeID"], soft=False),
        ).remote()

    agents = [start(n, (n.get("Resources") or {}).get("GPU", 0)) for n in nodes]
    notes = [""] * len(nodes)
    waiting = {a.ping.remote(): i for i, a in enumerate(agents) if (nodes[i].get("Resources") or {}).get("GPU")}
    if waiting:
        ready, _ = ray.wait(list(waiting), num_returns=len(waiting), timeout=device_wait_s)
        for call, i in waiting.items():
            if call not in ready:
                ray.kill(agents[i])
                agents[i] = start(nodes[i], 0)
                notes[i] = f"its GPUs were not granted within {device_wait_s:g} s (in use by another job?): " \
                           "not probed"
    return agents, notes


def node_table(swap_path: str | None = None, timeout_s: float = 60.0, device_wait_s: float = 30.0) -> list[dict]:
    """Start one agent per alive node, collect their reports and stop the agents; each report also carries the
    node's Ray resources (``ray_resources``: the totals Ray schedules workers on).

    Each agent holds its node's GPUs while it reports (``device_wait_s``: how long to wait for them before
    reporting without them), probes them (``rayzero.accelerator.probe``) and is stopped afterwards.
    The agents live only for the report (nothing is left on the cluster when a run ends), and a node whose
    agent does not answer within ``timeout_s`` (it died, or left the cluster after it was listed) is left
    out with a warning instead of failing the run; no answer from any node is an error."""
    import logging

    nodes = [n for n in ray.nodes() if n.get("Alive")]
    agents, notes = _start_agents(nodes, device_wait_s)
    calls = [a.report.remote(swap_path) for a in agents]
    try:
        ready, _ = ray.wait(calls, num_returns=len(calls), timeout=timeout_s)
        reports, missing = [], []
        for i, (call, node) in enumerate(zip(calls, nodes)):
            try:
                if call not in ready:
                    raise TimeoutError(f"no report within {timeout_s:g} s")
                report = ray.get(call)
            except Exception as e:  # noqa: BLE001 - one node's failure is reported, not raised
                missing.append(f"{node['NodeID'][:12]} ({node.get('NodeManagerAddress', '?')}): {type(e).__name__}: {e}")
                continue
            report["ray_resources"] = dict(node.get("Resources") or {})
            report["note"] = notes[i]
            reports.append(report)
    finally:
        for a in agents:
            ray.kill(a)
    if missing:
        logging.getLogger("rayzero").warning("nodes left out of the node table: %s", "; ".join(missing))
    if not reports:
        raise RuntimeError(f"no node of the Ray cluster reported within {timeout_s:g} s: {'; '.join(missing)}")
    return reports


def _devices(r: dict) -> str:
    """What a node offers its workers, as Ray schedules them: its GPUs where Ray counts any, else its CPUs.

    Counted from Ray's resources where the agent could not hold the node's GPUs (not granted): Ray then
    hides them from it."""
    ray_res = r.get("ray_resources") or {}
    if r["accelerator"] != "cpu":
        return f"{r['devices']} {'GPU' if r['accelerator'] == 'cuda' else r['accelerator']}"
    if ray_res.get("GPU"):
        return f"{ray_res['GPU']:g} GPU"
    cpus = ray_res.get("CPU")
    return f"{cpus:g} CPU" if cpus is not None else "cpu"


def _accelerator(r: dict) -> str:
    """The agent's accelerator kind; "gpu" where Ray counts GPUs the agent cannot see (see ``_devices``)."""
    if r["accelerator"] == "cpu" and (r.get("ray_resources") or {}).get("GPU"):
        return "gpu"
    return r["accelerator"]


def format_node_table(rows: list[dict]) -> str:
    gib = 1 << 30
    lines = [
        "node          accelerator  devices  works (probed)           memory (usable / avail GiB)  free disk GiB",
    ]
    notes = []
    for r in rows:
        lines.append(
            f"{r['hostname'][:12]:<13} {_accelerator(r):<12} {_devices(r):>7}  {_works(r):<24} "
            f"{r['memory_total'] / gib:>10.1f} / {r['memory_available'] / gib:<10.1f}     {r['swap_free'] / gib:>8.1f}"
        )
        failed = (r.get("probe") or {}).get("errors") or {}
        if r.get("note") or failed:
            why = r.get("note") or "; ".join(f"{k}: {v}" for k, v in failed.items())
            notes.append(f"  {r['hostname']}: {why}")
    return "\n".join(lines + notes)


_SHORT = {"bf16": "bf16", "fp16": "fp16", "fused_optimizer": "fused", "graph_capture": "capture"}


def _works(r: dict) -> str:
    """What the node's probe found working, comma-separated ("-" for nothing, "?" when not probed)."""
    probe = r.get("probe")
    if not probe or r.get("note"):
        return "?"
    return ",".join(short for name, short in _SHORT.items() if probe.get(name)) or "-"


# ---- capacity: worker slots, and whether the cluster can grow -----------------------------------------------


def worker_bundle(resources_per_worker: dict, use_gpu: bool) -> dict:
    """The Ray resources one worker takes: ``resources_per_worker``, plus one GPU with ``use_gpu`` when it names
    none (Ray Train then gives each worker one)."""
    bundle = {k: float(v) for k, v in resources_per_worker.items() if v and v > 0}
    if use_gpu and "GPU" not in bundle:
        bundle["GPU"] = 1.0
    return bundle


def slots(resources: dict, bundle: dict) -> int:
    """How many workers of ``bundle`` fit in ``resources`` (one node's: a worker never spans nodes)."""
    if not bundle:
        return 1 << 30
    return min(int(math.floor(resources.get(k, 0.0) / v + 1e-9)) for k, v in bundle.items())


def _amounts(resources: dict, keys) -> str:
    return ", ".join(f"{resources.get(k, 0.0):g} {k}" for k in keys)


def describe_slots(bundle: dict, nodes: list[tuple[str, dict, dict]], want: int, free: bool = False,
                   most: int = 4) -> str:
    """``have 1 of 2 worker slots: each worker needs 2 CPU; node vm has 3 CPU (1 slot)`` (``3 worker slots: ...``
    when there are enough).  ``nodes`` are ``(name, total resources, available resources)``; ``free`` counts what
    is free now instead of the totals."""
    have = sum(slots(avail if free else total, bundle) for _, total, avail in nodes)
    keys = list(bundle)
    parts = []
    for name, total, avail in nodes[:most]:
        n = slots(avail if free else total, bundle)
        amount = (", ".join(f"{avail.get(k, 0.0):g} of {total.get(k, 0.0):g} {k} free" for k in keys) if free
                  else _amounts(total, keys))
        parts.append(f"node {name} has {amount} ({n} slot{'' if n == 1 else 's'})")
    if len(nodes) > most:
        parts.append(f"and {len(nodes) - most} more node(s)")
    if not nodes:
        parts.append("no node is alive")
    need = " + ".join(f"{v:g} {k}" for k, v in bundle.items()) or "nothing"
    free_ = " free" if free else ""
    head = (f"have {have} of {want} worker slot{'' if want == 1 else 's'}{free_}" if have < want
            else f"{have} worker slot{'' if have == 1 else 's'}{free_}")
    return f"{head}: each worker needs {need}; " + "; ".join(parts)


def cluster_nodes() -> list[tuple[str, dict, dict]]:
    """``(name, total, available)`` resources of every alive node (name: its hostname)."""
    import ray._private.state as state

    try:
        available = state.available_resources_per_node()
    except Exception:  # an older or newer Ray without it: the totals stand in
        available = {}
    out = []
    for node in ray.nodes():
        if not node.get("Alive"):
            continue
        total = dict(node.get("Resources") or {})
        name = node.get("NodeManagerHostname") or node.get("NodeManagerAddress") or node["NodeID"][:12]
        out.append((name, total, dict(available.get(node["NodeID"], total))))
    return out


READONLY_NODE_TYPE = re.compile(r"^node_[0-9a-f]{16,}$")  # the read-only provider's name for a hand-started node


def autoscaler_node_types(status: dict) -> set[str] | None:
    """The node types an autoscaler status report (Ray's ``ray status`` record, autoscaler v1) names, or None
    when it carries no autoscaler report."""
    report = (status or {}).get("autoscaler_report")
    if not isinstance(report, dict):
        return None
    types = set((report.get("node_type_mapping") or {}).values())
    for key in ("active_nodes", "idle_nodes", "pending_launches"):
        types.update((report.get(key) or {}).keys())
    types.update(t for _, t, *_ in (report.get("pending_nodes") or []) if isinstance(t, str))
    return types


def can_autoscale(node_types: set[str] | None) -> bool:
    """An autoscaler that can add nodes names the node types of its config (``ray.head.default``, a KubeRay
    worker group, ...).  A cluster started by hand with ``ray start`` (or ``ray.init``) runs the monitor with
    the read-only provider, whose node types are ``node_<node id>``: it never adds a node."""
    return bool(node_types) and any(t and not READONLY_NODE_TYPE.match(t) for t in node_types)


UNREADABLE = {"(autoscaler status unreadable)"}


def autoscaler_status(wait_s: float = 6.0) -> tuple[bool, str]:
    """``(whether an autoscaler can add nodes to the connected cluster, why we think so)``.

    Ray 2.60 has no public call for this (ray-project/ray#37838).  The signals, in order: the cluster config an
    autoscaler reports to the GCS (what Ray Train itself reads to refuse worker groups larger than the cluster's
    maximum); else the autoscaler's status record that ``ray status`` prints (v1: the GCS key
    ``__autoscaling_status``; v2: ``get_cluster_status``), whose node types say whether it runs a real provider
    or the read-only one.  The monitor writes that record every few seconds, so a cluster that has just started
    may take ``wait_s`` to show it.  No record at all: nothing autoscales the cluster."""
    import ray._private.state as state

    try:
        config = state.state.get_cluster_config()
    except Exception:
        config = None
    if config is not None and list(config.node_group_configs):
        groups = sorted(g.name or "?" for g in config.node_group_configs)
        return True, f"the cluster's autoscaling config has node groups {groups}"
    deadline = time.monotonic() + wait_s
    while True:
        types = _node_types_now()
        if types is not None or time.monotonic() >= deadline:
            break
        time.sleep(1.0)
    if types is None:
        return False, "no autoscaler reports to this cluster (`ray status` shows no autoscaler)"
    if types == UNREADABLE:  # not a "no": let the driver wait, bounded by start_timeout_s
        return True, "the autoscaler's status could not be read, so the driver waits for the cluster to grow"
    if can_autoscale(types):
        return True, f"an autoscaler runs with node types {sorted(t for t in types if t)}"
    return False, ("it has no autoscaler: its nodes were started by hand (`ray start` or `ray.init`), and its "
                   "monitor only mirrors them (the read-only provider)")


def _node_types_now() -> set[str] | None:
    try:
        from ray.autoscaler.v2.utils import is_autoscaler_v2

        v2 = is_autoscaler_v2(fetch_from_server=True)
    except Exception:
        v2 = False
    if v2:  # an autoscaler v2 monitor runs: its status names the node types (a failure to read it: assume it can)
        try:
            from ray.autoscaler.v2.sdk import get_cluster_status

            status = get_cluster_status(ray.get_runtime_context().gcs_address)
            types = {n.ray_node_type_name for n in list(status.active_nodes) + list(status.idle_nodes)}
            types.update(p.ray_node_type_name for p in status.pending_launches)
            types.update(p.ray_node_type_name for p in status.pending_nodes)
            return types
        except Exception:
            return {"(autoscaler v2: node types unknown)"}
    try:
        from ray._private import ray_constants
        from ray.experimental.internal_kv import _internal_kv_get

        raw = _internal_kv_get(ray_constants.DEBUG_AUTOSCALING_STATUS)
        return autoscaler_node_types(json.loads(raw)) if raw else None
    except Exception:  # a Ray without this key, a client connection, ...: unknown, not "no autoscaler"
        return UNREADABLE


def started_here() -> bool:
    """Whether this process started the Ray cluster it is connected to (``ray.init()`` with no cluster to
    join): such a local cluster has no autoscaler."""
    node = getattr(ray._private.worker, "_global_node", None)
    return bool(node is not None and getattr(node, "head", False))


def check_probes(cfg, rows: list[dict]) -> None:
    """Refuse, before any worker starts, a config that asks a node's device for what its probe found broken
    (bf16 or fp16 compute, graph capture).  Nodes that were not probed are not judged."""
    from rayzero.config import ConfigError

    wanted = {
        "bf16": (cfg.bf16.enabled, "set bf16.enabled to false (fp16 or fp32), or leave that node out"),
        "fp16": (cfg.fp16.enabled, "set fp16.enabled to false (bf16 or fp32), or leave that node out"),
        "graph_capture": (cfg.graph_capture.enabled, "set graph_capture.enabled to false"),
    }
    for r in rows:
        probe = r.get("probe")
        if not probe or r.get("note"):
            continue
        for name, (on, fix) in wanted.items():
            if on and not probe.get(name):
                why = (probe.get("errors") or {}).get(name, "the device said it cannot")
                raise ConfigError(
                    f"the config enables {name}, but node {r['hostname']}'s {r['accelerator']} device failed the "
                    f"{name} probe ({why}); {fix}"
                )
