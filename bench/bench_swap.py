"""Write and read throughput of rayzero's NVMe swap store against raw O_DIRECT dd on the same directory.

    .venv/bin/python bench/bench_swap.py --size-mb 512
    .venv/bin/python bench/bench_swap.py --size-mb 2048 --dir /mnt/nvme --repeat 7

Each repeat runs dd and every SwapStore configuration on one fp32 tensor of --size-mb MiB, in an order
rotated from repeat to repeat (a shared disk's speed drifts); the table shows the median over repeats.
Per system: write to a new file (dd truncates its output; the store's key is removed first, so both
allocate disk blocks), read it back, then rewrite it in place (dd conv=notrunc; the store's steady state,
the same key every step). With O_DIRECT the page cache is bypassed, so nothing needs dropping between runs.

A second table writes while the calling thread runs pure Python: a worker thread needs the GIL back after
each syscall, which it waits for up to sys.getswitchinterval(), so it shows what the syscall size
(queue_depth x block_size for direct I/O) does to I/O that overlaps Python work.
"""

from __future__ import annotations

import argparse
import os
import platform
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from rayzero.offload.swap_store import SwapStore, aligned_empty  # noqa: E402

MIB = 1 << 20
DD = "dd (O_DIRECT, bs=1M)"


def dd_seconds(args: list[str]) -> float:
    """Run dd and return the seconds it reports ("N bytes (...) copied, T s, R GB/s" on stderr)."""
    proc = subprocess.run(["dd", *args], capture_output=True, text=True, check=True)
    m = re.search(r"(\d+) bytes .*copied, ([0-9.e+-]+) s", proc.stderr)
    if not m:
        raise RuntimeError(f"cannot parse dd output: {proc.stderr!r}")
    return float(m.group(2))


def fs_type(path: str) -> str:
    best, kind = "", "?"
    with open("/proc/mounts") as f:
        for line in f:
            _dev, mnt, typ, *_ = line.split()
            if (path == mnt or path.startswith(mnt.rstrip("/") + "/")) and len(mnt) > len(best):
                best, kind = mnt, typ
    return f"{kind} on {best}"


def _dd_args(ddfile: str, size_mb: int, bs_mb: int = 1) -> tuple[list[str], list[str], list[str]]:
    """dd's arguments for a direct write to a new file, a direct read of it, and a direct rewrite in place."""
    w = ["if=/dev/zero", f"of={ddfile}", f"bs={bs_mb}M", f"count={size_mb // bs_mb}", "oflag=direct"]
    return w, [f"if={ddfile}", "of=/dev/null", f"bs={bs_mb}M", "iflag=direct"], [*w, "conv=notrunc"]


def run_dd(ddfile: str, size_mb: int, bs_mb: int = 1) -> tuple[float, float, float]:
    return tuple(dd_seconds(args) for args in _dd_args(ddfile, size_mb, bs_mb))


