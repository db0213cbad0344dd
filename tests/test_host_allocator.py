"""The host allocator (rayzero/accelerator/host_allocator.py): with freed memory kept for reuse, a stage-3
step on CPU stops faulting in fresh pages for its gathered parameters; the same run with it turned off
faults them in every step. Training is the same either way."""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F

import rayzero
from distributed import run_distributed

STEPS, WARMUP = 6, 3


def _minor_faults() -> int:
    with open("/proc/self/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[7])


def _train(rank: int, world: int, keep: str) -> dict:
    os.environ["RAYZERO_KEEP_FREED_MEMORY"] = keep
    for k in ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_"):
        os.environ.pop(k, None)
    torch.manual_seed(0)
    # 4 MiB weights: above glibc's default mmap threshold, below the 32 MiB that keep_freed_memory fixes
    model = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(512, 2048), torch.nn.GELU(),
                                                      torch.nn.Linear(2048, 512)) for _ in range(3)])
    engine = rayzero.initialize(model, {"train_batch_size": 8, "zero_optimization": {"stage": 3},
                                        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}})
    g = torch.Generator().manual_seed(1)
    losses = []
    for step in range(STEPS):
        if step == WARMUP:
            start = _minor_faults()
        x = torch.randn(8, 512, generator=g)[rank * 4 : (rank + 1) * 4]
        loss = F.mse_loss(engine(x), x)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    faults = (_minor_faults() - start) / (STEPS - WARMUP)
    out = {"faults": faults, "losses": losses, "applied": engine.host_allocator}
    engine.destroy()
    return out


def test_kept_memory_ends_the_page_faults_of_stage3_gathers():
    kept = run_distributed(_train, 2, "1")
    off = run_distributed(_train, 2, "0")
    for a, b in zip(kept, off):
        assert a["applied"] and a["applied"]["mmap_threshold"] == 32 << 20 and b["applied"] is None
        assert a["losses"] == b["losses"]
        # a step gathers ~17 MiB of weights twice (~8,000 fresh pages when they are given back)
        assert b["faults"] > 2000, b
        assert a["faults"] < b["faults"] / 5, (a, b)
