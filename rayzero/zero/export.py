"""Consolidated weights, one parameter at a time: ``iter_full_state_dict`` and ``full_state_dict``.

A model trained with ZeRO-3 may only fit sharded, so its whole weights are never put together at once:
each trained parameter is all-gathered from the ranks' fp32 master shards (``Partitions.gather_full``), an
EP/TP slice is joined with its sibling slices (``Engine._unslice``), and the result is handed out before
the next parameter is gathered.  Every gather is a collective, so every rank of the engine iterates the
same names in the same order (the model's own ``state_dict`` order) and runs the iteration to its end.

``rank0_only``: only global rank 0 keeps the tensors; the other ranks take part in the gathers, drop the
result at once and see ``None`` for every name (``full_state_dict`` gives them an empty dict).
``cpu_offload``: every tensor handed out is moved to host memory as soon as it is gathered, so the
accelerator holds at most the parameter in flight.  Together, a rank that does not keep the result peaks at
about one parameter (the gather's receive rows and the assembled tensor) above what it held before.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import TYPE_CHECKING, Iterator

import torch

from rayzero.parallel.slicing import splits_of

if TYPE_CHECKING:
    from rayzero.engine import Engine


def _stream(
    engine: "Engine", rank0_only: bool, cpu_offload: bool, reuse: dict[int, torch.Tensor] | None
) -> Iterator[tuple[str, torch.Tensor | None]]:
    keep = not rank0_only or engine.rank == 0
    partitions = engine.partitions

    def out(t: torch.Tensor) -> torch.Tensor | None:
        if not keep:
            return None
        return t.to("cpu") if cpu_offload else t

    # (NVMe optimizer offload: gather_full reads a swapped-out sub-group's master from its file, one
    # sub-group at a time)
    with torch.no_grad():
        for name, t in engine.module.state_dict(keep_vars=True).items():
            if not isinstance(t, torch.Tensor):  # extra state: not weights
                continue
            if reuse is not None and id(t) in reuse:  # a tied parameter under its second name
                yield name, reuse[id(t)]
                continue
            entry = partitions.entry_of.get(t) if isinstance(t, torch.nn.Parameter) else None
            if entry is not None:  # trained: from the fp32 masters of every rank
                value = out(engine._unslice(partitions.gather_full(entry), entry))
            elif isinstance(t, torch.nn.Parameter) and splits_of(t):  # a frozen EP/TP slice: join the slices
                whole = engine._unslice(t.detach().clone(), SimpleNamespace(shape=t.shape, splits=splits_of(t)))
                value = out(whole)
            else:  # a frozen parameter or a buffer: whole on every rank already
                value = out(t.detach().clone()) if keep else None
            if reuse is not None and value is not None and isinstance(t, torch.nn.Parameter):
                reuse[id(t)] = value
            yield name, value
            del value


def iter_full_state_dict(
    engine: "Engine", rank0_only: bool = False, cpu_offload: bool = False
) -> Iterator[tuple[str, torch.Tensor | None]]:
    """Yield ``(name, tensor)`` for the model's whole ``state_dict``, one entry at a time.

    Trained parameters come in fp32 from the masters; frozen parameters and buffers as they are.  The
    iteration is a sequence of collectives: call it on every rank of the engine and run it to the end
    everywhere.  With ``rank0_only`` the ranks other than global rank 0 get ``None`` for every name.  A
    parameter tied under several names is gathered again for each name (nothing is kept between items).
    """
    engine._check_alive()
    return _stream(engine, rank0_only, cpu_offload, reuse=None)


def full_state_dict(
    engine: "Engine", rank0_only: bool = False, cpu_offload: bool = False
) -> dict[str, torch.Tensor]:
    """The whole ``state_dict`` as a dict in the model's key order, built from the stream (tied names share
    one tensor).  With ``rank0_only`` the other ranks get an empty dict and keep nothing."""
    engine._check_alive()
    result: dict[str, torch.Tensor] = {}
    for name, value in _stream(engine, rank0_only, cpu_offload, reuse={}):
        if value is not None:
            result[name] = value
    return result