def dd_parallel_seconds(arg_lists: list[list[str]]) -> list[float]:
    """Start one dd per argument list at once and return the seconds each reports."""
    procs = [subprocess.Popen(["dd", *args], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
             for args in arg_lists]
    out = []
    for proc in procs:
        _, err = proc.communicate()
        m = re.search(r"(\d+) bytes .*copied, ([0-9.e+-]+) s", err)
        if proc.returncode or not m:
            raise RuntimeError(f"dd failed or cannot parse its output: {err!r}")
        out.append(float(m.group(2)))
    return out


def disk_raw_gbs(directory: str, size_mb: int = 256, streams: int = 1, bs_mb: int = 1, repeat: int = 3) -> dict:
    """The disk's raw O_DIRECT throughput on ``directory``: ``streams`` dd processes at once, each on a file of
    its own of ``size_mb`` MiB with ``bs_mb`` MiB requests, for a write to a new file, a read of it and a
    rewrite in place.  GB/s (1e9 bytes/s) = all streams' bytes over the slowest stream's seconds, the median
    of ``repeat`` runs; the per-run figures are kept too.  The files are removed afterwards."""
    root = tempfile.mkdtemp(prefix="rayzero-dd-", dir=directory)
    nbytes = streams * (size_mb // bs_mb) * bs_mb * MIB
    runs: dict[str, list[float]] = {"write": [], "read": [], "rewrite": []}
    try:
        for _ in range(repeat):
            per_stream = [_dd_args(os.path.join(root, f"dd{i}.bin"), size_mb, bs_mb) for i in range(streams)]
            for k, name in enumerate(runs):
                runs[name].append(nbytes / max(dd_parallel_seconds([a[k] for a in per_stream])) / 1e9)
            for i in range(streams):
                os.unlink(os.path.join(root, f"dd{i}.bin"))  # the next write is to a new file again
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return dict(directory=os.path.abspath(directory), size_mb=size_mb, streams=streams, bs_mb=bs_mb, repeat=repeat,
                **{f"{name}_gbs": statistics.median(v) for name, v in runs.items()},
                **{f"{name}_gbs_all": v for name, v in runs.items()})


def run_store(store: SwapStore, t: torch.Tensor, o: torch.Tensor) -> tuple[float, float, float]:
    if "x" in store.keys():
        store.remove("x")  # a new file each time, as dd's truncating write
    t0 = time.perf_counter()
    store.write("x", t).result()
    t1 = time.perf_counter()
    o.zero_()
    t2 = time.perf_counter()
    store.read("x", o).result()
    t3 = time.perf_counter()
    if not torch.equal(o, t):
        raise RuntimeError("data read back differs from data written")
    t4 = time.perf_counter()
    store.write("x", t).result()
    return t1 - t0, t3 - t2, time.perf_counter() - t4


def disk_for_swap(directory: str, size_mb: int, streams: int) -> dict:
    """disk_raw_gbs as the swap store moves data: ``streams`` dd streams at once (one per rank), requests of the
    store's syscall size with rayzero's default aio settings (block_size x queue_depth), median of 5."""
    from rayzero.config import Config

    aio = Config.from_any({}).aio
    disk = disk_raw_gbs(directory, size_mb, streams=streams, bs_mb=aio.block_size * aio.queue_depth // MIB, repeat=5)
    disk["load_average"] = os.getloadavg()[0]
    return disk


def write_while_python_runs(root: str, t: torch.Tensor, block: int, queue_depth: int) -> tuple[float, float]:
    """GB/s of one write with the calling thread idle in .result(), then spinning in Python."""
    with SwapStore(os.path.join(root, f"gil{queue_depth}"), block_size=block, queue_depth=queue_depth) as s:
        s.write("x", t).result()
        idle, busy = [], []
        for _ in range(3):
            t0 = time.perf_counter()
            s.write("x", t).result()
            idle.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            fut = s.write("x", t)
            n = 0
            while not fut.done():  # stands for the engine's Python work between torch ops
                n += 1
            busy.append(time.perf_counter() - t0)
    return t.nbytes / statistics.median(idle) / 1e9, t.nbytes / statistics.median(busy) / 1e9


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size-mb", type=int, default=512, help="tensor size in MiB (default 512)")
    ap.add_argument("--dir", default=".", help="directory on the disk to measure (default: current directory)")
    ap.add_argument("--repeat", type=int, default=5, help="repeats; the table shows medians (default 5)")
    ap.add_argument("--threads", default="1,2,4", help="thread_count values to run (default 1,2,4)")
    ap.add_argument("--block-mb", type=int, default=1, help="block_size in MiB (default 1, as aio's default)")
    args = ap.parse_args()

    load0 = os.getloadavg()[0]
    directory = os.path.abspath(args.dir)
    root = tempfile.mkdtemp(prefix="rayzero-swap-bench-", dir=directory)
    nbytes, numel, block = args.size_mb * MIB, args.size_mb * MIB // 4, args.block_mb * MIB
    torch.manual_seed(0)
    src = aligned_empty(numel, torch.float32)
    src.copy_(torch.rand(numel))
    out = aligned_empty(numel, torch.float32)
    # The same data in plain torch memory one element past an allocation, read back likewise: never
    # aligned, so every byte goes through the bounded pool of staging buffers.
    plain, plain_out = torch.empty(numel + 1)[1:], torch.empty(numel + 1)[1:]
    plain.copy_(src)

    configs = [(f"SwapStore threads={n}" + (" (default aio)" if n == 1 else ""), n, src, out)
               for n in (int(x) for x in args.threads.split(","))]
    configs.append(("SwapStore threads=1, unaligned (staged)", 1, plain, plain_out))
    stores = {name: SwapStore(os.path.join(root, f"s{i}"), block_size=block, thread_count=n)
              for i, (name, n, _, _) in enumerate(configs)}
    results: dict[str, list[tuple[float, float, float]]] = {name: [] for name in [DD, *stores]}
    systems = [None, *configs]  # None: dd
    try:
        for rep in range(args.repeat):
            for system in systems[rep % len(systems):] + systems[:rep % len(systems)]:
                if system is None:
                    results[DD].append(run_dd(os.path.join(root, "dd.bin"), args.size_mb))
                else:
                    name, _, t, o = system
                    results[name].append(run_store(stores[name], t, o))
        direct = all(s.direct for s in stores.values())
        gil = {qd: write_while_python_runs(root, src, block, qd) for qd in (1, 8, 64)}
    finally:
        for s in stores.values():
            s.close()
        shutil.rmtree(root, ignore_errors=True)

    gbs = {name: [nbytes / statistics.median(col) / 1e9 for col in zip(*rows)] for name, rows in results.items()}
    print(f"rayzero swap store vs dd: {args.size_mb} MiB fp32, {args.repeat} repeats (median), block_size "
          f"{args.block_mb} MiB, queue_depth 8 (direct I/O: {8 * args.block_mb} MiB per syscall)")
    print(f"directory {directory} ({fs_type(directory)}), kernel {platform.release()}, {os.cpu_count()} CPUs, "
          f"O_DIRECT: {direct}, load average before/after {load0:.2f}/{os.getloadavg()[0]:.2f} (other work on "
          f"the machine skews the numbers)")
    print("write: to a new file (dd truncates); rewrite: in place (dd conv=notrunc); GB/s = 1e9 bytes/s")
    print()
    cols = ["write", "read", "rewrite"]
    print(f"| {'system':<40} | " + " | ".join(f"{c} GB/s" for c in cols) + " | "
          + " | ".join(f"{c} / dd" for c in cols) + " |")
    print(f"|{'-' * 42}|" + "".join(f"{'-' * (len(c) + 6)}:|" for c in cols * 2))
    for name, v in gbs.items():
        print(f"| {name:<40} | " + " | ".join(f"{x:>{len(c) + 5}.2f}" for x, c in zip(v, cols)) + " | "
              + " | ".join(f"{x / d:>{len(c) + 5}.0%}" for x, d, c in zip(v, gbs[DD], cols)) + " |")
    print()
    print("rewrite while the calling thread runs Python (threads=1, median of 3):")
    print()
    print("| queue_depth | bytes per syscall | caller waits GB/s | caller runs Python GB/s |")
    print("|------------:|------------------:|------------------:|------------------------:|")
    for qd, (idle, busy) in gil.items():
        print(f"| {qd:>11} | {qd * args.block_mb:>13} MiB | {idle:>17.2f} | {busy:>23.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
