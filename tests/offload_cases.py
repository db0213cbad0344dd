"""Per-rank runs for the offload tests: the ZeRO test model and data with offload settings."""

from __future__ import annotations

import torch

import rayzero
from zero_cases import engine_run


def zero_section(stage: int, **extra) -> dict:
    """The ZeRO test section (several buckets, a parameter larger than a bucket) plus ``extra``."""
    return {"stage": stage, "reduce_bucket_size": 500, "allgather_bucket_size": 700,
            "stage3_param_persistence_threshold": 30, **extra}


def offload_run(rank: int, world: int, stage: int, device: str, swap_root: str | None = None,
                sub_group_size: int = 300, deterministic: bool = False, **kw) -> dict:
    off = {"device": device}
    if device == "nvme":
        off["nvme_path"] = swap_root
    zero = zero_section(stage, sub_group_size=sub_group_size)
    if device != "none":
        zero["offload_optimizer"] = off
    return engine_run(rank, world, stage=stage, zero_optimization=zero, deterministic=deterministic, **kw)


def run_offload_cases(rank: int, world: int, cases: list[dict]) -> list[dict]:
    return [offload_run(rank, world, **case) for case in cases]


class TwoWeights(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a = torch.nn.Parameter(torch.zeros(37))
        self.b = torch.nn.Parameter(torch.zeros(11))

    def forward(self, k: float, use_b: bool) -> torch.Tensor:
        loss = k * self.a.sum()
        return loss + 3.0 * self.b.sum() if use_b else loss


def accumulate_run(rank: int, world: int, stage: int, device: str, swap_root: str | None = None) -> dict:
    """Three backward calls (gradients 1, 2 and 4 for ``a``; ``b`` only in the second) then one step, with
    gradient_accumulation_steps = 1 and SGD at lr 1: the step subtracts the accumulated gradients."""
    off = {"device": device, **({"nvme_path": swap_root} if device == "nvme" else {})}
    cfg = {
        "train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
        "zero_optimization": zero_section(stage, stage3_param_persistence_threshold=0, offload_optimizer=off),
        "optimizer": {"type": "SGD", "params": {"lr": 1.0}},
    }
    engine = rayzero.initialize(TwoWeights(), cfg)
    for k, use_b in ((1.0, False), (2.0, True), (4.0, False)):
        engine.backward(engine(k, use_b))
    engine.step()
    state = engine.full_state_dict()
    engine.destroy()
    return state


def _train(engine, rank: int, world: int, steps, global_batch: int = 12) -> list[float]:
    import torch.nn.functional as F

    from zero_cases import batches

    per_rank = global_batch // world
    losses = []
    for x, y in steps:
        loss = F.mse_loss(engine(x[rank * per_rank : (rank + 1) * per_rank]).float(), y[rank * per_rank : (rank + 1) * per_rank])
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


def resume_run(rank: int, world: int, stage: int, device: str, ckpt_dir: str, swap_root: str | None = None,
               load_device: str | None = None, bf16: bool = True) -> dict:
    """Train 2 steps, save, train 2 more; then a fresh engine (offload ``load_device``) loads the save and
    trains the same 2 steps.  Returns both endings and the loaded optimizer state's dtypes and devices."""
    from zero_cases import base_config, batches, make_model

    def build(dev):
        off = {"device": dev, **({"nvme_path": swap_root} if dev == "nvme" else {})}
        zero = zero_section(stage, sub_group_size=300, **({"offload_optimizer": off} if dev != "none" else {}))
        cfg = base_config(stage, world, 12, zero_optimization=zero, bf16={"enabled": bf16})
        return rayzero.initialize(make_model(), cfg)

    data = batches(4, 12)
    engine = build(device)
    _train(engine, rank, world, data[:2])
    engine.save_checkpoint(ckpt_dir, tag="s2")
    first = _train(engine, rank, world, data[2:])
    straight = engine.full_state_dict()
    engine.destroy()
    engine = build(load_device or device)
    engine.load_checkpoint(ckpt_dir, tag="s2")
    if engine.swap is not None:  # the loaded state is in the swap files: look at it one sub-group at a time
        states = []
        for gi, g in enumerate(engine.partitions.groups):
            with engine.swap.group_resident(gi):
                states += [(str(v.dtype), v.device.type) for v in engine.optimizer.state[g.master].values()
                           if torch.is_tensor(v) and v.numel() > 1]
    else:
        states = [(str(v.dtype), v.device.type) for st in engine.optimizer.state.values() for v in st.values()
                  if torch.is_tensor(v) and v.numel() > 1]
    masters = [(str(g.master.dtype), g.master.device.type) for g in engine.partitions.groups]
    second = _train(engine, rank, world, data[2:])
    resumed = engine.full_state_dict()
    engine.destroy()
    return {"straight": straight, "resumed": resumed, "first": first, "second": second, "states": states,
            "masters": masters}


def param_offload_run(rank: int, world: int, device: str, swap_root: str, optimizer_device: str = "none",
                      **kw) -> dict:
    """Stage 3 with the parameter shards offloaded (and the optimizer as given)."""
    zero = zero_section(3, sub_group_size=300, offload_param={
        "device": device, **({"nvme_path": swap_root} if device == "nvme" else {}), "max_in_cpu": 200})
    if optimizer_device != "none":
        zero["offload_optimizer"] = {"device": optimizer_device,
                                     **({"nvme_path": swap_root} if optimizer_device == "nvme" else {})}
    return engine_run(rank, world, stage=3, zero_optimization=zero, **kw)


def run_param_offload_cases(rank: int, world: int, cases: list[dict]) -> list[dict]:
    return [param_offload_run(rank, world, **case) if case.get("device", "none") != "none"
            else offload_run(rank, world, stage=3, **{k: v for k, v in case.items() if k != "optimizer_device"})
            for case in cases]
