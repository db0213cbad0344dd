"""Stand-in accelerators for CPU tests of the engine's device path.

* :class:`StandInAccelerator` computes on the CPU, but keeps a random generator of its own (as a GPU
  does), counts how often it is synchronized and records ``set_device``.
* :class:`StandInDeviceAccelerator` is the same with its tensors on the ``standin`` device
  (tests/standin_device.py: a second device kind whose values sit in CPU memory) and its process groups on
  the ``standin`` backend, which refuses host tensors as NCCL does.  ZeRO stage 3 resizes parameter
  storages, which a device registered from Python cannot do, so stage 3 runs on the first one.
"""

from __future__ import annotations

import os

import torch

from rayzero.accelerator.cpu import CpuAccelerator

import standin_device


class StandInAccelerator(CpuAccelerator):
    name = "standin"

    def __init__(self) -> None:
        super().__init__()
        self.index = 0
        self.generator = torch.Generator().manual_seed(99)  # the "device's" generator
        self.synchronized = 0
        self.set_devices: list[int] = []

    def current_device_index(self) -> int:
        return self.index

    def set_device(self, index: int) -> None:
        self.set_devices.append(index)
        self.index = index

    def device_count(self) -> int:
        return 2  # a two-device node: LOCAL_RANK picks the device

    def synchronize(self, index: int | None = None) -> None:
        self.synchronized += 1

    def manual_seed(self, seed: int) -> None:
        super().manual_seed(seed)
        self.generator.manual_seed(seed)

    def get_rng_state(self, index: int | None = None) -> torch.Tensor:
        return self.generator.get_state()

    def set_rng_state(self, state: torch.Tensor, index: int | None = None) -> None:
        self.generator.set_state(state)


class StandInDeviceAccelerator(StandInAccelerator):
    def __init__(self) -> None:
        super().__init__()
        standin_device.install()

    def device(self, index: int | None = None) -> torch.device:
        return torch.device(standin_device.DEVICE, self.index if index is None else index)

    def communication_backend(self) -> str:
        return standin_device.DEVICE


def use_standin(on_device: bool = False) -> StandInAccelerator:
    """Make a stand-in this process's accelerator.  ``on_device``: the one on the ``standin`` device, whose
    ranks then join a ``standin`` process group (run such cases with ``run_distributed(..., init_pg=False)``)."""
    import torch.distributed as dist

    from rayzero.accelerator import get_accelerator, register_accelerator

    register_accelerator("standin", StandInDeviceAccelerator if on_device else StandInAccelerator, replace=True)
    os.environ["RAYZERO_ACCELERATOR"] = "standin"
    acc = get_accelerator()
    if on_device and not dist.is_initialized():
        dist.init_process_group(standin_device.DEVICE, rank=int(os.environ["RANK"]),
                                world_size=int(os.environ["WORLD_SIZE"]))
    return acc


def rng_and_timers(rank: int, world: int, ckpt: str) -> dict:
    """Save with the device generator at one state, move it on, load: it is back.  Then the wall-clock
    breakdown's timers wait for the device (one synchronize per clock reading)."""
    import rayzero
    from zero_cases import base_config, batches, make_model

    acc = use_standin(on_device=True)
    engine = rayzero.initialize(make_model(), base_config(1, world, 4))
    torch.randn(3, generator=acc.generator)  # the device stream moves during training
    saved = acc.get_rng_state().clone()
    engine.save_checkpoint(ckpt, tag="t")
    torch.randn(5, generator=acc.generator)
    moved = acc.get_rng_state().clone()
    engine.load_checkpoint(ckpt, tag="t")
    restored = acc.get_rng_state().clone()
    engine.destroy()

    counts = {}
    for breakdown in (False, True):
        engine = rayzero.initialize(make_model(), base_config(1, world, 4, wall_clock_breakdown=breakdown))
        x, y = (t.to(acc.device()) for t in batches(1, 4)[0])
        before = acc.synchronized
        engine.backward(torch.nn.functional.mse_loss(engine(x[rank * 2 : rank * 2 + 2]), y[rank * 2 : rank * 2 + 2]))
        engine.step()
        counts[breakdown] = acc.synchronized - before
        engine.destroy()
    return {"saved": saved, "moved": moved, "restored": restored, "accelerator": acc.name, "syncs": counts}


