"""Cases for tests/test_memory_model.py, run on gloo ranks (tests/distributed.py): an engine trains one step
and reports the bytes of its real tensors, its bucket sizes and its stage-3 gathers."""

from __future__ import annotations

import torch
import torch.nn.functional as F

import rayzero


class Block(torch.nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.up = torch.nn.Linear(dim, hidden)
        self.down = torch.nn.Linear(hidden, dim)

    def forward(self, x):
        return x + self.down(torch.tanh(self.up(x)))


class Net(torch.nn.Module):
    """Every size even, so a world of 2 pads nothing; four repeated blocks (stage 3's gather units)."""

    def __init__(self, dim: int = 16, hidden: int = 48, blocks: int = 4):
        super().__init__()
        self.inp = torch.nn.Linear(8, dim, bias=False)
        self.blocks = torch.nn.Sequential(*[Block(dim, hidden) for _ in range(blocks)])
        self.out = torch.nn.Linear(dim, 4, bias=False)

    def forward(self, x):
        return self.out(self.blocks(self.inp(x)))


def config(stage: int, dtype: str = "fp32", **zero) -> dict:
    cfg = {
        "train_batch_size": 8,
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 20, **zero},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
    }
    if dtype != "fp32":
        cfg[dtype] = {"enabled": True}
    return cfg


def _bytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def engine_tensors(rank: int, world: int, cfg: dict) -> dict:
    """One step, then the bytes of the engine's tensors by kind (each storage counted once), and what the
    engine uses for buckets and gathers (the peak of stage 3's gathered storages over the step)."""
    torch.manual_seed(0)
    model = Net()
    engine = rayzero.initialize(model, cfg)
    gatherer = engine.gatherer
    peak = [0]
    if gatherer is not None:
        gather = gatherer.gather

        def counted(unit, direction=0):
            gather(unit, direction)
            # the parameters' own storages, and the receive buffers of packed gathers still in flight
            held = sum(s.nbytes() for s in gatherer._storage.values())
            held += sum(_bytes(rows) for launched in gatherer.inflight.values()
                        for _, rows, _, col_of in launched if col_of is not None)
            peak[0] = max(peak[0], held)

        gatherer.gather = counted
    g = torch.Generator().manual_seed(1)
    for _ in range(2):  # the first step records stage 3's order; the second prefetches by it
        x, y = torch.randn(8, 8, generator=g), torch.randn(8, 4, generator=g)
        xs, ys = x[rank * 4 : (rank + 1) * 4], y[rank * 4 : (rank + 1) * 4]
        engine.backward(F.mse_loss(engine(xs).float(), ys))
        engine.step()

    covered: dict[int, list[tuple[int, int]]] = {}  # storage -> byte ranges counted already

    def once(t: torch.Tensor) -> int:
        """The bytes of ``t`` not counted yet (a view of a counted tensor, e.g. stage 0's fp32 parameters
        in the master, adds nothing)."""
        if t.numel() == 0 or t.untyped_storage().nbytes() == 0:
            return 0
        start = t.storage_offset() * t.element_size()
        end = start + _bytes(t)
        ranges = covered.setdefault(t.untyped_storage().data_ptr(), [])
        new = end - start - sum(max(0, min(end, e) - max(start, s)) for s, e in ranges)
        ranges.append((start, end))
        return new

    parts = engine.partitions.groups
    master = sum(once(gp.master) for gp in parts)  # (stage 0 in fp32: the parameters are views of it)
    grads = sum(once(gp.grad) for gp in parts)
    if engine.stage == 1:  # the whole local gradient buffer
        grads += sum(once(b.rows) for b in engine.reducer.buckets)
    optimizer = sum(once(v) for st in engine.optimizer.state.values() for v in st.values()
                    if torch.is_tensor(v) and v.dim() > 0)
    weights = sum(once(gp.weights) for gp in parts if gp.weights is not None)
    weights += sum(once(p.data) for p in model.parameters())  # (stage 3: only the persistent ones are whole)
    out = {
        "weights": weights, "master": master, "grads": grads, "optimizer": optimizer,
        "reduce_bucket_size": engine.buckets.reduce_bucket_size,
        "allgather_bucket_size": engine.buckets.allgather_bucket_size,
        "largest_reduce_bucket": max(b.group.world * b.cols for b in engine.reducer.buckets),
        "max_inflight": engine.reducer.max_inflight,
    }
    if gatherer is not None:
        out.update(units=sorted(u.numel for u in gatherer.units), prefetch_elements=gatherer.prefetch_elements,
                   gathered_peak=peak[0], max_ahead=gatherer.max_ahead)
    engine.destroy()
    return out


def _status_mib(field: str) -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    raise KeyError(field)


def _mallinfo2():
    import ctypes

    class Mallinfo2(ctypes.Structure):
        _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                   "fsmblks", "uordblks", "fordblks", "keepcost")]

    mallinfo2 = ctypes.CDLL(None).mallinfo2
    mallinfo2.restype = Mallinfo2
    return mallinfo2()


def _malloc_held_mib() -> float:
    """MiB glibc's malloc has handed out and not had back: blocks in use in its heaps plus its own mappings
    (``mallinfo2``: ``uordblks + hblkhd``); free blocks the heap keeps are not in it."""
    info = _mallinfo2()
    return (info.uordblks + info.hblkhd) / 2**20


def _heap_free_mib() -> float:
    """MiB of free blocks glibc's heaps keep (``mallinfo2().fordblks``)."""
    return _mallinfo2().fordblks / 2**20


def peak_rss_over_baseline(rank: int, world: int, zero: dict, dim: int, hidden: int, blocks: int,
                           steps: int = 3) -> dict:
    """Peak RSS (VmHWM) of one rank over its own warm baseline, set-up included: the model built under
    ``zero_init``, ``initialize``, and ``steps`` steps, with the config's defaults besides ``zero``; in the
    environment a user has (the test clears glibc's MALLOC_* variables)."""
    import ctypes

    import torch.distributed as dist

    torch.set_num_threads(1)
    warm = torch.nn.Linear(4, 4)  # what every run pays before its model exists: autograd and fused AdamW
    opt = torch.optim.AdamW(warm.parameters(), fused=True)
    warm(torch.randn(2, 4)).sum().backward()
    opt.step()
    del warm, opt
    ctypes.CDLL(None).malloc_trim(0)
    dist.barrier()
    baseline = _status_mib("VmRSS")
    anon0, held0 = _status_mib("RssAnon"), _malloc_held_mib()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # VmHWM starts again from the current RSS
    cfg = {"train_batch_size": 4 * world, "train_micro_batch_size_per_gpu": 4,
           "zero_optimization": {"stage": 3, **zero}, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}
    with rayzero.zero_init(config=cfg):
        model = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(dim, hidden), torch.nn.GELU(),
                                                          torch.nn.Linear(hidden, dim)) for _ in range(blocks)])
    engine = rayzero.initialize(model, cfg)
    # after set-up: the anonymous memory it added, and how much of that the allocator's live blocks explain
    setup = {"anon_mib": _status_mib("RssAnon") - anon0, "held_mib": _malloc_held_mib() - held0}
    g = torch.Generator().manual_seed(rank)
    heap_free = []  # after each step
    for _ in range(steps):
        x = torch.randn(4, dim, generator=g)
        loss = F.mse_loss(engine(x), x)
        engine.backward(loss)
        engine.step()
        heap_free.append(_heap_free_mib())
    out = {"peak_mib": _status_mib("VmHWM") - baseline, "policy": (engine.host_allocator or {}).get("policy"),
           "setup": setup, "heap_free_mib": heap_free}
    engine.destroy()
    return out
