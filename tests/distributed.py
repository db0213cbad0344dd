"""Run a function on N real processes joined by a gloo process group (no Ray needed)."""

from __future__ import annotations

import os
import pickle
import socket
import traceback

import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(fn, rank, world, port, queue, args, kwargs, env, init_pg):
    import torch
    import torch.distributed as dist

    os.environ.update(env)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    try:
        if init_pg:
            dist.init_process_group("gloo", rank=rank, world_size=world)
        result = fn(rank, world, *args, **kwargs)
        # plain pickle: tensors travel as bytes, not as shared-memory handles that die with this process
        queue.put((rank, "ok", pickle.dumps(result)))
    except BaseException:  # report every failure to the parent, which raises it
        queue.put((rank, "error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_distributed(
    fn, world: int, *args, timeout: float = 240.0, env: dict | None = None, init_pg: bool = True, **kwargs
) -> list:
    """Run ``fn(rank, world, *args, **kwargs)`` on ``world`` processes; return the per-rank results in rank order.

    With ``init_pg=False`` the processes get only the standard environment variables (RANK, WORLD_SIZE,
    MASTER_ADDR, MASTER_PORT) and no process group, as a launcher leaves them.

    A rendezvous whose port another process took between ``free_port()`` and the store's bind (a Ray cluster of
    the suite starts processes all the while) is run again on a new port: ``fn`` had not started.
    """
    for _ in range(2):
        try:
            return _run(fn, world, args, kwargs, timeout, env, init_pg)
        except _PortTaken:
            pass
    return _run(fn, world, args, kwargs, timeout, env, init_pg)  # a third time, its error as it comes


class _PortTaken(AssertionError):
    """Rank 0's store could not listen on the chosen port (EADDRINUSE) before ``fn`` ran."""


def _run(fn, world: int, args, kwargs, timeout: float, env: dict | None, init_pg: bool) -> list:
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(target=_entry, args=(fn, r, world, port, queue, args, kwargs, env or {}, init_pg), daemon=True)
        for r in range(world)
    ]
    for p in procs:
        p.start()
    results: dict[int, object] = {}
    errors = []
    try:
        for _ in range(world):
            rank, status, payload = queue.get(timeout=timeout)
            if status == "ok":
                results[rank] = pickle.loads(payload)
            else:
                errors.append(f"rank {rank} failed:\n{payload}")
                break
    finally:
        for p in procs:
            p.join(timeout=5 if not errors else 0.5)
            if p.is_alive():
                p.kill()
    if errors:
        text = "\n".join(errors)
        if "EADDRINUSE" in text and 'dist.init_process_group("gloo", rank=rank, world_size=world)' in text:
            raise _PortTaken(text)
        raise AssertionError(text)
    return [results[r] for r in range(world)]


_ONCE: dict = {}


def run_once(fn, world: int, *args, **kwargs) -> list:
    """``run_distributed(fn, world, *args, **kwargs)``, run once per pytest session for the same arguments:
    for a reference run (the CPU run a device run is compared with) that several tests, in one file or
    several, compare against.  Callers only read the results."""
    key = (fn.__module__, fn.__qualname__, world, args, tuple(sorted(kwargs.items())))
    if key not in _ONCE:
        _ONCE[key] = run_distributed(fn, world, *args, **kwargs)
    return _ONCE[key]
