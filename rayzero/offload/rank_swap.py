"""The rank's NVMe swap: its directory (leased), its store, and what the engine keeps there.

With ``offload_optimizer`` on NVMe the fp32 masters (and the optimizer state after each step) live in the
swap files (``optimizer.py``), and so do the fp32 gradient partitions between backward and step
(``gradients.py``); with ``offload_param`` on NVMe, stage 3's compute-dtype weight shards
(``params.py``).  One directory and one store per rank serve both.
"""

from __future__ import annotations

import torch

from rayzero.memory import optimizer_state_bytes, pool_slots
from rayzero.offload.optimizer import NvmeOptimizerSwap
from rayzero.offload.params import NvmeParamSwap, cache_elements, read_pool_shape
from rayzero.offload.swap_dirs import acquire_swap_dir
from rayzero.offload.swap_store import ALIGNMENT, SwapStore
from rayzero.zero.partition import Partitions


class RankSwap:
    def __init__(self, cfg, rank: int, partitions: Partitions, optimizer: torch.optim.Optimizer,
                 compute_dtype: torch.dtype, device: torch.device, optimizer_nvme: bool,
                 unit_shards: list[int] | None = None):
        """``unit_shards``: this rank's shard elements of each parameter of the largest stage-3 gather unit
        (the read pool's buffers are sized by it when offload_param leaves buffer_size out)."""
        z, aio = cfg.zero_optimization, cfg.aio
        params_nvme = z.offload_param.device == "nvme"
        path = z.offload_optimizer.nvme_path if optimizer_nvme else z.offload_param.nvme_path
        self.store: SwapStore | None = None
        self.optimizer_swap: NvmeOptimizerSwap | None = None
        self.lease = acquire_swap_dir(path, rank)
        try:
            self.store = SwapStore(self.lease.path, block_size=aio.block_size, queue_depth=aio.queue_depth,
                                   thread_count=aio.thread_count)
            self.store.check_free_space(
                swap_bytes(partitions, optimizer_state_bytes(cfg), compute_dtype, optimizer_nvme, params_nvme))
            if params_nvme:
                largest = max((e.chunk for g in partitions.groups for e in g.layout.entries), default=0)
                count, size = read_pool_shape(z.offload_param.buffer_count, z.offload_param.buffer_size,
                                              unit_shards or [largest], compute_dtype)
                partitions.param_swap = NvmeParamSwap(
                    self.store, compute_dtype, cache_elements(z.offload_param.max_in_cpu), buffer_count=count,
                    buffer_size=max(size, largest) if z.offload_param.buffer_size is None else size,
                    largest_shard=largest)
                partitions.refresh_weights()  # every shard written once from the masters
            if optimizer_nvme:
                from rayzero.offload.gradients import GradientSwap

                GradientSwap(partitions, self.store)  # the gradient partitions too (gradients.py)
                self.optimizer_swap = NvmeOptimizerSwap(
                    partitions, optimizer, self.store,
                    pool_slots(z.offload_optimizer.buffer_count, optimizer_state_bytes(cfg)), compute_dtype,
                    torch.device("cpu") if z.offload_param.device == "cpu" else device,
                    keep_weights=not params_nvme,
                )
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        """Remove the rank's swap files (and its directory, when the engine owns it)."""
        if self.store is not None:
            self.store.close(remove_files=True)
        if self.lease is not None:
            self.lease.release()
        self.store = self.lease = self.optimizer_swap = None


def swap_bytes(partitions: Partitions, optimizer_bytes: int, compute_dtype: torch.dtype, optimizer_nvme: bool,
               params_nvme: bool) -> int:
    """What the swap files will hold: per sub-group the master, its gradient and the optimizer's fp32 state
    tensors, and per parameter its compute-dtype shard, each padded to whole O_DIRECT blocks."""
    padded = lambda nbytes: -(-nbytes // ALIGNMENT) * ALIGNMENT
    tensors = 2 + optimizer_bytes // 4
    size = torch.finfo(compute_dtype).bits // 8
    total = 0
    for g in partitions.groups:
        if optimizer_nvme:
            total += tensors * padded(g.layout.partition_numel * 4)
        if params_nvme:
            total += sum(padded(e.chunk * size) for e in g.layout.entries)
    return total
