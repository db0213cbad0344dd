"""``rayzero.deepspeed.comm``: DeepSpeed's ``deepspeed.comm`` calls over ``torch.distributed``.

The common collectives under DeepSpeed's names and signatures.  Where no process group exists (a single
process started without a launcher, which rayzero runs as world size 1 without one), ``get_rank`` is 0,
``get_world_size`` 1, and the collectives leave their tensors as they are, as a one-rank group would.
"""

from __future__ import annotations

import os
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed import ReduceOp

__all__ = [
    "ReduceOp", "all_gather", "all_gather_into_tensor", "all_gather_object", "all_reduce", "all_to_all_single",
    "barrier", "broadcast", "broadcast_object_list", "destroy_process_group", "gather", "get_backend",
    "get_global_rank", "get_local_rank", "get_rank", "get_world_group", "get_world_size", "init_distributed",
    "irecv", "is_available", "is_initialized", "isend", "log_summary", "new_group", "recv", "reduce",
    "reduce_scatter_tensor", "scatter", "send",
]

_DEFAULT_TIMEOUT = timedelta(minutes=30)


def init_distributed(
    dist_backend: str | None = None,
    auto_mpi_discovery: bool = True,
    distributed_port: int = 29500,
    verbose: bool = True,
    timeout: timedelta = _DEFAULT_TIMEOUT,
    init_method: str | None = None,
    dist_init_required: bool | None = None,
    config=None,
    rank: int = -1,
    world_size: int = -1,
) -> None:
    """Join or create the default process group from the launcher's environment (torchrun, Ray Train:
    ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``), as ``rayzero.initialize`` does; the backend
    defaults to the accelerator's (gloo on CPU).  ``rank`` / ``world_size`` fill those variables where the
    environment lacks them.  ``LOCAL_RANK`` is set where the launcher did not set it (to the rank on a
    world of one, else to ``RANK``, which holds for one host).  Without any of these variables and without
    ``init_method`` it is a world of one and no group is made.  MPI discovery is not done."""
    if dist.is_available() and dist.is_initialized():
        return
    if rank >= 0:
        os.environ.setdefault("RANK", str(rank))
    if world_size >= 0:
        os.environ.setdefault("WORLD_SIZE", str(world_size))
    if "RANK" in os.environ:
        os.environ.setdefault("LOCAL_RANK", os.environ["RANK"])
    else:
        os.environ.setdefault("LOCAL_RANK", "0")
    if "WORLD_SIZE" in os.environ and int(os.environ["WORLD_SIZE"]) > 1:
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(distributed_port))
    if init_method is not None:
        from rayzero.accelerator import bind_rank_device, get_accelerator

        bind_rank_device()
        dist.init_process_group(dist_backend or get_accelerator().communication_backend(), init_method=init_method,
                                rank=rank, world_size=world_size, timeout=timeout)
        return
    from rayzero.comm import init_distributed as rayzero_init

    rayzero_init(backend=dist_backend, timeout_s=timeout.total_seconds())


def is_available() -> bool:
    return dist.is_available()


def is_initialized() -> bool:
    return dist.is_available() and dist.is_initialized()


def _one_rank() -> bool:
    return not is_initialized()


def get_rank(group=None) -> int:
    return 0 if _one_rank() else dist.get_rank(group)


def get_world_size(group=None) -> int:
    return 1 if _one_rank() else dist.get_world_size(group)


def get_local_rank() -> int:
    """This process's rank on its host (``LOCAL_RANK``)."""
    return int(os.environ.get("LOCAL_RANK", 0))


def get_global_rank(group=None, group_rank: int = 0) -> int:
    return group_rank if _one_rank() or group is None else dist.get_global_rank(group, group_rank)


def get_world_group():
    return None if _one_rank() else dist.group.WORLD


def get_backend(group=None) -> str | None:
    return None if _one_rank() else dist.get_backend(group)


def new_group(ranks=None, **kwargs):
    return None if _one_rank() else dist.new_group(ranks, **kwargs)


def destroy_process_group(group=None) -> None:
    if not _one_rank():
        dist.destroy_process_group(group)


