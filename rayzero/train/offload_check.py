"""The driver's offload planning before launch: what ``"device": "auto"`` becomes, and whether the NVMe swap
of the run fits each node's disk.  The bytes are ``rayzero/memory.py``'s (counted over the model as ``fit``'s
memory check counts them); the decisions are ``rayzero/offload/plan.py``'s and this module's, from the config
and the node reports."""

from __future__ import annotations

import logging
import os

import torch

from rayzero.config import Config, ConfigError
from rayzero.memory import GIB, model_state_bytes, swap_bytes
from rayzero.offload.plan import resolve_auto_offload
from rayzero.train.cluster_config import ClusterConfig

logger = logging.getLogger("rayzero")


def uses_nvme(cfg: Config) -> bool:
    z = cfg.zero_optimization
    return z.offload_optimizer.device == "nvme" or z.offload_param.device == "nvme"


def swap_path(cfg: Config) -> str | None:
    """The nvme_path the run's swap directory goes under (the optimizer's, else the parameters')."""
    z = cfg.zero_optimization
    for section in (z.offload_optimizer, z.offload_param):
        if section.device in ("nvme", "auto") and section.nvme_path:
            return section.nvme_path
    return None


def absolute_nvme_paths(cfg: Config) -> None:
    """Make nvme_path absolute as the driver sees it: workers and actors run in other directories.  (Two
    different paths are refused by the config itself: a rank has one swap directory.)"""
    z = cfg.zero_optimization
    for section in (z.offload_optimizer, z.offload_param):
        if section.nvme_path:
            section.nvme_path = os.path.abspath(os.path.expanduser(section.nvme_path))


def worker_limit(nodes: list[dict], world: int) -> tuple[int, str]:
    """The model-state memory one of ``world`` workers may use, as ``fit``'s memory check counts it (the largest
    node's usable memory, and the nodes' sum shared by all workers), and where that limit comes from."""
    biggest = max(nodes, key=lambda r: r["memory_total"])
    total = sum(r["memory_total"] * max(1, r.get("devices") or 1) for r in nodes)
    source = biggest.get("memory_source") or "usable memory"
    if total // max(1, world) < biggest["memory_total"]:
        return total // max(1, world), (f"the {len(nodes)} node(s)' usable memory, {total / GIB:.1f} GiB in all, "
                                        f"shared by {world} worker(s); node {biggest['hostname']}: {source}")
    return biggest["memory_total"], f"node {biggest['hostname']}'s usable memory: {source}"


def resolve_auto(counted: torch.nn.Module | None, cfg: Config, cluster: ClusterConfig, nodes: list[dict]) -> str | None:
    """Decide ``offload_optimizer.device: "auto"`` for the whole run at the smallest world size (the largest
    share per worker): sets it in ``cfg`` and returns the line that says what was chosen and why (None when
    the device is not ``auto``).  A model that cannot be counted keeps ``auto``: each engine decides."""
    off = cfg.zero_optimization.offload_optimizer
    if off.device != "auto":
        return None
    if counted is None or not nodes:
        return ("offload_optimizer.device auto is left to each worker's engine: the model could not be counted on "
                "the driver")
    world = cluster.min_workers
    need, n = model_state_bytes(counted, cfg, world, offload="none")
    limit, source = worker_limit(nodes, world)
    if any(r.get("accelerator", "cpu") != "cpu" for r in nodes):
        return _resolve_auto_on_devices(counted, cfg, world, nodes, need, n, limit, source)
    need_nvme, _ = model_state_bytes(counted, cfg, world, offload="nvme")
    off.device = resolve_auto_offload(need, need_nvme, limit, off.nvme_path, limit_source=source)
    why = "fit" if off.device == "none" else "do not fit; with the optimizer on NVMe they need"
    extra = "" if off.device == "none" else f" {need_nvme / GIB:.2f} GiB"
    return (f"offload_optimizer.device auto -> {off.device}: {n:,} parameters on {world} worker(s) need "
            f"{need / GIB:.2f} GiB of model state per worker, which {why}{extra} (limit {limit / GIB:.2f} GiB, {source})")


