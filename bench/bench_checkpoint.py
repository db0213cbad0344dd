"""Checkpoint save/load throughput: rayzero universal checkpoints against torch.distributed.checkpoint (DCP).

    python bench/bench_checkpoint.py                  # full run: 33.6M params, 2 ranks, ~1.5 minutes on 2 cores
    python bench/bench_checkpoint.py --quick          # tiny model, 1 round: every code path in seconds
    python bench/bench_checkpoint.py --json out.json  # also write every number as JSON

Each system runs in its own fresh spawn of ``--world`` processes (gloo on 127.0.0.1, one torch thread per
rank), builds the same model from the same seed, trains one step (so AdamW state exists) and then, on a
temporary directory under /tmp, measures: sync save, async save (how long the call blocks training, and how
long until the checkpoint is committed), one training step overlapping an async save, and load, both
from the page cache (warm) and after evicting the checkpoint's pages with posix_fadvise(DONTNEED) (cold;
residency is measured with mincore, not assumed).  Every checkpoint written is loaded back and compared
bitwise with the state it was taken from.  See bench/README.md.
"""

from __future__ import annotations

import argparse
import ctypes
import hashlib
import json
import mmap
import os
import pickle
import shutil
import statistics
import sys
import tempfile
import time
import traceback

import torch

from spawn_ranks import free_port, spawn

MB = 1_000_000  # throughput in decimal megabytes per second

# ---------------------------------------------------------------------------------------------------------
# Workload (the bench_zero.py model)
# ---------------------------------------------------------------------------------------------------------


def build_model(dim: int, hidden: int, blocks: int, seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        *[
            torch.nn.Sequential(torch.nn.Linear(dim, hidden), torch.nn.GELU(), torch.nn.Linear(hidden, dim))
            for _ in range(blocks)
        ]
    )


def param_count(dim: int, hidden: int, blocks: int) -> int:
    return blocks * (dim * hidden + hidden + hidden * dim + dim)


def batch(a, rank: int, i: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + 17 * i + rank)
    return torch.randn(a.micro, a.dim, generator=g), torch.randn(a.micro, a.dim, generator=g)


# ---------------------------------------------------------------------------------------------------------
# Files: sizes, page-cache eviction and residency
# ---------------------------------------------------------------------------------------------------------


def files_under(path: str) -> list[str]:
    out = []
    for dirpath, _, names in os.walk(path):
        out += [os.path.join(dirpath, n) for n in names]
    return sorted(out)


def bytes_under(path: str) -> int:
    return sum(os.path.getsize(f) for f in files_under(path))


_libc = None


def _resident_pages(path: str) -> tuple[int, int]:
    """(resident, total) pages of ``path`` in the page cache, from mincore(2); (-1, total) if unavailable."""
    global _libc
    size = os.path.getsize(path)
    pages = -(-size // mmap.PAGESIZE)
    if size == 0:
        return 0, 0
    try:
        if _libc is None:
            _libc = ctypes.CDLL(None, use_errno=True)
            _libc.mmap.restype = ctypes.c_void_p
            _libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                                   ctypes.c_long]
            _libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
            _libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
        fd = os.open(path, os.O_RDONLY)
        try:
            addr = _libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
            if addr in (None, ctypes.c_void_p(-1).value):
                return -1, pages
            try:
                vec = (ctypes.c_ubyte * pages)()
                if _libc.mincore(ctypes.c_void_p(addr), size, vec) != 0:
                    return -1, pages
                return sum(b & 1 for b in bytes(vec)), pages
            finally:
                _libc.munmap(ctypes.c_void_p(addr), size)
        finally:
            os.close(fd)
    except (OSError, AttributeError):
        return -1, pages


def page_cache_fraction(path: str) -> float:
    """Fraction of the checkpoint's pages in the page cache (nan where mincore is unavailable)."""
    resident = total = 0
    for f in files_under(path):
        r, t = _resident_pages(f)
        if r < 0:
            return float("nan")
        resident, total = resident + r, total + t
    return resident / total if total else 0.0


def evict_from_page_cache(path: str) -> None:
    """Write back, then drop, every page of the checkpoint's files (no root needed, unlike drop_caches)."""
    for f in files_under(path):
        fd = os.open(f, os.O_RDONLY)
        try:
            os.fdatasync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def cpu_busy_s() -> float:
    """CPU seconds all cores spent busy since boot (/proc/stat), to detect competing load."""
    try:
        with open("/proc/stat") as f:
            fields = [int(v) for v in f.readline().split()[1:9]]
        user, nice, system, _idle, _iowait, irq, softirq, steal = fields
        return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError):
        return float("nan")


