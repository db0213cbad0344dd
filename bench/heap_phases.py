"""Where a ZeRO-3 rank's memory is, phase by phase: the resident set split into anonymous and shared memory,
and glibc's heap split into blocks handed out and blocks it keeps free (issue 27's attribution).

The bench model of bench_zero.py (33.6M parameters) under ``rayzero.zero_init``, ZeRO-3 with the config's
defaults, ``--world`` gloo ranks on this host, the environment as it is (run it with no ``MALLOC_*``
variables for what a user has).  Each rank takes its baseline as bench_zero.py ``--memory`` does (runtime
warm, before the model exists) and prints, after ``zero_init``, after ``initialize`` and after every step:

- rss / hwm: VmRSS, and VmHWM since the previous line (reset at each line), MiB over the baseline;
- anon / shmem: RssAnon and RssShmem over the baseline (shmem: the weights the host's ranks share, the
  transport's segment and the gradient buckets);
- heap, used, free, top: glibc's main heap and the other arenas (``mallinfo2``: arena, uordblks, fordblks,
  keepcost), absolute MiB; mmap: its own mappings (hblkhd; the model states above 32 MiB each);

then each rank's minor page faults and main-thread CPU time per step (median of the steps after the first two).

    python bench/heap_phases.py --world 3            # ~1 min on 2 cores
    python bench/heap_phases.py --world 4 --steps 12 --ranks all
    python bench/heap_phases.py --world 3 --trace-step 3   # and rank 0's allocations of 1 MiB or more in step 3
    GLIBC_TUNABLES=glibc.malloc.tcache_count=0:glibc.malloc.mxfast=0 python bench/heap_phases.py --world 3

See bench/README.md, "Where the excess over the model is".
"""

from __future__ import annotations

import argparse
import ctypes
import os
import pickle
import resource
import statistics
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.dirname(HERE)]

import bench_zero as bz  # noqa: E402
from spawn_ranks import free_port, spawn  # noqa: E402

MIB = 1 << 20


class Mallinfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                               "fsmblks", "uordblks", "fordblks", "keepcost")]


def _status() -> dict:
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            key = line.split(":")[0]
            if key in ("VmRSS", "VmHWM", "RssAnon", "RssShmem"):
                out[key] = int(line.split()[1]) / 1024
    return out


def _mallinfo() -> Mallinfo2:
    fn = ctypes.CDLL(None).mallinfo2
    fn.restype = Mallinfo2
    return fn()


def _line(tag: str, base: dict) -> dict:
    st, mi = _status(), _mallinfo()
    bz.reset_hwm()
    return dict(tag=tag, rss=st["VmRSS"] - base["VmRSS"], hwm=st["VmHWM"] - base["VmRSS"],
                anon=st["RssAnon"] - base["RssAnon"], shmem=st["RssShmem"] - base["RssShmem"],
                heap=mi.arena / MIB, used=mi.uordblks / MIB, free=mi.fordblks / MIB, top=mi.keepcost / MIB,
                mmap=mi.hblkhd / MIB)


def _large_allocations(prof, least: int = MIB) -> list[dict]:
    """torch's CPU allocations and frees of at least ``least`` bytes in a profiler trace, in time order."""
    import json
    import tempfile

    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        prof.export_chrome_trace(f.name)
        events = json.load(open(f.name))["traceEvents"]
    mem = sorted((e for e in events if e.get("name") == "[memory]" and abs(e["args"]["Bytes"]) >= least),
                 key=lambda e: e["ts"])
    return [dict(bytes=e["args"]["Bytes"], addr=e["args"]["Addr"], live=e["args"]["Total Allocated"]) for e in mem]