def _resolve_auto_on_devices(counted, cfg: Config, world: int, nodes: list[dict], need: int, n: int, limit: int,
                             source: str) -> str:
    """``auto`` on accelerator nodes: the nodes report device memory (``limit``); the model states must fit it,
    else the optimizer goes to the CPU where its part fits the hosts' memory per worker, else to NVMe."""
    from rayzero.offload.plan import resolve_auto_offload_on_device
    from rayzero.train.state_memory import host_memory_per_worker

    def split(device: str) -> tuple[int, int]:
        return (model_state_bytes(counted, cfg, world, offload=device, where="device")[0],
                model_state_bytes(counted, cfg, world, offload=device, where="host")[0])

    off = cfg.zero_optimization.offload_optimizer
    host_left = host_memory_per_worker(nodes)
    off.device = resolve_auto_offload_on_device(need, split("cpu"), split("nvme"), limit, host_left, off.nvme_path,
                                                device_source=source, host_source="the hosts' memory per worker")
    why = "fit the device" if off.device == "none" else "do not fit the device"
    return (f"offload_optimizer.device auto -> {off.device}: {n:,} parameters on {world} worker(s) need "
            f"{need / GIB:.2f} GiB of model state per worker, which {why} (limit {limit / GIB:.2f} GiB, {source}; "
            f"host {host_left / GIB:.2f} GiB per worker)")


def node_slots(cluster: ClusterConfig) -> dict[str, tuple[str, int]]:
    """``{node_id: (address, workers it can host)}`` for each alive node, from its total resources."""
    import ray

    per = dict(cluster.resources_per_worker)
    if cluster.use_gpu and "GPU" not in per:
        per["GPU"] = 1
    out = {}
    for node in ray.nodes():
        if not node.get("Alive"):
            continue
        have = node.get("Resources", {})
        slots = min((int(have.get(k, 0) // v) for k, v in per.items() if v > 0), default=cluster.max_workers)
        out[node["NodeID"]] = (node.get("NodeManagerAddress", "?"), min(slots, cluster.max_workers))
    return out


def check_swap_fits(model: torch.nn.Module, cfg: Config, worlds: list[int], slots: dict[str, tuple[str, int]],
                    capacity: dict[str, dict]) -> None:
    """Refuse a plan whose swap files cannot fit a node's disk: at every world size of the range, as many ranks
    as the node can host (at most the world size), each keeping ``swap_bytes``, against the free space under
    nvme_path that the node's NodeSwapStore reports (``rayzero.memory.swap_bytes`` per rank)."""
    per_rank = {w: swap_bytes(model, cfg, w) for w in worlds}
    for node_id, cap in capacity.items():
        host = cap.get("hostname") or slots.get(node_id, ("?",))[0]
        if cap.get("error"):
            raise ConfigError(
                f"nvme_path cannot be used on node {host} ({node_id[:12]}): {cap['error']}; point nvme_path at a "
                "writable directory on a local disk that exists on every node"
            )
        hosted = slots.get(node_id, ("", 0))[1]
        need, world, ranks = max((min(w, hosted) * b, w, min(w, hosted)) for w, b in per_rank.items())
        if need > cap["free_bytes"]:
            z = cfg.zero_optimization
            raise ConfigError(
                f"the NVMe swap does not fit on node {host} ({node_id[:12]}): {ranks} rank(s) there at world size "
                f"{world} keep {per_rank[world]:,} bytes each (ZeRO stage {z.stage}, fp32 master and optimizer "
                f"state in {cfg.aio.block_size}-byte blocks per sub-group of {z.sub_group_size or 1_000_000_000:,} elements), "
                f"{need / GIB:.2f} GiB ({need:,} bytes) under {cap['path']}, and that disk has "
                f"{cap['free_bytes'] / GIB:.2f} GiB ({cap['free_bytes']:,} bytes) free; free space there, point "
                "nvme_path at a bigger local disk, use more workers or nodes, or offload to 'cpu' instead"
            )
        logger.info("swap on node %s: up to %d rank(s) x %d bytes at world %d, %d bytes free under %s",
                    host, ranks, per_rank[world], world, cap["free_bytes"], cap["path"])
