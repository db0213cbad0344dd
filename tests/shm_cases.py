"""Cases for tests/test_shm_transport.py, run on gloo ranks (tests/distributed.py)."""

from __future__ import annotations

import os

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


def exposed_collectives(rank: int, world: int, exposed_on: str) -> dict:
    """Reduce-scatters and all-gathers whose inputs lie in exposed regions (read in place by the other
    ranks), on every rank or only on some (then all of them copy through the slots), against the ordered
    pairwise transport; several in flight, waited out of order, with chunked all-reduces in between."""
    from rayzero.comm import OrderedTransport
    from rayzero.comm.shm import ShmTransport

    shm = ShmTransport(None, rank, world, chunk_bytes=4096)
    ref = OrderedTransport(None, rank, world)
    region = shm.expose_region(1 << 20)
    expose = exposed_on == "all" or (exposed_on == "rank0" and rank == 0)
    g = torch.Generator().manual_seed(200 + rank)
    out, paths = {}, []
    for dtype in (torch.float32, torch.bfloat16):
        for cols in (1, 7, 1000, 20_000):
            rows = torch.randn(world, cols, generator=g).to(dtype)
            mine = torch.randn(cols, generator=g).to(dtype)
            flat = torch.randn(5, generator=g).to(dtype)
            results = []
            for t in (shm, ref):
                if t is shm and expose:
                    rows_in, mine_in = region.alloc(rows.numel(), dtype).view(world, cols), region.alloc(cols, dtype)
                    rows_in.copy_(rows)
                    mine_in.copy_(mine)
                else:
                    rows_in, mine_in = rows.clone(), mine.clone()
                rs = torch.empty(cols, dtype=dtype)
                ag = torch.empty(world, cols, dtype=dtype)
                ar = flat.clone()
                before = shm._chunk
                handles = [t.reduce_scatter(rs, rows_in), t.all_reduce(ar), t.all_gather(ag, mine_in)]
                for h in reversed(handles):
                    h.wait()
                if t is shm:
                    paths.append(shm._chunk - before)  # chunks through the slots (the all-reduce's at least)
                    if expose:
                        region.free(rows_in.view(-1))
                        region.free(mine_in)
                results.append((rs, ag, ar))
            out[(str(dtype), cols)] = results
    shm.close()
    return {"results": out, "chunks": paths, "region": region is not None}


def exposed_region_reuse(rank: int, world: int) -> dict:
    """A freed exposed buffer is handed out again only after every rank has read the collective that exposed
    it: rank 1 sleeps before reading, and rank 0's next allocation of the same bytes waits for it."""
    import time

    from rayzero.comm.shm import ShmTransport

    shm = ShmTransport(None, rank, world)
    region = shm.expose_region(world * 4096 * 4)  # room for one buffer only
    rows = region.alloc(world * 4096, torch.float32).view(world, 4096)
    rows.fill_(float(rank + 1))
    out = torch.empty(4096)
    h = shm.reduce_scatter(out, rows)
    if rank == 1:
        time.sleep(1.0)
    h.wait()
    region.free(rows.view(-1))
    start = time.monotonic()
    again = region.alloc(world * 4096, torch.float32)
    waited = time.monotonic() - start
    again.fill_(-1.0)  # would corrupt rank 1's sum had rank 1 not read yet
    shm.barrier()
    too_big = region.alloc(world * 4096 + 1, torch.float32)
    return {"sum": out, "waited": waited, "same": again.data_ptr() == rows.data_ptr(), "too_big": too_big}


def shared_tensor_case(rank: int, world: int) -> dict:
    """A shared tensor is the same memory on every rank: each rank writes its own row, and after a barrier
    every rank reads all of them."""
    from rayzero.comm.shm import ShmTransport

    shm = ShmTransport(None, rank, world)
    t = shm.shared_tensor(world * 3, torch.float32)
    t.view(world, 3)[rank].fill_(float(rank + 10))
    shm.barrier()
    return {"seen": t.clone()}