def rank_main(rank: int, world: int, port: int, steps: int, trace_step: int, queue) -> None:
    import torch.distributed as dist

    import rayzero

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world)
        a = bz.parse_args(["--memory", "--world", str(world)])
        bz.warm_runtime("rayzero")
        dist.barrier()
        base = _status()
        bz.reset_hwm()
        mi = _mallinfo()
        lines = [dict(tag="baseline (absolute heap)", rss=0, hwm=0, anon=0, shmem=0, heap=mi.arena / MIB,
                      used=mi.uordblks / MIB, free=mi.fordblks / MIB, top=mi.keepcost / MIB, mmap=mi.hblkhd / MIB)]
        cfg = bz.zero_config(a, world, 3, defaults=True)
        with rayzero.zero_init(config=cfg):
            model = bz.build_model(a.dim, a.hidden, a.blocks)
        lines.append(_line("zero_init", base))
        engine = rayzero.initialize(model, cfg)
        lines.append(_line("initialize", base))
        data = bz.make_batches(steps, world, a.micro, a.dim)
        lo, hi = rank * a.micro, (rank + 1) * a.micro
        faults, cpu, trace = [], [], None
        for i, (x, y) in enumerate(data):
            prof = None
            if rank == 0 and i == trace_step:
                prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True)
                prof.__enter__()
            f0, c0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt, time.thread_time()
            loss = torch.nn.functional.mse_loss(engine(x[lo:hi]), y[lo:hi])
            engine.backward(loss)
            engine.step()
            cpu.append(time.thread_time() - c0)
            faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0)
            if prof is not None:
                prof.__exit__(None, None, None)
                trace = _large_allocations(prof)
            lines.append(_line(f"step {i}", base))
        engine.destroy()
        queue.put((rank, "ok", pickle.dumps(dict(lines=lines, faults=faults, cpu=cpu, trace=trace))))
    except BaseException:
        import traceback

        queue.put((rank, "error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--world", type=int, default=3)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--ranks", default="peak", help="'peak' (the rank with the highest VmHWM) or 'all'")
    p.add_argument("--trace-step", type=int, default=None,
                   help="also list rank 0's torch CPU allocations of 1 MiB or more in this step (torch.profiler)")
    a = p.parse_args(argv)
    port = free_port()
    trace_step = -1 if a.trace_step is None else a.trace_step
    ranks, error = spawn(rank_main, lambda r: (r, a.world, port, a.steps, trace_step), a.world, 600.0)
    if error:
        print(error, file=sys.stderr)
        return 1
    peak_of = [max(x["hwm"] for x in r["lines"]) for r in ranks]
    shown = range(len(ranks)) if a.ranks == "all" else [peak_of.index(max(peak_of))]
    env = ", ".join(f"{k}={v}" for k, v in sorted(os.environ.items()) if k.startswith(("MALLOC_", "GLIBC_TUNABLES")))
    print(f"world {a.world}, {a.steps} steps; environment: {env or 'no MALLOC_* / GLIBC_TUNABLES'}")
    for r in shown:
        print(f"\nrank {r}: peak {peak_of[r]:.0f} MiB over its baseline")
        print("| phase | rss | hwm | anon | shmem | heap | used | free | top | mmap |")
        print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
        for x in ranks[r]["lines"]:
            print(f"| {x['tag']} | " + " | ".join(f"{x[k]:.0f}" for k in
                                                  ("rss", "hwm", "anon", "shmem", "heap", "used", "free", "top", "mmap")) + " |")
    print()
    for r, res in enumerate(ranks):
        later = slice(2, None) if a.steps > 3 else slice(None)
        print(f"rank {r}: {statistics.median(res['faults'][later]):.0f} minor faults and "
              f"{statistics.median(res['cpu'][later]) * 1000:.1f} ms main-thread CPU per step")
    if ranks[0]["trace"] is not None:
        trace = ranks[0]["trace"]
        print(f"\nrank 0, step {a.trace_step}: torch CPU allocations (+) and frees (-) of 1 MiB or more")
        for e in trace:
            print(f"  {e['bytes'] / MIB:+8.2f} MiB at {e['addr']:#x}, {e['live'] / MIB:6.2f} MiB of tensors live")
        sizes = sorted({e["bytes"] for e in trace if e["bytes"] > 0})
        for n in sizes:
            addrs = {e["addr"] for e in trace if e["bytes"] == n}
            count = sum(1 for e in trace if e["bytes"] == n)
            print(f"  {count} allocations of {n / MIB:.2f} MiB at {len(addrs)} different addresses")
    print(f"\nlargest rank's peak: {max(peak_of):.0f} MiB over its baseline")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
