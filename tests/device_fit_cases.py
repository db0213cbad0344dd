"""Per-rank cases for tests/test_device_fit.py: the rank's device binding, rayzero's groups over a default
group that cannot carry device tensors (gloo, as Ray Train starts it without GPUs), and the worker's step.

They run the stand-in accelerators of tests/device_cases.py.  The Ray test selects them in Ray's worker
processes by naming their factories in ``RAYZERO_ACCELERATOR`` (``device_fit_cases:OwnDeviceAccelerator``).
"""

from __future__ import annotations

import os
from typing import NamedTuple

import torch

from device_cases import StandInDeviceAccelerator, use_standin


class OwnDeviceAccelerator(StandInDeviceAccelerator):
    """The stand-in device as a launcher that shows each worker only its own device presents it (Ray's
    workers, each with CUDA_VISIBLE_DEVICES of its own): every process sees one device, index 0, and no two
    processes share it.  (The stand-in device computes backward only on index 0: torch's autograd engine
    counts one device for a device kind registered from Python.)"""

    def device_count(self) -> int:
        return 1

    def device_identity(self, index: int) -> str:
        return f"the device of process {os.getpid()}"


def zero_init_on_the_rank_device(rank: int, world: int, on_device: bool, accelerator: str) -> dict:
    """A model built under zero_init with LOCAL_RANK = rank on the stand-in (``accelerator`` "standin") or the
    CPU: where its shards land, which devices were bound (before the process group: zero_init comes before
    any engine), and the shards' values."""
    import rayzero
    from zero_cases import make_model

    os.environ["LOCAL_RANK"] = str(rank)
    acc = use_standin(on_device=on_device) if accelerator == "standin" else None
    with rayzero.zero_init():
        model = make_model()
    shards = {n: p._rayzero_shard for n, p in model.named_parameters()}
    return {
        "devices": sorted({str(s.device) for s in shards.values()}),
        "set_devices": list(acc.set_devices) if acc is not None else None,
        "shards": {n: s.cpu() for n, s in shards.items()},
    }


def two_ranks_on_one_device(rank: int, world: int) -> None:
    """LOCAL_RANK 0 and 2 on a node whose process sees 2 devices: both bind device 0."""
    import rayzero
    from zero_cases import base_config, make_model

    os.environ["LOCAL_RANK"] = str(2 * rank)
    use_standin(on_device=True)
    rayzero.initialize(make_model(), base_config(1, world, 4))


def a_gloo_group_given_for_device_tensors(rank: int, world: int) -> dict:
    """rayzero's own groups over a gloo default group carry device tensors; a gloo group handed to it is
    refused at set-up."""
    import torch.distributed as dist

    from rayzero.comm import Communicator, world_group

    acc = use_standin(on_device=True)
    comm = Communicator.for_group(None)
    total = comm.sum_scalar(torch.full((1,), float(rank + 1), device=acc.device()))
    refused = None
    try:
        Communicator.for_group(dist.new_group(backend="gloo"))
    except ValueError as e:
        refused = str(e)
    return {"default": dist.get_backend(), "world": dist.get_backend(world_group()), "total": total.cpu(),
            "refused": refused}


class Pair(NamedTuple):
    x: torch.Tensor
    y: torch.Tensor


def nested_batch_to_device(rank: int, world: int) -> dict:
    """Every tensor of a nested batch lands on the device; other values stay as they are."""
    from rayzero.train.worker import to_device

    acc = use_standin(on_device=True)
    batch = {"pair": Pair(torch.ones(2), torch.zeros(3)), "list": [torch.arange(4), "text", 3],
             "tuple": (torch.ones(1, 2),)}
    moved = to_device(batch, acc.device(), acc.pin_memory)
    return {
        "devices": [str(t.device) for t in (moved["pair"].x, moved["pair"].y, moved["list"][0], moved["tuple"][0])],
        "types": [type(moved["pair"]).__name__, type(moved["list"]).__name__, type(moved["tuple"]).__name__],
        "others": moved["list"][1:],
        "values": [moved["pair"].x.cpu(), moved["list"][0].cpu()],
    }


def loss_reads_per_step(rank: int, world: int) -> dict:
    """Reads of device values to the host (``.item()``, ``float()``, ``bool()``: the stand-in device's
    ``_local_scalar_dense``) during the worker's step, with 1 and with 4 micro-batches: the loss is summed on
    the device, so more micro-batches add none."""
    import standin_device

    import rayzero
    from rayzero.train.worker import WorkerSpec, run_step
    from zero_cases import IN, OUT, base_config, make_model

    acc = use_standin(on_device=True)
    counted = {"reads": 0, "on": False}
    run = standin_device._run  # every operator on a stand-in tensor goes through it

    def counting(func, args, kwargs):
        if counted["on"] and func is torch.ops.aten._local_scalar_dense.default:
            counted["reads"] += 1
        return run(func, args, kwargs)

    standin_device._run = counting
    mse = lambda out, batch: torch.nn.functional.mse_loss(out, batch[1])
    reads, losses = {}, {}
    for gas in (1, 4):
        engine = rayzero.initialize(make_model(), base_config(2, world, 2 * gas * world, gas=gas))
        spec = WorkerSpec(model=None, config={}, global_batch=2 * gas * world, max_steps=1, loss_fn=mse)
        g = torch.Generator().manual_seed(3)
        host = [(torch.randn(2, IN, generator=g), torch.randn(2, OUT, generator=g)) for _ in range(gas)]
        run_step(engine, spec, iter(host), gas)  # a first step outside the count (its set-up reads)
        counted.update(reads=0, on=True)
        loss = run_step(engine, spec, iter(host), gas)
        counted["on"] = False
        reads[gas], losses[gas] = counted["reads"], (str(loss.device), loss.cpu())
        engine.destroy()
    return {"reads": reads, "losses": losses, "device": str(acc.device())}