def engine_on_one_host(rank: int, world: int, stage: int, dtype: str, share: bool | None = None) -> dict:
    """An engine whose ranks share a host: stages 1-2 keep one copy of the weights that every rank maps,
    stage 3 too where ``zero_optimization.stage3_share_weights`` (``share``) says so, else gathers from
    masters the other ranks read in place.  Returns what it trained, how it held memory, and (shared
    weights) whether a write by rank 0 reaches rank 1 before and (stages 1-2) after ``destroy``."""
    import torch.distributed as dist

    import rayzero

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 64),
                                torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 64))
    zero = {"stage": stage, "reduce_bucket_size": 20_000, "allgather_bucket_size": 20_000}
    if stage == 3:
        zero["stage3_param_persistence_threshold"] = 0  # every parameter is gathered (or shared)
        if share is not None:
            zero["stage3_share_weights"] = share
    cfg = {"train_batch_size": 4 * world, "zero_optimization": zero, "gradient_clipping": 1.0,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}}}
    if dtype == "bf16":
        cfg["bf16"] = {"enabled": True}
    engine = rayzero.initialize(model, cfg)
    transport = engine.partitions.groups[0].comm.transport
    g = torch.Generator().manual_seed(1)
    losses, chunks = [], []
    for _ in range(3):
        x = torch.randn(4 * world, 64, generator=g)[rank * 4 : rank * 4 + 4]
        before = getattr(transport, "_chunk", 0)
        loss = engine(x).float().pow(2).mean()
        engine.backward(loss)
        engine.step()
        chunks.append(getattr(transport, "_chunk", 0) - before)
        losses.append(loss.item())
    out = {"losses": losses, "weights": engine.full_state_dict(), "chunks": chunks,
           "transport": type(transport).__name__, "shares": engine.publisher.shares_weights}
    regions = getattr(transport, "_regions", [])
    out["sources_exposed"] = [any(r.offset_of(grp.weight_source) is not None for r in regions)
                              for grp in engine.partitions.groups]
    first = next(engine.module.parameters())

    def seen_after_rank0_writes(value: float) -> float:
        dist.barrier()
        if rank == 0:
            with torch.no_grad():
                first.view(-1)[0] = value
        dist.barrier()
        return first.view(-1)[0].item()

    if stage == 3:
        out["units"] = len(engine.gatherer.units)
        if engine.publisher.shares_weights:
            out["seen_shared"] = seen_after_rank0_writes(1024.0)
        engine.destroy()
        out["destroyed_left_stand_ins"] = all(p.numel() == 0 or p.untyped_storage().nbytes() <= 4
                                             for p in engine.module.parameters())
    else:
        out["seen_shared"] = seen_after_rank0_writes(1024.0)
        engine.destroy()
        out["seen_after_destroy"] = seen_after_rank0_writes(2048.0)
        out["still_trains"] = bool(torch.isfinite(engine.module(torch.ones(2, 64, dtype=first.dtype))).all())
    return out


def stage3_share_choice(rank: int, world: int, layers: int, dtype: str, prefetch: int | None) -> dict:
    """Whether a stage-3 engine on one host chose to share its weights (``stage3_share_weights`` unset),
    for ``layers`` equal 64x64 leaf units, and the losses of two steps."""
    import rayzero

    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(64, 64, bias=False) for _ in range(layers)])
    zero = {"stage": 3, "stage3_param_persistence_threshold": 0}
    if prefetch is not None:
        zero["stage3_prefetch_bucket_size"] = prefetch
    cfg = {"train_batch_size": 4 * world, "zero_optimization": zero,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}}}
    if dtype == "bf16":
        cfg["bf16"] = {"enabled": True}
    engine = rayzero.initialize(model, cfg)
    out = {"shares": engine.publisher.shares_weights, "units": len(engine.gatherer.units), "losses": []}
    g = torch.Generator().manual_seed(1)
    for _ in range(2):
        x = torch.randn(4 * world, 64, generator=g)[rank * 4 : rank * 4 + 4]
        loss = engine(x).float().pow(2).mean()
        engine.backward(loss)
        engine.step()
        out["losses"].append(loss.item())
    engine.destroy()
    return out