def fingerprint(tensors) -> str:
    h = hashlib.sha256()
    for t in tensors:
        t = t.detach().contiguous().cpu()
        h.update(str(t.dtype).encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()[:16]


# ---------------------------------------------------------------------------------------------------------
# Systems: each exposes step(), save(dir), async_save(dir) -> wait(), load(dir), state_fingerprint()
# ---------------------------------------------------------------------------------------------------------


def _read_text(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read().strip()
    except FileNotFoundError:
        return None


class RayzeroSystem:
    name = "rayzero ZeRO-2"
    tag = "ckpt"

    def __init__(self, model, a, world: int):
        import rayzero

        self.engine = rayzero.initialize(model, {
            "train_batch_size": a.micro * world,
            "train_micro_batch_size_per_gpu": a.micro,
            "zero_optimization": {"stage": 2},
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "fused": True}},
        })

    def step(self, x, y) -> None:
        loss = torch.nn.functional.mse_loss(self.engine(x), y)
        self.engine.backward(loss)
        self.engine.step()

    def save(self, path: str) -> None:
        self.engine.save_checkpoint(path, tag=self.tag)

    def async_save(self, path: str):
        self.engine.save_checkpoint(path, tag=self.tag, async_save=True)

        def wait(timeout_s: float = 600.0) -> None:
            # The commit is collective-free: rank 0 moves ``latest`` after every rank's file is written, so
            # ``latest`` naming the tag (with its manifest in place) means the whole save has finished.
            if torch.distributed.get_rank() == 0:
                latest, deadline = os.path.join(path, "latest"), time.monotonic() + timeout_s
                while not (_read_text(latest) == self.tag
                           and os.path.exists(os.path.join(path, self.tag, "manifest.json"))):
                    if time.monotonic() > deadline:
                        raise TimeoutError(f"async save to {path} did not commit within {timeout_s} s")
                    time.sleep(0.002)

        return wait

    def load(self, path: str) -> None:
        self.engine.load_checkpoint(path, tag=self.tag)

    def state_fingerprint(self) -> str:
        weights = list(self.engine.full_state_dict().values())
        opt = self.engine.optimizer.state_dict()["state"]
        return fingerprint(weights + [v if torch.is_tensor(v) else torch.tensor(v)
                                      for s in opt.values() for _, v in sorted(s.items())])

    def destroy(self) -> None:
        self.engine.destroy()


class DCPSystem:
    name = "torch DCP, FSDP2"

    def __init__(self, model, a, world: int):
        import torch.distributed as dist
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (world,))
        for block in model:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        self.model = model
        self.opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
        self.dcp, self.get_state_dict, self.set_state_dict = dcp, get_state_dict, set_state_dict
        # DCP's docs: async saves run their collectives on a background thread, so they get their own group
        # (sharing the default group with the training step's collectives could interleave them).
        self.async_group = dist.new_group(backend="gloo")

    def step(self, x, y) -> None:
        torch.nn.functional.mse_loss(self.model(x), y).backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)

    def _state(self) -> dict:
        msd, osd = self.get_state_dict(self.model, self.opt)
        return {"model": msd, "optim": osd}

    def save(self, path: str) -> None:
        self.dcp.save(self._state(), checkpoint_id=path)

    def async_save(self, path: str):
        future = self.dcp.async_save(self._state(), checkpoint_id=path, process_group=self.async_group)
        return lambda: future.result()

    def load(self, path: str) -> None:
        sd = self._state()
        self.dcp.load(sd, checkpoint_id=path)
        self.set_state_dict(self.model, self.opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"])

    def state_fingerprint(self) -> str:
        local = lambda t: t.to_local() if hasattr(t, "to_local") else t  # noqa: E731
        weights = [local(v) for _, v in sorted(self.model.state_dict().items())]
        opt = [local(v) if torch.is_tensor(v) else torch.tensor(v)
               for s in self.opt.state.values() for _, v in sorted(s.items())]
        return fingerprint(weights + opt)

    def destroy(self) -> None:
        pass


class DeepSpeedSystem:
    """Only when ``import deepspeed`` works; ZeRO-2 with its own save_checkpoint/load_checkpoint."""

    name = "DeepSpeed ZeRO-2"
    tag = "ckpt"

    def __init__(self, model, a, world: int):
        from bench_zero import init_deepspeed  # CPU accelerator, LOCAL_RANK, torch's gloo group

        deepspeed = init_deepspeed()
        # torch_adam: the others' torch.optim.AdamW(lr=1e-4, fused=True) itself, not DeepSpeed's FusedAdam
        self.engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config={
            "train_batch_size": a.micro * world,
            "train_micro_batch_size_per_gpu": a.micro,
            "zero_optimization": {"stage": 2},
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "fused": True, "torch_adam": True}},
        })

    def step(self, x, y) -> None:
        loss = torch.nn.functional.mse_loss(self.engine(x), y)
        self.engine.backward(loss)
        self.engine.step()

    def save(self, path: str) -> None:
        self.engine.save_checkpoint(path, tag=self.tag)

    async_save = None  # DeepSpeed's async checkpointing needs its Nebula/fast-writer engines

    def load(self, path: str) -> None:
        self.engine.load_checkpoint(path, tag=self.tag)

    def state_fingerprint(self) -> str:
        return fingerprint([p.detach() for p in self.engine.module.parameters()])

    def destroy(self) -> None:
        pass


