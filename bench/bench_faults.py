"""Page faults per step: how many fresh pages a rank faults in per training step, with rayzero's host
allocator settings (freed memory kept for reuse) and without (``RAYZERO_KEEP_FREED_MEMORY=0``).

The bench model, 2 ranks, stages 2 and 3 (config defaults); minor faults from /proc/self/stat over 5 steps
after 3 warm-up steps, and the wall time of those steps, on rank 0.

    python bench/bench_faults.py
"""

from __future__ import annotations

import os
import sys
import time

import torch
import torch.multiprocessing as mp

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.dirname(HERE)]


def minor_faults() -> int:
    with open("/proc/self/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[7])


def rank_main(rank: int, stage: int, keep: str, port: int, out) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2",
                      LOCAL_RANK=str(rank), RAYZERO_KEEP_FREED_MEMORY=keep)
    torch.set_num_threads(1)
    import rayzero
    from bench_zero import build_model

    engine = rayzero.initialize(build_model(1024, 4096, 4), {
        "train_batch_size": 16, "zero_optimization": {"stage": stage}, "gradient_clipping": 1.0,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}}})
    x = torch.randn(8, 1024, generator=torch.Generator().manual_seed(rank))
    for i in range(8):
        if i == 3:
            faults, start = minor_faults(), time.perf_counter()
        engine.backward(torch.nn.functional.mse_loss(engine(x), x))
        engine.step()
    if rank == 0:
        out.put(((minor_faults() - faults) / 5, (time.perf_counter() - start) / 5 * 1000))
    engine.destroy()


def main() -> None:
    from spawn_ranks import free_port

    ctx = mp.get_context("spawn")
    print("| stage | host allocator | minor faults / step (rank 0) | ms / step |")
    print("|---|---|---:|---:|")
    for stage in (2, 3):
        for keep, label in (("0", "glibc defaults"), ("1", "freed memory kept (rayzero's default)")):
            out = ctx.Queue()
            mp.start_processes(rank_main, args=(stage, keep, free_port(), out), nprocs=2, start_method="spawn")
            faults, ms = out.get()
            print(f"| {stage} | {label} | {faults:,.0f} | {ms:.1f} |", flush=True)


if __name__ == "__main__":
    main()
