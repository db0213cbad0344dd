"""A stand-in accelerator for CPU tests of the engine's device-side bookkeeping: it computes on the CPU
but keeps a random generator of its own (as a GPU does) and counts how often it is synchronized."""

from __future__ import annotations

import os

import torch

from rayzero.accelerator.cpu import CpuAccelerator


class StandInAccelerator(CpuAccelerator):
    name = "standin"

    def __init__(self) -> None:
        super().__init__()
        self.generator = torch.Generator().manual_seed(99)  # the "device's" generator
        self.synchronized = 0
        self.set_devices: list[int] = []

    def set_device(self, index: int) -> None:
        self.set_devices.append(index)

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


def use_standin() -> StandInAccelerator:
    from rayzero.accelerator import get_accelerator, register_accelerator

    register_accelerator("standin", StandInAccelerator, replace=True)
    os.environ["RAYZERO_ACCELERATOR"] = "standin"
    return get_accelerator()


def rng_and_timers(rank: int, world: int, ckpt: str) -> dict:
    """Save with the device generator at one state, move it on, load: it is back.  Then the wall-clock
    breakdown's timers wait for the device (one synchronize per clock reading)."""
    import rayzero
    from zero_cases import base_config, batches, make_model

    acc = use_standin()
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
        x, y = batches(1, 4)[0]
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
    for x, y in batches(3, 4):
        engine.backward(torch.nn.functional.mse_loss(engine(x[rank * 2 : rank * 2 + 2]), y[rank * 2 : rank * 2 + 2]))
        engine.step()
        norms.append(engine.global_grad_norm)
    out = {"norms": norms, "state": engine.full_state_dict(), "set_devices": acc.set_devices if acc else None}
    engine.destroy()
    return out
