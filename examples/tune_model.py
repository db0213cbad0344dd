"""A model, data and loss to run ``rayzero tune`` on: bench/bench_zero.py's model and random regression data.

    rayzero tune --model examples/tune_model.py:model --data examples/tune_model.py:data \\
        --loss examples/tune_model.py:loss --config examples/tune_config.json --workers 2 --out best.json

``small_model`` is the same shape at a size that tunes in seconds a trial (the test suite uses it).  Data are
generated from a seed on each worker; nothing is downloaded.
"""

from __future__ import annotations

import torch

DIM = 1024


def blocks(dim: int, hidden: int, count: int) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(*[
        torch.nn.Sequential(torch.nn.Linear(dim, hidden), torch.nn.GELU(), torch.nn.Linear(hidden, dim))
        for _ in range(count)
    ])


def model() -> torch.nn.Module:
    """33.6M parameters: 4 x [Linear(1024, 4096) -> GELU -> Linear(4096, 1024)]."""
    return blocks(DIM, 4096, 4)


def small_model() -> torch.nn.Module:
    return blocks(DIM, 64, 2)


def data(rank: int, world: int, micro_batch: int):
    """Endless (x, y) micro-batches for one data-parallel rank; each rank draws its own stream."""
    g = torch.Generator().manual_seed(1234 + rank)
    while True:
        yield torch.randn(micro_batch, DIM, generator=g), torch.randn(micro_batch, DIM, generator=g)


def loss(output: torch.Tensor, batch) -> torch.Tensor:
    return torch.nn.functional.mse_loss(output, batch[1])
