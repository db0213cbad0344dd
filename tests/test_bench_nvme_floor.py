"""The NVMe rows of bench/bench_offload.py and bench_zero.py --memory against the disk (issue 27), with
bench/swap_traffic.py's helpers: the swap stores found on an engine, the bytes their counters say a step moved,
and the I/O floor from bench_swap.py's raw O_DIRECT dd figures.  Real engines (world 1) swapping under
tmp_path, real dd runs."""

from __future__ import annotations

import itertools
import math
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench"))

import rayzero  # noqa: E402
from bench_swap import disk_raw_gbs  # noqa: E402
from swap_traffic import add_disk_ratio, io_counters, io_floor_s, settle, swap_stores  # noqa: E402


def engine_with(tmp_path, stage: int, optimizer: str, params: str = "none", sub_group: int | None = None):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 64))
    zero: dict = {"stage": stage, "offload_optimizer": {"device": optimizer}}
    if optimizer == "nvme":
        zero["offload_optimizer"]["nvme_path"] = str(tmp_path / "swap")
    if params != "none":
        zero["offload_param"] = {"device": params, "nvme_path": str(tmp_path / "swap")}
    if sub_group is not None:
        zero["sub_group_size"] = sub_group
    return rayzero.initialize(model, {"train_batch_size": 4, "zero_optimization": zero,
                                      "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}})


def train_step(engine, seed: int) -> None:
    x = torch.randn(4, 64, generator=torch.Generator().manual_seed(seed))
    engine.backward(engine(x).pow(2).mean())
    engine.step()


def test_swap_stores_finds_the_ranks_one_store_through_both_swaps(tmp_path):
    engine = engine_with(tmp_path, 3, "nvme", params="nvme")
    try:
        found = swap_stores(engine)
        # optimizer and parameter swap share the rank's store (rank_swap.py): it is found once
        assert len(found) == 1 and found[0] is engine._swap_store
        assert engine.swap.store is found[0] and engine.partitions.param_swap.store is found[0]
        train_step(engine, 0)
        assert io_counters(found) == {k: engine._swap_store.stats[k] for k in io_counters(found)}
    finally:
        engine.destroy()
    engine = engine_with(tmp_path, 2, "cpu")
    try:
        assert swap_stores(engine) == []
    finally:
        engine.destroy()


def test_step_counters_are_the_masters_and_moments_the_step_moves(tmp_path):
    """Optimizer on NVMe: every sub-group's master and AdamW moments are written each step; each is read unless
    the step takes it back from the swap pool (reads_skipped); every sub-group's gradient is written by the
    backward and read by the step.  Counted between settled stores, as the bench counts its timed steps."""
    engine = engine_with(tmp_path, 2, "nvme", sub_group=5000)
    try:
        sizes = [g.layout.partition_numel for g in engine.partitions.groups]
        assert len(sizes) > 2
        stores = swap_stores(engine)
        train_step(engine, 0)  # creates the moments
        for step in range(1, 4):
            settle(stores)  # the last step's writes finish during this one: counted with the step they belong to
            before, skipped = io_counters(stores), engine.swap.reads_skipped
            train_step(engine, step)
            settle(stores)
            moved = {k: v - before[k] for k, v in io_counters(stores).items()}
            tensors = [1 + len(engine.swap.state_names[gi]) for gi in range(len(sizes))]
            assert tensors == [3] * len(sizes)  # master, exp_avg, exp_avg_sq
            grads = 4 * sum(sizes)  # the gradient partition, written once and read once
            assert moved["bytes_written"] == sum(4 * t * n for t, n in zip(tensors, sizes)) + grads
            read = len(sizes) - (engine.swap.reads_skipped - skipped)
            assert any(moved["bytes_read"] == 12 * sum(c) + grads
                       for c in itertools.combinations(sizes, read)), moved
            assert moved["read_seconds"] > 0 and moved["write_seconds"] > 0
    finally:
        engine.destroy()


def test_disk_floor_from_raw_dd_figures(tmp_path):
    disk = disk_raw_gbs(str(tmp_path), size_mb=16, streams=2, bs_mb=4, repeat=2)
    assert os.listdir(tmp_path) == []  # the dd files and their directory are gone
    for name in ("write", "read", "rewrite"):
        assert len(disk[f"{name}_gbs_all"]) == 2 and all(0 < v < math.inf for v in disk[f"{name}_gbs_all"])
        assert min(disk[f"{name}_gbs_all"]) <= disk[f"{name}_gbs"] <= max(disk[f"{name}_gbs_all"])
    read, written = 12 * 16_787_456, 12 * 16_787_456  # the bench model's partition at W=2, both ways
    floor = read / (disk["read_gbs"] * 1e9) + written / (disk["rewrite_gbs"] * 1e9)
    assert io_floor_s(read, written, disk) == pytest.approx(floor, rel=1e-12)
    row = dict(status="ok", median_step_ms=900.0, bytes_read_ranks=read, bytes_written_ranks=written)
    add_disk_ratio(row, disk)
    assert row["io_floor_s"] == pytest.approx(floor, rel=1e-12)
    assert row["floor_over_step"] == pytest.approx(floor / 0.9, rel=1e-12)
    no_swap = dict(status="ok", median_step_ms=900.0)
    add_disk_ratio(no_swap, disk)
    assert "floor_over_step" not in no_swap
