"""Cases for tests/test_shm_transport.py, run on gloo ranks (tests/distributed.py)."""

from __future__ import annotations

import torch


def collectives(rank: int, world: int, chunk_bytes: int) -> dict:
    """The same reduce-scatters, all-gathers and all-reduces through the shared-memory transport and the
    ordered pairwise one, several in flight at once and waited out of issue order."""
    from rayzero.comm import OrderedTransport
    from rayzero.comm.shm import ShmTransport

    shm = ShmTransport(None, rank, world, chunk_bytes=chunk_bytes)
    ref = OrderedTransport(None, rank, world)  # pairwise reduce-scatter, all-reduce summed in rank order
    g = torch.Generator().manual_seed(100 + rank)
    out = {}
    for dtype in (torch.float32, torch.bfloat16):
        for cols in (1, 7, 1000, 40_000):
            rows = torch.randn(world, cols, generator=g).to(dtype)
            mine = torch.randn(cols, generator=g).to(dtype)
            flat = torch.randn(3, cols, generator=g).to(dtype)
            results = []
            for t in (shm, ref):
                rs = torch.empty(cols, dtype=dtype)
                ag = torch.empty(world, cols, dtype=dtype)
                ar = flat.clone()
                handles = [t.reduce_scatter(rs, rows.clone()), t.all_gather(ag, mine), t.all_reduce(ar)]
                for h in reversed(handles):  # out of order: each runs after the ones issued before it
                    h.wait()
                results.append((rs, ag, ar))
            out[(str(dtype), cols)] = results
    shm.close()
    return out


def no_segment_left(rank: int, world: int) -> dict:
    """After the first collective set the segment up, its name is gone from /dev/shm while it is in use."""
    import os

    from rayzero.comm.shm import ShmTransport

    before = {n for n in os.listdir("/dev/shm") if n.startswith("rayzero-shm-")}
    shm = ShmTransport(None, rank, world)
    t = torch.full((5,), float(rank))
    shm.all_reduce(t).wait()
    during = {n for n in os.listdir("/dev/shm") if n.startswith("rayzero-shm-")} - before
    return {"sum": t, "during": sorted(during), "mapped": shm._seg is not None}


def a_rank_stops_answering(rank: int, world: int) -> dict:
    """Rank 1 sets the segment up, then never joins the next collective: rank 0's wait times out with an
    error that names it, instead of hanging."""
    import time

    from rayzero.comm.shm import CollectiveTimeout, ShmTransport

    shm = ShmTransport(None, rank, world, timeout_s=2.0)
    shm.all_reduce(torch.ones(3)).wait()
    if rank == 1:
        return {"error": None}
    start = time.monotonic()
    try:
        shm.all_reduce(torch.ones(3)).wait()
        return {"error": None}
    except CollectiveTimeout as e:
        return {"error": str(e), "waited": time.monotonic() - start}


def transport_kinds(rank: int, world: int) -> dict:
    from rayzero.comm import Communicator

    auto = Communicator.for_group(None).transport
    ordered = Communicator.for_group(None, transport="ordered").transport
    return {"auto": type(auto).__name__, "ordered": type(ordered).__name__,
            "ordered_flag": getattr(ordered, "ordered", None)}


def too_big_for_dev_shm(rank: int, world: int) -> dict:
    """A segment larger than /dev/shm's free space: every rank falls back to gloo, and the sum is right."""
    import os

    from rayzero.comm.shm import ShmTransport

    st = os.statvfs("/dev/shm")
    shm = ShmTransport(None, rank, world, chunk_bytes=st.f_bavail * st.f_frsize)
    t = torch.full((4,), float(rank + 1))
    shm.all_reduce(t).wait()
    return {"sum": t, "shm": shm._local}
