"""The swap traffic of a training step (issue 27), for bench_offload.py and bench_zero.py --memory: the swap stores
an engine holds, their byte counters, and the floor the disk's raw O_DIRECT speed sets (bench_swap.py measures
the disk).  Standard library only, so a rank that imports it loads nothing else (bench_zero --memory measures
the ranks' memory)."""

from __future__ import annotations

import concurrent.futures
import sys


def swap_stores(engine) -> list:
    """Every swap store the engine reaches, once each: the optimizer's swap, stage 3's parameter swap and any
    other (gradients, say), found by walking rayzero's own objects from the engine (their attributes, and the
    lists, tuples and dicts among them), so a store the engine gains later is counted without changing the
    bench.  torch objects (modules, tensors, optimizers) are not entered.  Without rayzero's swap store module
    loaded there is no store, and nothing is imported to find that out."""
    module = sys.modules.get("rayzero.offload.swap_store")
    if module is None:
        return []
    found: dict[int, object] = {}
    seen: set[int] = set()
    todo = [(engine, 0)]
    while todo:
        obj, depth = todo.pop(0)
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        if isinstance(obj, module.SwapStore):
            found[id(obj)] = obj
            continue
        if depth >= 6:
            continue
        if isinstance(obj, (list, tuple, set, frozenset)):
            children = list(obj)
        elif isinstance(obj, dict):
            children = list(obj.values())
        elif type(obj).__module__.split(".")[0] == "rayzero" and hasattr(obj, "__dict__"):
            children = list(vars(obj).values())
        else:
            continue
        todo.extend((c, depth + 1) for c in children)
    return list(found.values())


IO_KEYS = ("bytes_read", "bytes_written", "read_seconds", "write_seconds")


def io_counters(stores: list) -> dict:
    """The swap stores' byte counters and I/O seconds (SwapStore.stats), summed over the stores."""
    return {k: sum(st.stats[k] for st in stores) for k in IO_KEYS}


def settle(stores: list) -> None:
    """Wait until every read and write the stores have in flight is done, so their counters hold all of it (a
    step's last writes finish during the next step).  A store runs an op on a key after the earlier ones on it,
    so waiting for the last op of each key waits for them all."""
    for st in stores:
        with st._lock:
            pending = list(st._tail.values())
        concurrent.futures.wait(pending)


def io_floor_s(bytes_read: float, bytes_written: float, disk: dict) -> float:
    """Seconds the disk needs at its raw O_DIRECT speed for these bytes: reads at dd's read rate, writes at its
    rewrite-in-place rate (the swap files are rewritten in place every step)."""
    return bytes_read / (disk["read_gbs"] * 1e9) + bytes_written / (disk["rewrite_gbs"] * 1e9)


def add_disk_ratio(result: dict, disk: dict | None) -> None:
    """A row with swap traffic against the disk: the I/O floor (every rank's swap bytes per step at the disk's
    raw O_DIRECT speed, measured with one dd stream per rank) and floor / step time (1.0: the step is as fast
    as the disk allows)."""
    if disk is None or result.get("status") != "ok" or "bytes_read_ranks" not in result:
        return
    result["io_floor_s"] = io_floor_s(result["bytes_read_ranks"], result["bytes_written_ranks"], disk)
    result["floor_over_step"] = result["io_floor_s"] / (result["median_step_ms"] / 1000)