SYSTEMS = {"rayzero": RayzeroSystem, "dcp": DCPSystem, "deepspeed": DeepSpeedSystem}


def deepspeed_available() -> tuple[bool, str]:
    os.environ.setdefault("DS_ACCELERATOR", "cpu")  # no CUDA here; the spawned ranks inherit it
    try:
        import deepspeed  # noqa: F401

        return True, ""
    except ImportError:
        return False, "not installed"
    except Exception as e:  # installed but broken
        return False, f"import failed: {type(e).__name__}: {e}"


# ---------------------------------------------------------------------------------------------------------
# One rank of one system
# ---------------------------------------------------------------------------------------------------------


def _rank_main(rank: int, world: int, port: int, kind: str, a: argparse.Namespace, root: str, queue) -> None:
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world)
        system = SYSTEMS[kind](build_model(a.dim, a.hidden, a.blocks), a, world)
        out: dict = {"rank": rank}
        step_i = 0

        def train_step() -> float:
            nonlocal step_i
            x, y = batch(a, rank, step_i)
            step_i += 1
            t0 = time.perf_counter()
            system.step(x, y)
            return time.perf_counter() - t0

        def timed(fn) -> float:
            """Seconds from a common start (barrier) until this rank is done; the table takes the max rank."""
            dist.barrier()
            t0 = time.perf_counter()
            fn()
            return time.perf_counter() - t0

        def on_rank0(fn) -> None:
            if rank == 0:
                fn()
            dist.barrier()

        def check_load(path: str, expected: str, what: str) -> None:
            system.load(path)
            got = system.state_fingerprint()
            if got != expected:
                raise AssertionError(f"{what}: state after loading {path} differs from the state saved "
                                     f"(fingerprint {got} != {expected})")

        train_step()  # AdamW state exists from here on
        out["step_alone_s"] = [train_step() for _ in range(a.repeats)]
        # One untimed save first: the first save of a process also pays one-time costs (lazy imports, and on
        # VMs the first touch of fresh page-cache memory), which the table reports separately.
        warmup_dir = os.path.join(root, kind, "warmup")
        out["first_save_s"] = timed(lambda: system.save(warmup_dir))
        on_rank0(lambda: shutil.rmtree(warmup_dir))
        busy0, own0, wall0 = cpu_busy_s(), time.process_time(), time.perf_counter()

        # -- sync save: a fresh directory per repeat; the last one stays for the loads
        out["save_s"], out["save_bytes"] = [], []
        sync_dir = None
        for r in range(a.repeats):
            previous, sync_dir = sync_dir, os.path.join(root, kind, f"sync-{r}")
            out["save_s"].append(timed(lambda: system.save(sync_dir)))
            if rank == 0:
                out["save_bytes"].append(bytes_under(sync_dir))
            if previous is not None:
                on_rank0(lambda: shutil.rmtree(previous))
        saved_fp = system.state_fingerprint()
        out["files"] = sorted(os.path.relpath(f, sync_dir) for f in files_under(sync_dir)) if rank == 0 else []

        # -- async save, nothing else running: how long the call blocks, and how long until committed
        out["async_call_s"], out["async_done_s"], out["async_bytes"] = [], [], []
        if system.async_save is not None:
            for r in range(a.repeats):
                path = os.path.join(root, kind, f"async-{r}")
                fp = system.state_fingerprint() if r == a.repeats - 1 else None
                dist.barrier()
                t0 = time.perf_counter()
                wait = system.async_save(path)
                out["async_call_s"].append(time.perf_counter() - t0)
                wait()
                out["async_done_s"].append(time.perf_counter() - t0)
                dist.barrier()  # every rank's wait() returned: the checkpoint is complete
                if rank == 0:
                    out["async_bytes"].append(bytes_under(path))
                if r == a.repeats - 1:  # the background save really finished, with the state of the call
                    check_load(path, fp, "async save")
                on_rank0(lambda: shutil.rmtree(path))

            # -- async save overlapping one training step (the step may change state the save copied)
            out["step_during_async_s"] = []
            for r in range(a.repeats):
                path = os.path.join(root, kind, f"overlap-{r}")
                fp = system.state_fingerprint() if r == a.repeats - 1 else None
                dist.barrier()
                wait = system.async_save(path)
                out["step_during_async_s"].append(train_step())
                wait()
                dist.barrier()
                if r == a.repeats - 1:
                    check_load(path, fp, "async save overlapping a step")
                on_rank0(lambda: shutil.rmtree(path))

        # -- loads of the last sync save: from the page cache, then after evicting its pages
        check_load(sync_dir, saved_fp, "sync save")
        out["load_warm_s"], out["load_cold_s"], out["cache_warm"], out["cache_cold"] = [], [], [], []
        for _ in range(a.repeats):
            out["cache_warm"].append(page_cache_fraction(sync_dir) if rank == 0 else None)
            out["load_warm_s"].append(timed(lambda: system.load(sync_dir)))
        for _ in range(a.repeats):
            on_rank0(lambda: evict_from_page_cache(sync_dir))
            out["cache_cold"].append(page_cache_fraction(sync_dir) if rank == 0 else None)
            out["load_cold_s"].append(timed(lambda: system.load(sync_dir)))
        if system.state_fingerprint() != saved_fp:
            raise AssertionError("state after the timed loads differs from the state saved")
        out["phase_wall_s"] = time.perf_counter() - wall0
        out["phase_machine_busy_s"] = cpu_busy_s() - busy0
        out["phase_own_cpu_s"] = time.process_time() - own0
        system.destroy()
        on_rank0(lambda: shutil.rmtree(os.path.join(root, kind), ignore_errors=True))
        queue.put((rank, "ok", pickle.dumps(out)))
    except BaseException:
        queue.put((rank, "error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _spawn(kind: str, a, root: str) -> tuple[list | None, str | None]:
    port = free_port()
    return spawn(_rank_main, lambda r: (r, a.world, port, kind, a, root), a.world, a.timeout)


# ---------------------------------------------------------------------------------------------------------
# Summary and report
# ---------------------------------------------------------------------------------------------------------


def _slowest(ranks: list[dict], key: str) -> list[float]:
    """Per repeat, the slowest rank: a collective operation is done when its last rank is."""
    return [max(vals) for vals in zip(*(r[key] for r in ranks))]


def summarize(rounds: list[list[dict]]) -> dict:
    """Pool every round's repeats; per repeat the slowest rank counts."""
    med = statistics.median
    r0s = [ranks[0] for ranks in rounds]
    s: dict = {"bytes": med(b for r0 in r0s for b in r0["save_bytes"]), "files": r0s[0]["files"]}
    for key in ("first_save_s", "save_s", "async_call_s", "async_done_s", "step_during_async_s", "load_warm_s",
                "load_cold_s", "step_alone_s"):
        vals = [v for ranks in rounds if ranks[0].get(key) is not None
                for v in (_slowest(ranks, key) if isinstance(ranks[0][key], list)
                          else [max(r[key] for r in ranks)])]
        if vals:
            s[key] = {"median": med(vals), "min": min(vals), "max": max(vals), "all": vals}
    s["cache_warm"] = med(c for r0 in r0s for c in r0["cache_warm"])
    s["cache_cold"] = med(c for r0 in r0s for c in r0["cache_cold"])
    wall = sum(r0["phase_wall_s"] for r0 in r0s)
    foreign = sum(r0["phase_machine_busy_s"] - sum(r["phase_own_cpu_s"] for r in ranks)
                  for r0, ranks in zip(r0s, rounds))
    s["foreign_cores"] = max(0.0, foreign / wall) if wall >= 1.0 else None
    return s


def _fmt_s(m: dict) -> str:
    return f"{m['median']:.3f} ({m['min']:.3f}-{m['max']:.3f})"


def _pct(x: float) -> str:
    return "n/a" if x != x else f"{100 * x:.0f}%"


def render(results: list[dict], meta: dict) -> str:
    lines = [
        f"Model: {meta['blocks']} x [Linear({meta['dim']},{meta['hidden']}) -> GELU -> Linear({meta['hidden']},"
        f"{meta['dim']})] = {meta['params']:,} params, fp32, AdamW (fused) after one training step; world "
        f"{meta['world']} (gloo, 1 torch thread/rank); {meta['rounds']} round(s) (fresh processes, systems "
        "taking turns) "
        f"x {meta['repeats']} repeats per measurement; "
        f"checkpoints under {meta['root_fs']}; torch {meta['torch']}, {meta['cpus']} CPUs.",
        "",
        "| system | operation | wall s, median (min-max) | MB/s | checkpoint MB | notes |",
        "|---|---|---:|---:|---:|---|",
    ]
    for r in results:
        if r["status"] != "ok":
            lines.append(f"| {r['name']} | - | {r['status']}: {r['error_short']} | | | |")
            continue
        s = r["summary"]
        mb = s["bytes"] / MB
        sync = s["save_s"]["median"]

        def row(op: str, key: str, note: str = "", rate: bool = True) -> None:
            m = s[key]
            thr = f"{s['bytes'] / m['median'] / MB:.0f}" if rate else "-"
            lines.append(f"| {r['name']} | {op} | {_fmt_s(m)} | {thr} | {mb:.1f} | {note} |")

        row("save (sync)", "save_s", f"{len(s['files'])} files, fsynced; the first save of each process "
            f"(untimed warm-up, not in the median) took {s['first_save_s']['median']:.3f} s")
        if "async_call_s" in s:
            blocked = s["async_call_s"]["median"]
            row("async save: call blocks training", "async_call_s", f"{100 * blocked / sync:.0f}% of sync save",
                rate=False)
            row("async save: call to committed", "async_done_s", "idle ranks while it writes; verified by load")
            step_alone = s["step_alone_s"]["median"]
            row("train step during async save", "step_during_async_s",
                f"step alone {step_alone:.3f} s: x{s['step_during_async_s']['median'] / step_alone:.2f}", rate=False)
        else:
            lines.append(f"| {r['name']} | async save | n/a | | | not measured |")
        row("load, from page cache", "load_warm_s", f"{_pct(s['cache_warm'])} of pages cached before")
        row("load, cold (pages evicted)", "load_cold_s", f"{_pct(s['cache_cold'])} of pages cached before")
    lines += [
        "",
        "wall s: from a barrier until the slowest rank returns, median over all repeats of all rounds (min-max). "
        "MB/s: checkpoint bytes (every file written, 10^6 B/MB) / wall time, both ranks together. Saves include "
        "taking the state (DCP: get_state_dict; rayzero: the fragments) and fsync of every file. Warm loads read "
        "from the page cache (the checkpoint was just written or read); cold loads first evict the checkpoint's "
        "pages with posix_fadvise(DONTNEED), and the cached fraction before the load is measured with mincore. "
        "Loads include set_state_dict (DCP) / publishing the weights (rayzero). Every checkpoint was loaded back "
        "and its state compared bitwise with the state at the save call.",
    ]
    busy = [f"{r['name']}: {r['summary']['foreign_cores']:.2f}" for r in results
            if r["status"] == "ok" and r["summary"]["foreign_cores"] is not None]
    if busy:
        lines.append(f"Cores busy with other processes during the measurements: {', '.join(busy)} "
                     "(timings are only comparable near 0).")
    return "\n".join(lines)


def _short_error(msg: str) -> str:
    lines = [ln.strip() for ln in msg.strip().splitlines() if ln.strip()]
    last = lines[-1] if lines else msg
    return (last[:140] + "...") if len(last) > 140 else last


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="tiny model, 2 repeats: a smoke test of every code path")
    p.add_argument("--repeats", type=int, default=None,
                   help="repeats per measurement in each round (default 3; --quick: 2)")
    p.add_argument("--rounds", type=int, default=None,
                   help="fresh spawns per system, systems taking turns (default 2; --quick: 1)")
    p.add_argument("--world", type=int, default=2, help="ranks (default 2)")
    p.add_argument("--only", default=None, help="comma-separated: rayzero, dcp, deepspeed")
    p.add_argument("--dir", default="/tmp", help="parent of the temporary checkpoint directory (default /tmp)")
    p.add_argument("--keep", action="store_true", help="keep the checkpoint directory")
    p.add_argument("--json", default=None, help="also write the results as JSON to this path")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds per system before it counts as hung")
    a = p.parse_args(argv)
    if a.quick:
        a.dim, a.hidden, a.blocks = 32, 128, 2
        a.repeats = a.repeats or 2
        a.rounds = a.rounds or 1
    else:
        a.dim, a.hidden, a.blocks = 1024, 4096, 4
        a.repeats = a.repeats or 3
        a.rounds = a.rounds or 2
    if a.repeats < 1 or a.rounds < 1:
        p.error("--repeats and --rounds must be >= 1")
    a.micro = 8
    return a


def main(argv=None) -> int:
    a = parse_args(argv)
    root = tempfile.mkdtemp(prefix="rayzero-bench-ckpt-", dir=a.dir)
    fs_type = "?"
    try:
        with open("/proc/mounts") as f:  # the longest mount point containing root
            mounts = [ln.split() for ln in f]
        best = max((m for m in mounts if root.startswith(m[1].rstrip("/") + "/") or m[1] == "/"),
                   key=lambda m: len(m[1]))
        fs_type = f"{root} ({best[2]} on {best[0]})"
    except (OSError, ValueError):
        fs_type = root
    meta = dict(dim=a.dim, hidden=a.hidden, blocks=a.blocks, params=param_count(a.dim, a.hidden, a.blocks),
                world=a.world, repeats=a.repeats, rounds=a.rounds, torch=torch.__version__, cpus=os.cpu_count(),
                root_fs=fs_type,
                command=" ".join([os.path.basename(sys.executable), *sys.argv]))
    kinds = ["rayzero", "dcp", "deepspeed"]
    if a.only:
        kinds = [k for k in kinds if k in {x.strip().lower() for x in a.only.split(",")}]
    results = []
    for kind in kinds:
        res = {"kind": kind, "name": SYSTEMS[kind].name, "status": "ok", "rounds": []}
        if kind == "deepspeed":
            ok, why = deepspeed_available()
            if not ok:
                res.update(status="skipped", error=why, error_short=why)
                print(f"[bench] {res['name']}: {why}", file=sys.stderr, flush=True)
        results.append(res)
    try:
        # Systems take turns, round after round, so load from other processes on a shared machine falls on
        # all of them rather than on whichever happened to run at the wrong moment.
        for rnd in range(a.rounds):
            for res in results:
                if res["status"] != "ok":
                    continue
                print(f"[bench] {res['name']}, round {rnd + 1}/{a.rounds} ...", file=sys.stderr, flush=True)
                ranks, error = _spawn(res["kind"], a, os.path.join(root, f"round{rnd}"))
                if error is not None:
                    res.update(status="error", error=error, error_short=_short_error(error))
                    print(error, file=sys.stderr, flush=True)
                    continue
                res["rounds"].append(ranks)
                s = summarize([ranks])
                print(f"[bench]   save {s['save_s']['median']:.3f} s, load {s['load_warm_s']['median']:.3f} s "
                      f"(cold {s['load_cold_s']['median']:.3f} s), {s['bytes'] / MB:.1f} MB, other load "
                      f"{s['foreign_cores'] if s['foreign_cores'] is None else round(s['foreign_cores'], 2)} "
                      "cores", file=sys.stderr, flush=True)
        for res in results:
            if res["status"] == "ok":
                res["summary"] = summarize(res["rounds"])
    finally:
        if not a.keep:
            shutil.rmtree(root, ignore_errors=True)
    print(render(results, meta))
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"meta": meta, "results": results}, f, indent=1, default=str)
        print(f"\nJSON written to {a.json}")
    return 0 if all(r["status"] in ("ok", "skipped") for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