def off_cpu_path(rank: int, world: int, standin: bool) -> dict:
    """Stage 3 on a model built under zero_init, through the off-CPU set-up (set_device from LOCAL_RANK,
    the model and zero_init's shards placed on the accelerator's device) with the stand-in, or on the CPU
    accelerator: the two must train alike."""
    import rayzero
    from zero_cases import base_config, batches, make_model

    os.environ["LOCAL_RANK"] = str(rank)
    acc = use_standin() if standin else None
    with rayzero.zero_init():
        model = make_model()
    engine = rayzero.initialize(model, base_config(3, world, 4))
    norms = []
    device = acc.device() if acc else torch.device("cpu")
    for x, y in batches(3, 4):
        x, y = x.to(device), y.to(device)
        engine.backward(torch.nn.functional.mse_loss(engine(x[rank * 2 : rank * 2 + 2]), y[rank * 2 : rank * 2 + 2]))
        engine.step()
        norms.append(engine.global_grad_norm)
    out = {"norms": norms, "state": engine.full_state_dict(), "set_devices": acc.set_devices if acc else None}
    engine.destroy()
    return out


def backend_refuses_host_tensors(rank: int, world: int) -> dict:
    """The stand-in device and backend themselves: device collectives work, host tensors are refused."""
    import torch.distributed as dist

    acc = use_standin(on_device=True)
    summed = torch.full((3,), float(rank + 1), device=acc.device())
    dist.all_reduce(summed)
    refused = {}
    for what, call in {
        "collective": lambda: dist.all_reduce(torch.ones(3)),
        "operator": lambda: summed + torch.ones(3),
    }.items():
        try:
            call()
            refused[what] = None
        except standin_device.HostTensorError as e:
            refused[what] = str(e)
    return {"device": str(summed.device), "summed": summed.cpu(), "refused": refused}


def device_training(rank: int, world: int, stage: int, on_device: bool, ckpt: str, offload: bool = False) -> dict:
    """Three steps of two micro-batches with clipping, a save, a load into a fresh engine and one more
    step, on the stand-in device (``on_device``) or the CPU; ``offload``: the optimizer in host memory."""
    import rayzero
    from zero_cases import base_config, batches, make_model

    acc = use_standin(on_device=True) if on_device else None
    device = acc.device() if acc else torch.device("cpu")
    cfg = base_config(stage, world, 8, gas=2)
    if offload:
        cfg["zero_optimization"]["offload_optimizer"] = {"device": "cpu"}
    data = batches(4, 8)
    engine = rayzero.initialize(make_model(), cfg)
    norms, losses = [], []

    def step(engine, x, y) -> None:
        for micro in range(2):
            rows = slice(rank * 4 + micro * 2, rank * 4 + micro * 2 + 2)
            loss = torch.nn.functional.mse_loss(engine(x[rows].to(device)), y[rows].to(device))
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
        norms.append(engine.global_grad_norm)

    for x, y in data[:3]:
        step(engine, x, y)
    engine.save_checkpoint(ckpt, tag="t")
    engine.destroy()
    engine = rayzero.initialize(make_model(seed=5), cfg)
    engine.load_checkpoint(ckpt, tag="t")
    step(engine, *data[3])
    state = {k: v.cpu() for k, v in engine.full_state_dict().items()}
    devices = sorted({str(p.device) for p in engine.module.parameters()})
    engine.destroy()
    return {"norms": norms, "losses": losses, "state": state, "devices": devices}


def parallel_on_device(rank: int, world: int, on_device: bool, model: str, ep: int = 1, tp: int = 1) -> dict:
    """A tiny transformers model (tests/moe_cases.py) under AutoEP / AutoTP at stage 2, on the stand-in
    device or the CPU: losses, norms and the consolidated weights."""
    import rayzero
    from moe_cases import MODELS, batches, engine_config

    acc = use_standin(on_device=True) if on_device else None
    device = acc.device() if acc else torch.device("cpu")
    engine = rayzero.initialize(MODELS[model](), engine_config(2, ep=ep, tp=tp))
    data = batches(2, engine.dp_world_size, 2)
    losses, norms = [], []
    for step in range(2):
        ids = data[step, 0, engine.dp_rank].to(device)
        out = engine(input_ids=ids, labels=ids)
        engine.backward(out.loss)
        engine.step()
        losses.append(out.loss.item())
        norms.append(engine.global_grad_norm)
    weights = {k: v.cpu() for k, v in engine.full_state_dict().items()}
    engine.destroy()
    return {"losses": losses, "norms": norms, "weights": weights}
