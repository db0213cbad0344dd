"""Per-collective cost and throughput of rayzero's transport on a gloo group: the figures behind the gloo
entry of ``rayzero/zero/buckets.py`` (docs/config.md, "Derived bucket sizes").

    python bench/bench_comm.py              # 2 ranks on this host: the shared-memory transport
    RAYZERO_SHM=0 python bench/bench_comm.py  # the same through gloo's sockets (pairwise)
    python bench/bench_comm.py --world 4

Each rank runs rayzero's own ``Communicator`` (what the gradient reducer and weight publisher use) on a
bucket of N fp32 elements, 20 times after 3 warm-up calls, for N from 1,024 to 4,194,304 elements.
"""

from __future__ import annotations

import argparse
import os
import pickle
import sys
import time
import traceback

import torch

from spawn_ranks import free_port, spawn

SIZES = (1024, 65536, 262144, 1048576, 4194304)
REPEATS = 20


def _rank_main(rank: int, world: int, port: int, queue) -> None:
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world)
        from rayzero.comm import Communicator

        comm = Communicator.for_group(None)
        out = {}
        for n in SIZES:
            rows, part = torch.randn(world, n // world), torch.empty(n // world)
            gathered = torch.empty(world, n // world)
            times = []
            for op in (lambda: comm.reduce_scatter(part, rows), lambda: comm.all_gather(gathered, part)):
                for _ in range(3):
                    op().wait()
                dist.barrier()
                t0 = time.perf_counter()
                for _ in range(REPEATS):
                    op().wait()
                times.append((time.perf_counter() - t0) / REPEATS)
            out[n] = times
        shm = getattr(comm.transport, "_local", None)  # the shared-memory transport, when it is in use
        out["transport"] = "shared memory (/dev/shm)" if shm else "gloo (pairwise)"
        queue.put((rank, "ok", pickle.dumps(out)))
    except BaseException:
        queue.put((rank, "error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--world", type=int, default=2)
    a = p.parse_args(argv)
    port = free_port()
    ranks, error = spawn(_rank_main, lambda r: (r, a.world, port), a.world, 300.0)
    if error is not None:
        print(error, file=sys.stderr)
        return 1
    print(f"rayzero Communicator on a gloo group, transport {ranks[0]['transport']}, {a.world} ranks on one host, "
          f"fp32, mean of {REPEATS} calls (slowest rank)")
    print("| bucket elements | bucket MB | reduce-scatter ms | all-gather ms | reduce-scatter GB/s of bucket |")
    print("|---:|---:|---:|---:|---:|")
    for n in SIZES:
        rs, ag = (max(r[n][i] for r in ranks) for i in (0, 1))
        print(f"| {n:,} | {n * 4 / 1e6:.2f} | {rs * 1e3:.3f} | {ag * 1e3:.3f} | {n * 4 / rs / 1e9:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
