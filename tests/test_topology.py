"""ParallelDims rank layout and real process groups over gloo."""

from __future__ import annotations

import os
import socket
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from rayzero.topology import (
    GROUP_KINDS,
    ParallelDims,
    RankCoords,
    build_process_groups,
    destroy_process_groups,
)


def test_world8_tp2_ep2_rank_lists() -> None:
    dims = ParallelDims(world_size=8, tp=2, ep=2)
    assert (dims.dp, dims.edp) == (4, 2)
    assert dims.tp_groups() == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert dims.dp_groups() == [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert dims.ep_groups() == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert dims.edp_groups() == [[0, 4], [1, 5], [2, 6], [3, 7]]

    assert dims.coords(5) == RankCoords(dp=2, tp=1, ep=0, edp=1)
    mine = dims.groups_of(5)
    assert mine.dp == [1, 3, 5, 7]
    assert mine.tp == [4, 5]
    assert mine.ep == [5, 7]
    assert mine.edp == [1, 5]


def test_world6_tp1_ep3_rank_lists() -> None:
    dims = ParallelDims(world_size=6, ep=3)
    assert (dims.tp, dims.dp, dims.edp) == (1, 6, 2)
    assert dims.tp_groups() == [[0], [1], [2], [3], [4], [5]]
    assert dims.dp_groups() == [[0, 1, 2, 3, 4, 5]]
    assert dims.ep_groups() == [[0, 1, 2], [3, 4, 5]]
    assert dims.edp_groups() == [[0, 3], [1, 4], [2, 5]]
    assert dims.coords(4) == RankCoords(dp=4, tp=0, ep=1, edp=1)


def test_world1_everything_is_one_rank() -> None:
    dims = ParallelDims(world_size=1)
    assert (dims.dp, dims.tp, dims.ep, dims.edp) == (1, 1, 1, 1)
    for kind in GROUP_KINDS:
        assert dims.groups(kind) == [[0]]
    assert dims.coords(0) == RankCoords(0, 0, 0, 0)
    assert dims.groups_of(0) == ([0], [0], [0], [0])


@pytest.mark.parametrize(
    "world_size,tp,ep",
    [(8, 2, 2), (6, 1, 3), (1, 1, 1), (16, 4, 2), (12, 3, 4), (8, 8, 1), (8, 1, 8), (24, 2, 3)],
)
def test_every_rank_in_exactly_one_group_of_each_kind(world_size: int, tp: int, ep: int) -> None:
    dims = ParallelDims(world_size, tp=tp, ep=ep)
    sizes = {"dp": dims.dp, "tp": dims.tp, "ep": dims.ep, "edp": dims.edp}
    for kind in GROUP_KINDS:
        groups = dims.groups(kind)
        flat = sorted(r for group in groups for r in group)
        assert flat == list(range(world_size)), kind
        assert all(len(group) == sizes[kind] for group in groups), kind
        assert groups == sorted(groups) and all(group == sorted(group) for group in groups)
    for rank in range(world_size):
        coords = dims.coords(rank)
        mine = dims.groups_of(rank)
        for kind in GROUP_KINDS:
            group = getattr(mine, kind)
            assert group in dims.groups(kind)
            # A rank's coordinate is its index inside that group.
            assert group.index(rank) == getattr(coords, kind)
        # ep x edp partitions each dp group.
        assert sorted(r for e in mine.ep for r in dims.groups_of(e).edp) == mine.dp


def test_divisibility_errors_name_the_numbers() -> None:
    with pytest.raises(ValueError, match=r"tp=3 does not divide world_size=8.*1, 2, 4, 8"):
        ParallelDims(world_size=8, tp=3)
    with pytest.raises(ValueError, match=r"ep=3 does not divide dp=4 \(world_size=8 // tp=2\).*1, 2, 4"):
        ParallelDims(world_size=8, tp=2, ep=3)
    with pytest.raises(ValueError, match=r"ep=4 does not divide dp=6.*1, 2, 3, 6"):
        ParallelDims(world_size=6, ep=4)


@pytest.mark.parametrize("kwargs", [dict(world_size=0), dict(world_size=4, tp=0),
                                    dict(world_size=4, ep=-2), dict(world_size=4, tp=2.0)])
def test_degrees_must_be_positive_ints(kwargs: dict) -> None:
    bad_name = next(k for k, v in kwargs.items() if not (isinstance(v, int) and v >= 1))
    with pytest.raises(ValueError, match=rf"{bad_name} must be an int >= 1, got {kwargs[bad_name]!r}"):
        ParallelDims(**kwargs)


def test_coords_reject_out_of_range_rank() -> None:
    with pytest.raises(ValueError, match=r"rank 8 is outside world_size=8; use 0..7"):
        ParallelDims(8, tp=2).coords(8)


def test_build_process_groups_needs_initialised_dist() -> None:
    if dist.is_initialized():
        pytest.skip("a default process group already exists in this process")
    with pytest.raises(RuntimeError, match="init_process_group"):
        build_process_groups(ParallelDims(1), 0)


# ---- real process groups over gloo ---------------------------------------------------

WORLD_SIZE = 4
# Several layouts per launch: process start-up dominates the cost.
LAYOUTS = [(2, 2), (2, 1), (1, 2), (1, 4), (4, 1)]


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _check_group(kind: str, group: dist.ProcessGroup, ranks: list[int], rank: int) -> None:
    value = torch.tensor([float(rank)])
    dist.all_reduce(value, group=group)
    expected = float(sum(ranks))
    assert value.item() == expected, f"rank {rank}: {kind} sum {value.item()} != {expected} over {ranks}"
    assert dist.get_world_size(group) == len(ranks), kind
    assert dist.get_process_group_ranks(group) == ranks, kind


def _worker(rank: int, port: int) -> None:
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD_SIZE, timeout=timedelta(seconds=60))
    try:
        for tp, ep in LAYOUTS:
            dims = ParallelDims(WORLD_SIZE, tp=tp, ep=ep)
            groups = build_process_groups(dims, rank)
            for kind in GROUP_KINDS:
                ranks = getattr(groups, f"{kind}_ranks")
                assert ranks == getattr(dims.groups_of(rank), kind)
                _check_group(kind, getattr(groups, kind), ranks, rank)
            # Identical rank lists share one group; a world-sized one is WORLD itself.
            if dims.ep == 1:
                assert groups.edp is groups.dp
            if dims.dp == WORLD_SIZE:
                assert groups.dp is dist.group.WORLD
            assert all(g is not dist.group.WORLD for g in groups.created)
            destroy_process_groups(groups)
            assert groups.created == []
        dist.barrier()
    finally:
        dist.destroy_process_group()


def test_process_groups_all_reduce_over_gloo() -> None:
    port = _free_port()
    context = mp.start_processes(_worker, args=(port,), nprocs=WORLD_SIZE, join=False, start_method="spawn")
    deadline = time.monotonic() + 120
    try:
        while not context.join(timeout=1):  # raises ProcessRaisedException on a worker failure
            if time.monotonic() > deadline:
                pytest.fail("gloo workers did not finish within 120 s (likely a collective hang)")
    finally:
        for process in context.processes:
            if process.is_alive():
                process.kill()
                process.join()


def test_world1_groups_are_all_world(tmp_path) -> None:
    if dist.is_initialized():
        pytest.skip("a default process group already exists in this process")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        groups = build_process_groups(ParallelDims(1), 0)
        assert all(getattr(groups, kind) is dist.group.WORLD for kind in GROUP_KINDS)
        assert groups.created == []
        with pytest.raises(ValueError, match=r"world_size=2 but torch.distributed has world_size=1"):
            build_process_groups(ParallelDims(2), 0)
        with pytest.raises(ValueError, match=r"rank=3 but torch.distributed reports rank 0"):
            build_process_groups(ParallelDims(1), 3)
        destroy_process_groups(groups)
    finally:
        dist.destroy_process_group()
