"""Spawning the ranks of one benchmarked system and collecting what each reports (shared by the benches)."""

from __future__ import annotations

import pickle
import socket
import time

import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn(target, args_of_rank, world: int, timeout: float) -> tuple[list | None, str | None]:
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=target, args=(*args_of_rank(r), queue), daemon=True) for r in range(world)]
    for p in procs:
        p.start()
    results, error = {}, None
    deadline = time.monotonic() + timeout
    try:
        while len(results) < world and error is None:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                error = f"timed out after {timeout:.0f} s"
                break
            try:
                rank, status, payload = queue.get(timeout=min(remaining, 5.0))
            except Exception:  # queue.Empty: check that nobody died silently (killed for memory, ...)
                dead = [p for p in procs if p.exitcode not in (None, 0)]
                if dead:
                    error = f"a rank exited with code {dead[0].exitcode} without reporting"
                continue
            if status == "ok":
                results[rank] = pickle.loads(payload)
            else:
                error = f"rank {rank} failed:\n{payload}"
    finally:
        for p in procs:
            p.join(timeout=10 if error is None else 1)
            if p.is_alive():
                p.kill()
                p.join()
    if error is not None:
        return None, error
    return [results[r] for r in range(world)], None
