"""Model-state memory per worker, as the driver plans it (docs/design.md "Memory per rank"), and the
pre-launch check that a plan fits the nodes' usable memory.  Pure arithmetic over the model's parameters
(counted on the meta device for a factory): no Ray, no process group."""

from __future__ import annotations

import logging
import math
from typing import Any

import torch

from rayzero.config import Config, ConfigError
from rayzero.offload.optimizer import optimizer_state_bytes
from rayzero.train.cluster_config import ClusterConfig

logger = logging.getLogger("rayzero")


def model_state_bytes_per_param(stage: int, world: int, mixed_precision: bool, optimizer_bytes: int = 8) -> float:
    """Model-state bytes one rank holds per trainable parameter it trains: docs/design.md "Memory per rank"
    (fp32 master, fp32 gradients, AdamW's two fp32 moments = ``optimizer_bytes``).  ``world`` is the number of
    ranks the parameter's ZeRO partition is split over; stage 3's persistent parameters come on top.

    ======  ===================  ===================
    stage   fp32 compute         bf16/fp16 compute
    ======  ===================  ===================
    0       16                   18
    1       8 + 16/W             6 + 16/W
    2       4 + 16/W             2 + 16/W
    3       16/W (+ persistent)  16/W (+ persistent)
    ======  ===================  ===================
    """
    weights = 2 if mixed_precision else 4  # the model's own (compute-dtype) parameters
    master, grad = 4, 4
    if stage == 0:  # nothing partitioned; in fp32 the model's parameters are views of the master
        return (weights if mixed_precision else 0) + master + grad + optimizer_bytes
    partition = (master + grad + optimizer_bytes) / world  # fp32 master, gradient and moments partitions
    if stage == 1:
        return weights + 4 + partition  # + the persistent fp32 local gradient buffer (the whole gradient)
    if stage == 2:
        return weights + partition
    return partition  # stage 3: parameters live only as shards between uses


def model_state_bytes_per_worker(
    num_params: int,
    stage: int,
    world: int,
    mixed_precision: bool,
    *,
    persistent_params: int = 0,
    frozen_params: int = 0,
    optimizer_bytes: int = 8,
) -> int:
    """ZeRO model-state memory of one worker: ``num_params`` trainable parameters partitioned over ``world``
    ranks (``model_state_bytes_per_param``), plus the compute-dtype copies every rank keeps whole: stage 3's
    persistent parameters (at most ``stage3_param_persistence_threshold`` elements) and frozen parameters.
    The plan's memory floor: activations and transient buffers come on top."""
    weights = 2 if mixed_precision else 4
    need = model_state_bytes_per_param(stage, world, mixed_precision, optimizer_bytes) * num_params
    if stage == 3:
        need += weights * persistent_params
    return int(round(need + weights * frozen_params))


def _expert_params(model: torch.nn.Module) -> set:
    """The parameters AutoEP splits over ep: rayzero MoE experts (marked) and transformers experts modules."""
    from rayzero.moe.experts import looks_like_experts

    out = {p for p in model.parameters() if getattr(p, "_rayzero_expert", False)}
    for module in model.modules():
        if looks_like_experts(module):
            out.update(module.parameters())
    return out


def model_state_bytes(model: torch.nn.Module, cfg: Config, world: int, offload: str | None = None,
                      where: str = "all") -> tuple[int, int]:
    """``(bytes, parameters)``: the model-state bytes of one of ``world`` workers and the model's parameter
    count.  With tensor parallelism every parameter counts 1/tp (AutoTP leaves embeddings and norms whole,
    so this can only under-count), partitioned over the ``world // tp`` data shards; with expert
    parallelism the experts count 1/ep more, partitioned over the ``dp // ep`` expert-data-parallel ranks.

    With the optimizer offloaded (``offload``, default the config's ``offload_optimizer.device``; ``auto``
    counts as ``none``) the bytes are those ``rayzero.offload.plan.ram_bytes_per_param`` keeps in memory:
    ``nvme`` moves the fp32 master and optimizer state to disk.

    ``where`` ("device" or "host") counts only the part that lives there on an accelerator
    (``rayzero.offload.plan.device_and_host_bytes_per_param``): without offload all of it is on the device.
    """
    from rayzero.offload.plan import device_and_host_bytes_per_param, ram_bytes_per_param

    if where not in ("all", "device", "host"):
        raise ValueError(f"where must be 'all', 'device' or 'host', got {where!r}")
    on_device = where != "host"
    on_host = where != "device"

    z = cfg.zero_optimization
    offload = offload or z.offload_optimizer.device
    offload = "none" if offload == "auto" else offload
    tp = cfg.tensor_parallel.autotp_size
    ep = cfg.expert_parallel.size
    dp = max(1, world // tp)
    edp = max(1, dp // ep)
    stage = cfg.zero_optimization.stage
    mixed = cfg.compute_dtype != torch.float32
    threshold = cfg.zero_optimization.stage3_param_persistence_threshold
    optimizer_bytes = optimizer_state_bytes(cfg)
    experts = _expert_params(model) if ep > 1 else set()
    params = list(dict.fromkeys(model.parameters()))  # tied weights once
    weights = 2 if mixed else 4
    need = 0.0
    partition = largest = 0  # elements of this rank's optimizer partition, and of its largest parameter
    for p in params:
        expert = p in experts
        held = p.numel() / (tp * ep if expert else tp)  # the elements this rank holds
        if not p.requires_grad:  # frozen: whole on every rank, in the compute dtype
            need += weights * held if on_device else 0
            continue
        ranks = edp if expert else dp
        chunk = math.ceil(held / (ranks if stage else 1))
        partition, largest = partition + chunk, max(largest, chunk)
        if where != "all":
            d, h = device_and_host_bytes_per_param(stage, ranks, mixed, optimizer_bytes, offload,
                                                   offload_param=z.offload_param.device)
            need += ((d if on_device else 0) + (h if on_host else 0)) * held
        elif offload == "none" and z.offload_param.device == "none":
            need += model_state_bytes_per_param(stage, ranks, mixed, optimizer_bytes) * held
        else:
            need += ram_bytes_per_param(stage, ranks, mixed, optimizer_bytes, offload,
                                        offload_param=z.offload_param.device) * held
        if stage == 3 and p.numel() <= threshold and on_device:  # persistent: whole between steps too
            need += weights * held
    if offload == "nvme" and on_host:  # the swap pool's buffers (offload/plan.py swap_pool_bytes)
        from rayzero.offload.optimizer import sub_group_size
        from rayzero.offload.plan import swap_pool_bytes

        sub = max(sub_group_size(cfg, partition, nvme=True), largest)
        need += swap_pool_bytes(partition, sub, z.offload_optimizer.buffer_count, optimizer_bytes)
    return int(round(need)), sum(p.numel() for p in params)


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
