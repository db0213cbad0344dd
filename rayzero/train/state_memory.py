"""The pre-launch check that a plan's model states fit the nodes' usable memory.  The bytes are
``rayzero/memory.py``'s (docs/design.md "Memory per rank"), counted over the model's parameters (on the
meta device for a factory): no Ray, no process group."""

from __future__ import annotations

import logging
from typing import Any

import torch

from rayzero.config import Config, ConfigError
from rayzero.memory import model_state_bytes
from rayzero.train.cluster_config import ClusterConfig

logger = logging.getLogger("rayzero")


def _model_for_count(model: Any) -> torch.nn.Module | None:
    """The model itself, or a factory's model built on the meta device (shapes only, nothing allocated);
    None when a factory cannot be built there."""
    if isinstance(model, torch.nn.Module):
        return model
    try:
        with torch.device("meta"):
            built = model()
    except Exception as e:
        logger.info("memory check skipped: the model factory could not be built on the meta device (%s: %s)",
                    type(e).__name__, e)
        return None
    return built if isinstance(built, torch.nn.Module) else None


def _check_fits(model: Any, cfg: Config, cluster: ClusterConfig, nodes: list[dict]) -> None:
    """Reject a plan whose model states cannot fit in the memory the nodes' processes may really use, at the
    smallest world size of the range (the largest share per worker).  A factory is built on the meta device to
    count its parameters."""
    if not nodes:
        return
    counted = _model_for_count(model)
    if counted is None:
        return
    world = cluster.min_workers
    on_accelerators = any(r.get("accelerator", "cpu") != "cpu" for r in nodes)
    # on accelerator nodes memory_total is the device's: the part of the states that lives there is checked
    # against it, the part offloaded to the host against the host's memory per worker
    need, n = model_state_bytes(counted, cfg, world, where="device" if on_accelerators else "all")
    if on_accelerators:
        _check_host_part(counted, cfg, world, nodes)
    # memory_total is per device: a node hosts as many workers as it has devices (one on a CPU node)
    biggest = max(r["memory_total"] for r in nodes)
    total = sum(r["memory_total"] * max(1, r.get("devices") or 1) for r in nodes)
    if need > biggest or need * world > total:
        gib = 1 << 30
        stage = cfg.zero_optimization.stage
        dtype = str(cfg.compute_dtype).replace("torch.", "")
        tp = cfg.tensor_parallel.autotp_size
        ep = cfg.expert_parallel.size
        layout = f" (tp {tp} x ep {ep})" if tp * ep > 1 else ""
        offload = cfg.zero_optimization.offload_optimizer.device
        layout += f" with the optimizer offloaded to {offload}" if offload not in ("none", "auto") else ""
        raise ConfigError(
            f"the plan cannot fit: {n:,} parameters at ZeRO stage {stage} with {dtype} compute on {world} "
            f"worker(s){layout} need {need / gib:.1f} GiB of model state per worker ({need:,} bytes, "
            f"{need / max(n, 1):.2f} bytes per parameter; docs/design.md, Memory per rank), {need * world / gib:.1f} "
            f"GiB for all {world}, and the nodes' usable memory is "
            f"{[round(r['memory_total'] / gib, 1) for r in nodes]} GiB (per device on a node with several); use a "
            "higher ZeRO stage, more workers, or bigger nodes"
            + ("" if offload == "nvme" else
               ", or offload the optimizer to the CPU (zero_optimization.offload_optimizer device 'cpu' or 'auto')"
               if on_accelerators and offload == "none" else
               ", or offload the optimizer to NVMe (zero_optimization.offload_optimizer device 'nvme' or 'auto', "
               "with nvme_path)")
        )


def host_memory_per_worker(nodes: list[dict]) -> int:
    """The host memory one worker may use on the tightest node: its host memory shared by its devices."""
    return min(r.get("host_memory_total", r["memory_total"]) // max(1, r.get("devices") or 1) for r in nodes)


def _check_host_part(counted: torch.nn.Module, cfg: Config, world: int, nodes: list[dict]) -> None:
    """On accelerator nodes: the optimizer state offloaded to the host must fit the host's memory per worker."""
    host, n = model_state_bytes(counted, cfg, world, where="host")
    left = host_memory_per_worker(nodes)
    if host > left:
        gib = 1 << 30
        offload = cfg.zero_optimization.offload_optimizer.device
        raise ConfigError(
            f"the plan cannot fit: with the optimizer offloaded to {offload}, {n:,} parameters on {world} worker(s) "
            f"need {host / gib:.1f} GiB of host memory per worker ({host:,} bytes), and the tightest node leaves "
            f"{left / gib:.1f} GiB per worker (its host memory shared by its devices); use a higher ZeRO stage, "
            "more workers, nodes with more memory"
            + ("" if offload == "nvme" else ", or offload the optimizer to NVMe (device 'nvme' with nvme_path)")
        )