def aliased_masters(rank: int, world: int, stage: int, ckpt_dir: str) -> dict:
    """Stages 1-2 in fp32 on one host: a large parameter's master is the rank's row of the weights the ranks
    share, so the optimizer updates the model in place.  Trains three steps of two micro-batches, saves,
    trains one more, loads the save back; returns the losses, weights, which masters alias the shared
    weights, and the model's output right after the save and right after the load."""
    import rayzero

    torch.manual_seed(0)
    # 512 x 512 = 131,072 elements a rank: its own partition group, aliased; the others are small
    model = torch.nn.Sequential(torch.nn.Linear(64, 512), torch.nn.GELU(), torch.nn.Linear(512, 512),
                                torch.nn.GELU(), torch.nn.Linear(512, 64))
    cfg = {"train_batch_size": 8 * world, "train_micro_batch_size_per_gpu": 4, "gradient_clipping": 0.0,
           "zero_optimization": {"stage": stage}, "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}}}
    engine = rayzero.initialize(model, cfg)
    g = torch.Generator().manual_seed(1)
    probe = torch.randn(3, 64, generator=g)
    losses, norms = [], []

    def train_step() -> None:
        for _ in range(2):
            x = torch.randn(4 * world, 64, generator=g)[rank * 4 : rank * 4 + 4]
            loss = engine(x).pow(2).mean()
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
        norms.append(engine.global_grad_norm)

    for _ in range(3):
        train_step()
    aliased = []
    for grp in engine.partitions.groups:
        if len(grp.params) == 1:
            p, e = grp.params[0], grp.layout.entries[0]
            aliased.append(grp.master.data_ptr() == p.data_ptr() + grp.rank * e.chunk * p.element_size())
    out = {"groups": len(engine.partitions.groups), "aliased": aliased, "shares": engine.publisher.shares_weights}
    engine.save_checkpoint(ckpt_dir, tag="t3")
    with torch.no_grad():
        out["saved_output"] = engine.module(probe)
    out["weights"] = engine.full_state_dict()
    train_step()
    with torch.no_grad():
        out["moved_output"] = engine.module(probe)
    engine.load_checkpoint(ckpt_dir, tag="t3")
    with torch.no_grad():
        out["loaded_output"] = engine.module(probe)
    out["loaded_weights"] = engine.full_state_dict()
    train_step()  # training goes on from the loaded state
    out["losses"], out["norms"] = losses, norms
    engine.destroy()
    return out


def own_row_apart(rank: int, world: int, exposed_on: str) -> dict:
    """Reduce-scatters given this rank's own row apart from ``rows`` (whose own row holds garbage), through
    the shared-memory transport with rows exposed on every rank or only on some (then through the slots),
    and through a gloo communicator (which copies the row in): each against the ordered pairwise transport
    given the whole rows."""
    from rayzero.comm import Communicator, OrderedTransport
    from rayzero.comm.shm import ShmTransport

    shm = ShmTransport(None, rank, world, chunk_bytes=4096)
    gloo = Communicator.for_group(None, transport="pairwise")
    ref = OrderedTransport(None, rank, world)
    region = shm.expose_region(1 << 20)
    expose = exposed_on == "all" or (exposed_on == "rank0" and rank == 0)
    g = torch.Generator().manual_seed(300 + rank)
    out = {}
    for cols in (7, 20_000):
        rows = torch.randn(world, cols, generator=g)
        own = torch.randn(cols, generator=g)
        whole = rows.clone()
        whole[rank] = own
        expected = torch.empty(cols)
        ref.reduce_scatter(expected, whole).wait()
        if expose:
            rows_in = region.alloc(rows.numel(), torch.float32).view(world, cols)
            rows_in.copy_(rows)
        else:
            rows_in = rows.clone()
        rows_in[rank].fill_(float("nan"))  # never read
        got = torch.empty(cols)
        shm.reduce_scatter(got, rows_in, own=own).wait()
        if expose:
            region.free(rows_in.view(-1))
        via_gloo, gloo_rows = torch.empty(cols), rows.clone()
        gloo_rows[rank].fill_(float("nan"))
        gloo.reduce_scatter(via_gloo, gloo_rows, own=own).wait()
        out[cols] = (torch.equal(got, expected), torch.equal(via_gloo, expected))
    shm.close()
    return out


def on_both_transports(rank: int, world: int, fn, cases: list) -> dict:
    """``fn(rank, world, *case)`` for every case, once on shared memory and once over gloo, in one spawn of the
    ranks (``RAYZERO_SHM`` is read when a group is made): ``{(shm, case): result}``, shm "1" or "0"."""
    out = {}
    for shm in ("1", "0"):
        os.environ["RAYZERO_SHM"] = shm
        for case in cases:
            out[(shm, tuple(case))] = fn(rank, world, *case)
    return out
