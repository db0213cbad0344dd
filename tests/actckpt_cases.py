"""A model of repeated residual blocks, and the per-rank runs the activation-checkpointing tests compare."""

from __future__ import annotations

import torch
import torch.nn.functional as F

import rayzero
from rayzero.activation_checkpointing import _WRAPPED_ATTR
from zero_cases import base_config

IN, D, FF, OUT, BLOCKS = 13, 19, 43, 7, 4


class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = torch.nn.Linear(D, FF)
        self.fc2 = torch.nn.Linear(FF, D)
        self.drop = torch.nn.Dropout(0.2)  # the recompute must draw the same mask

    def forward(self, x):
        return x + self.drop(self.fc2(torch.tanh(self.fc1(x))))


class BlockNet(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = torch.nn.Linear(IN, D)
        self.blocks = torch.nn.ModuleList(Block() for _ in range(BLOCKS))
        self.out = torch.nn.Linear(D, OUT)

    def forward(self, x):
        x = self.inp(x)
        for block in self.blocks:
            x = block(x)
        return self.out(x)


def _batches(steps: int, global_batch: int):
    g = torch.Generator().manual_seed(3)
    return [(torch.randn(global_batch, IN, generator=g), torch.randn(global_batch, OUT, generator=g))
            for _ in range(steps)]


def train(rank: int, world: int, stage: int, checkpointing: bool, steps: int = 3, global_batch: int = 8) -> dict:
    """Train BlockNet on this rank's share; the saved tensors of the first step's forward, counted by a
    saved_tensors_hooks around it (what autograd keeps for backward outside any checkpoint)."""
    torch.manual_seed(0)
    model = BlockNet()
    extra = {"activation_checkpointing": {"partition_activations": False, "number_checkpoints": 4}} \
        if checkpointing else {}
    cfg = base_config(stage, world, global_batch, **extra)
    cfg["zero_optimization"]["stage3_param_persistence_threshold"] = 0  # gather every parameter at stage 3
    engine = rayzero.initialize(model, cfg)
    torch.manual_seed(100 + rank)  # dropout masks: the same in both runs
    per = global_batch // world
    losses, saved = [], {"tensors": 0, "elements": 0}

    def pack(t):
        saved["tensors"] += 1
        saved["elements"] += t.numel()
        return t

    for i, (x, y) in enumerate(_batches(steps, global_batch)):
        xs, ys = x[rank * per:(rank + 1) * per], y[rank * per:(rank + 1) * per]
        if i == 0:
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                loss = F.mse_loss(engine(xs), ys)
        else:
            loss = F.mse_loss(engine(xs), ys)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    state = engine.full_state_dict()
    wrapped = sum(_WRAPPED_ATTR in m.__dict__ for m in model.modules())
    engine.destroy()
    unwrapped = sum("forward" in m.__dict__ for m in model.modules())  # the engine put back every forward it set
    return {"losses": losses, "state": state, "saved": saved, "wrapped": wrapped, "unwrapped": unwrapped}


def all_runs(rank: int, world: int) -> dict:
    return {(stage, ckpt): train(rank, world, stage, ckpt) for stage in (0, 3) for ckpt in (False, True)}


if __name__ == "__main__":  # the figures in docs/config.md: PYTHONPATH=$PWD:$PWD/tests python tests/actckpt_cases.py
    from distributed import run_distributed

    for (stage, ckpt), run in sorted(run_distributed(all_runs, 2)[0].items()):
        print(f"stage {stage} checkpointing {ckpt}: saved {run['saved']}, losses {run['losses']}")
