"""What ``offload_optimizer.device: "auto"`` picks, from byte counts made by ``rayzero/memory.py``.

Pure functions (no Ray, no process group): the Ray driver (``rayzero.fit``) uses them before launch and the
engine uses them when ``offload_optimizer.device`` is ``auto`` outside Ray.
"""

from __future__ import annotations

from rayzero.config import ConfigError
from rayzero.memory import GIB


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