def barrier(group=None, async_op: bool = False, device_ids=None):
    if _one_rank():
        return None
    return dist.barrier(group=group, async_op=async_op, device_ids=device_ids)


def all_reduce(tensor: torch.Tensor, op=ReduceOp.SUM, group=None, async_op: bool = False, prof: bool = False,
               log_name: str = "all_reduce", debug: str = ""):
    if _one_rank():
        return None
    return dist.all_reduce(tensor, op=op, group=group, async_op=async_op)


def reduce(tensor: torch.Tensor, dst: int, op=ReduceOp.SUM, group=None, async_op: bool = False, **_):
    if _one_rank():
        return None
    return dist.reduce(tensor, dst, op=op, group=group, async_op=async_op)


def broadcast(tensor: torch.Tensor, src: int, group=None, async_op: bool = False, **_):
    if _one_rank():
        return None
    return dist.broadcast(tensor, src, group=group, async_op=async_op)


def all_gather(tensor_list: list, tensor: torch.Tensor, group=None, async_op: bool = False, **_):
    if _one_rank():
        tensor_list[0].copy_(tensor)
        return None
    return dist.all_gather(tensor_list, tensor, group=group, async_op=async_op)


def all_gather_into_tensor(output_tensor: torch.Tensor, tensor: torch.Tensor, group=None, async_op: bool = False,
                           **_):
    if _one_rank():
        output_tensor.copy_(tensor.reshape(output_tensor.shape))
        return None
    return dist.all_gather_into_tensor(output_tensor, tensor, group=group, async_op=async_op)


def reduce_scatter_tensor(output_tensor: torch.Tensor, tensor: torch.Tensor, op=ReduceOp.SUM, group=None,
                          async_op: bool = False, **_):
    if _one_rank():
        output_tensor.copy_(tensor.reshape(output_tensor.shape))
        return None
    return dist.reduce_scatter_tensor(output_tensor, tensor, op=op, group=group, async_op=async_op)


def all_to_all_single(output: torch.Tensor, tensor: torch.Tensor, output_split_sizes=None, input_split_sizes=None,
                      group=None, async_op: bool = False, **_):
    if _one_rank():
        output.copy_(tensor)
        return None
    return dist.all_to_all_single(output, tensor, output_split_sizes, input_split_sizes, group=group,
                                  async_op=async_op)


def gather(tensor: torch.Tensor, gather_list=None, dst: int = 0, group=None, async_op: bool = False):
    if _one_rank():
        if gather_list is not None:
            gather_list[0].copy_(tensor)
        return None
    return dist.gather(tensor, gather_list, dst, group=group, async_op=async_op)


def scatter(tensor: torch.Tensor, scatter_list=None, src: int = 0, group=None, async_op: bool = False):
    if _one_rank():
        if scatter_list is not None:
            tensor.copy_(scatter_list[0])
        return None
    return dist.scatter(tensor, scatter_list, src, group=group, async_op=async_op)


def all_gather_object(object_list: list, obj, group=None) -> None:
    if _one_rank():
        object_list[0] = obj
        return
    dist.all_gather_object(object_list, obj, group=group)


def broadcast_object_list(object_list: list, src: int = 0, group=None, device=None) -> None:
    if not _one_rank():
        dist.broadcast_object_list(object_list, src, group=group, device=device)


def send(tensor: torch.Tensor, dst: int, group=None, tag: int = 0):
    return dist.send(tensor, dst, group=group, tag=tag)


def recv(tensor: torch.Tensor, src: int | None = None, group=None, tag: int = 0):
    return dist.recv(tensor, src, group=group, tag=tag)


def isend(tensor: torch.Tensor, dst: int, group=None, tag: int = 0):
    return dist.isend(tensor, dst, group=group, tag=tag)


def irecv(tensor: torch.Tensor, src: int | None = None, group=None, tag: int = 0):
    return dist.irecv(tensor, src, group=group, tag=tag)


def log_summary(show_straggler: bool = False) -> None:
    """DeepSpeed's communication profile; rayzero does not profile its collectives this way: a no-op."""
