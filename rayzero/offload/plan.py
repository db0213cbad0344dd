"""Offload arithmetic for planning: bytes on disk and in memory per rank, and what ``"device": "auto"`` picks.

Pure functions (no Ray, no process group): the Ray driver (``rayzero.fit``) uses them before launch and the
engine uses them when ``offload_optimizer.device`` is ``auto`` outside Ray.  The per-parameter counts follow
docs/design.md "Memory per rank"; ``W`` is the number of ranks a parameter's ZeRO partition is split over.
"""

from __future__ import annotations

import math

from rayzero.config import ConfigError

GIB = 1 << 30
FP32 = 4


def _round_up(n: int, block: int) -> int:
    return -(-n // block) * block if block > 1 else n


def swap_bytes_per_rank(
    num_params: int,
    stage: int,
    world: int,
    optimizer_bytes: int = 8,
    block: int = 1 << 20,
    *,
    sub_group_size: int = 1_000_000_000,
    param_bytes: int = 0,
    offload_optimizer: bool = True,
) -> int:
    """Bytes one rank keeps in its swap directory with NVMe offload.

    With optimizer offload: the rank's fp32 master partition and each fp32 optimizer state tensor
    (``optimizer_bytes / 4`` of them: AdamW 2), one file per sub-group of ``sub_group_size`` elements, each
    rounded up to whole ``block``s (the O_DIRECT unit).  ``param_bytes`` > 0 adds the rank's parameter
    partition in that many bytes per element (``offload_param`` with ``nvme``: the compute dtype's size),
    sub-grouped and rounded the same way.

    Approximate: the partition is taken as ``ceil(num_params / world)`` elements (stage 0 is not partitioned),
    without the per-parameter padding of the real layout (at most ``world - 1`` elements per parameter) and
    with one set of sub-groups for the whole partition (the engine rounds per param group).
    """
    if num_params <= 0:
        return 0
    ranks = 1 if stage == 0 else max(1, world)
    part = -(-num_params // ranks)
    sub = max(1, sub_group_size)
    full, rest = divmod(part, sub)

    def files(bytes_per_element: int) -> int:  # one tensor's files over the sub-groups
        size = full * _round_up(sub * bytes_per_element, block)
        return size + (_round_up(rest * bytes_per_element, block) if rest else 0)

    total = 0
    if offload_optimizer:
        tensors = 1 + math.ceil(optimizer_bytes / FP32)  # the master, then each optimizer state tensor
        total += tensors * files(FP32)
    if param_bytes:
        total += files(param_bytes)
    return total


def pool_slots(buffer_count: int, optimizer_bytes: int = 8) -> int:
    """Sub-groups the NVMe optimizer swap pool holds at once.  ``offload_optimizer.buffer_count`` counts
    tensor buffers, as DeepSpeed's does ("at least the number of states maintained per parameter"); a slot
    holds one sub-group's master and each of its fp32 optimizer state tensors (AdamW: 3 buffers), and there
    are at least two slots (one sub-group stepped while the next is read).  DeepSpeed's default of 4 makes 2
    slots with AdamW."""
    tensors = 1 + math.ceil(optimizer_bytes / FP32)
    return max(2, buffer_count // tensors)


def swap_pool_bytes(partition_elements: int, sub_group_elements: int, buffer_count: int,
                    optimizer_bytes: int = 8) -> int:
    """Host memory of the NVMe optimizer swap pool of one rank: ``pool_slots`` slots (never more than there
    are sub-groups), each holding one sub-group's fp32 master and fp32 optimizer state tensors.  A constant
    per rank, on top of ``ram_bytes_per_param``."""
    if partition_elements <= 0:
        return 0
    sub = max(1, min(sub_group_elements, partition_elements))
    slots = min(pool_slots(buffer_count, optimizer_bytes), -(-partition_elements // sub))
    tensors = 1 + math.ceil(optimizer_bytes / FP32)
    return slots * sub * tensors * FP32


def ram_bytes_per_param(
    stage: int,
    world: int,
    mixed_precision: bool,
    optimizer_bytes: int = 8,
    offload_device: str = "none",
    *,
    offload_param: str = "none",
) -> float:
    """Model-state bytes one rank holds in memory per trainable parameter, with the optimizer offloaded to
    ``offload_device``.

    * ``none`` and ``cpu``: ``rayzero.train.state_memory.model_state_bytes_per_param`` (with ``cpu`` the same bytes
      live in host RAM rather than device memory): stage 0 16 (18 with bf16/fp16 compute), stage 1
      ``w + 4 + 16/W`` (``w + 16/W`` with ``cpu``: offloaded stage 1 keeps no full-size gradient buffer),
      stage 2 ``w + 16/W``, stage 3 ``16/W``, where ``w`` is the compute dtype's size and
      16 is the fp32 master, gradient and AdamW's two moments (``4 + 4 + optimizer_bytes``).
    * ``nvme``: the fp32 master and the optimizer states go to disk.  What stays is the fp32 gradient
      partition (``4/W``) and a compute-dtype copy of the rank's weight partition (``w/W``), which stage 3
      gathers from and stages 1 and 2 publish from: stages 1 and 2
      ``w + (4 + w)/W``, stage 3 ``(4 + w)/W``.  With ``offload_param="nvme"`` (stage 3) the weight
      partition copy goes to disk too: ``4/W``.
    """
    w = 2 if mixed_precision else 4
    ranks = max(1, world)
    if offload_device in ("none", "cpu", "auto"):
        if stage == 0:  # nothing partitioned; in fp32 the model's parameters are views of the master
            return (w if mixed_precision else 0) + FP32 + FP32 + optimizer_bytes
        partition = (FP32 + FP32 + optimizer_bytes) / ranks
        if stage == 1 and offload_device != "cpu":
            return w + FP32 + partition  # + the persistent fp32 local gradient buffer (the whole gradient)
        if stage in (1, 2):  # offloaded stage 1 reduces into its partition every backward, as stage 2 does
            return w + partition
        return partition
    if offload_device != "nvme":
        raise ValueError(f"offload_device must be 'none', 'cpu' or 'nvme', got {offload_device!r}")
    if stage == 0:
        raise ValueError("optimizer offload needs ZeRO stage 1, 2 or 3")
    kept = FP32 / ranks + (0 if stage == 3 and offload_param == "nvme" else w / ranks)
    if stage in (1, 2):  # with offload, stage 1 reduces into its partition every backward, as stage 2 does
        return w + kept
    return kept


def device_and_host_bytes_per_param(
    stage: int,
    world: int,
    mixed_precision: bool,
    optimizer_bytes: int = 8,
    offload_device: str = "none",
    *,
    offload_param: str = "none",
) -> tuple[float, float]:
    """On an accelerator: ``ram_bytes_per_param``'s model-state bytes split into ``(device memory, host
    memory)``.  Without offload everything is on the device; offloaded (``cpu`` or ``nvme``), the device keeps
    only the compute-dtype weights of stages 1-2 (stage 3 gathers its weights per unit from the host), and
    the rest (the fp32 partitions, or with ``nvme`` the gradient partition and the weight copy) is host memory.
    """
    total = ram_bytes_per_param(stage, world, mixed_precision, optimizer_bytes, offload_device,
                                offload_param=offload_param)
    if offload_device in ("none", "auto"):
        return total, 0.0
    on_device = float(2 if mixed_precision else 4) if stage in (1, 2) else 0.0
    return on_device, total - on_device


def resolve_auto_offload_on_device(
    need_on_device: int,
    offloaded: tuple[int, int],
    offloaded_nvme: tuple[int, int],
    device_left: int,
    host_left: int,
    nvme_path: str | None,
    *,
    device_source: str = "the accelerator's free memory",
    host_source: str = "host memory",
) -> str:
    """``offload_optimizer.device: "auto"`` on an accelerator: ``"none"`` when the model states fit the device's
    free memory (``device_left``); else ``"cpu"`` when, offloaded, the device part (``offloaded[0]``) fits the
    device and the host part (``offloaded[1]``) fits ``host_left``; else ``"nvme"`` likewise (with
    ``nvme_path``).  Otherwise a ConfigError with the numbers and the fix."""
    if need_on_device <= device_left:
        return "none"
    if offloaded[0] <= device_left and offloaded[1] <= host_left:
        return "cpu"
    nvme_fits = offloaded_nvme[0] <= device_left and offloaded_nvme[1] <= host_left
    numbers = (f"the model states need {need_on_device / GIB:.2f} GiB on the device, which has {device_left / GIB:.2f} "
               f"GiB free ({device_source}); offloaded to the CPU they need {offloaded[0] / GIB:.2f} GiB there and "
               f"{offloaded[1] / GIB:.2f} GiB of host memory ({host_left / GIB:.2f} GiB left, {host_source}), to NVMe "
               f"{offloaded_nvme[0] / GIB:.2f} GiB and {offloaded_nvme[1] / GIB:.2f} GiB")
    if nvme_fits:
        if nvme_path:
            return "nvme"
        raise ConfigError(
            f"zero_optimization.offload_optimizer.device is 'auto' and {numbers}: only NVMe offload fits, but "
            "'nvme_path' is not set; set zero_optimization.offload_optimizer.nvme_path to a directory on a local "
            "disk, or use more workers or a higher ZeRO stage"
        )
    raise ConfigError(
        f"zero_optimization.offload_optimizer.device is 'auto' but the plan cannot fit even with offload: {numbers}; "
        "use more workers, a higher ZeRO stage (stage 3 partitions the weights too), or devices with more memory"
    )


def resolve_auto_offload(
    need_bytes_in_ram: int,
    need_bytes_with_nvme: int,
    limit_bytes: int,
    nvme_path: str | None,
    *,
    limit_source: str = "the memory limit the accelerator reports",
) -> str:
    """What ``offload_optimizer.device: "auto"`` becomes: ``"none"`` when the model states fit ``limit_bytes``,
    ``"nvme"`` when they fit only with the optimizer on NVMe (``nvme_path`` must be set).  Otherwise a
    ConfigError naming the bytes needed, the limit, where the limit comes from, and the fix."""
    if need_bytes_in_ram <= limit_bytes:
        return "none"
    numbers = (f"the model states need {need_bytes_in_ram / GIB:.2f} GiB ({need_bytes_in_ram:,} bytes) per worker in "
               f"memory and {need_bytes_with_nvme / GIB:.2f} GiB ({need_bytes_with_nvme:,} bytes) with the optimizer "
               f"offloaded to NVMe; the limit is {limit_bytes / GIB:.2f} GiB ({limit_bytes:,} bytes, {limit_source})")
    if need_bytes_with_nvme <= limit_bytes:
        if nvme_path:
            return "nvme"
        raise ConfigError(
            f"zero_optimization.offload_optimizer.device is 'auto' and {numbers}: only NVMe offload fits, but "
            "'nvme_path' is not set; set zero_optimization.offload_optimizer.nvme_path to a directory on a local "
            "disk, or use more workers or a higher ZeRO stage"
        )
    raise ConfigError(
        f"zero_optimization.offload_optimizer.device is 'auto' but the plan cannot fit even with NVMe offload: "
        f"{numbers}; use more workers, a higher ZeRO stage (stage 3 partitions the weights too), "
        "offload_param with 'nvme' at stage 3, or nodes with more memory"
    )
