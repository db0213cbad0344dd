"""What agreeing on a stop costs a step (docs/ray.md, "Stopping a run"): the step's loss all-reduce with one
element (before stops existed) against two (``rayzero.train.stop.agree``: the loss and the stop flag).

    python bench/bench_stop.py              # 2 ranks on this host: the shared-memory transport
    RAYZERO_SHM=0 python bench/bench_stop.py  # the same through gloo's sockets (pairwise)

Each rank runs ``CALLS`` reductions of each kind, alternating in ``ROUNDS`` rounds, and keeps its fastest round.
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

CALLS, ROUNDS = 3000, 3


def _rank_main(rank: int, world: int, port: int, queue) -> None:
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world)
        from rayzero.comm import Communicator
        from rayzero.train.stop import agree

        comm = Communicator.for_group(None)
        kinds = {"loss alone": lambda t: comm.sum_scalar(t).item(), "loss + stop flag": lambda t: agree(comm, t, 0.0, world)}
        best = {k: float("inf") for k in kinds}
        for _ in range(ROUNDS):
            for kind, op in kinds.items():
                dist.barrier()
                t0 = time.perf_counter()
                for _ in range(CALLS):
                    op(torch.full((1,), 0.5))
                best[kind] = min(best[kind], (time.perf_counter() - t0) / CALLS)
        shm = getattr(comm.transport, "_local", None)
        best["transport"] = "shared memory (/dev/shm)" if shm else "gloo (pairwise)"
        queue.put((rank, "ok", pickle.dumps(best)))
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
    print(f"the step's loss all-reduce, {a.world} ranks, transport {ranks[0]['transport']}, "
          f"fastest of {ROUNDS} rounds of {CALLS} calls (slowest rank)")
    for kind in ("loss alone", "loss + stop flag"):
        print(f"{kind}: {max(r[kind] for r in ranks) * 1e6:.1f} us a step")
    return 0


if __name__ == "__main__":
    sys.exit(main())
