"""The largest model each offload config trains under a per-rank memory cap, rayzero and DeepSpeed (issue 27).

    python bench/bench_cap.py                       # rayzero, 1 GiB per rank, world 2, none / cpu / nvme
    python bench/bench_cap.py --cap-mib 2048 --configs nvme --nvme-path /mnt/nvme/swap
    python bench/bench_cap.py --system rayzero,deepspeed   # both, in a venv where `import deepspeed` works

Each trial spawns ``--world`` ranks on this host; each rank moves itself into a cgroup v1 memory group of
its own whose ``memory.limit_in_bytes`` is the cap less what the rank already holds (torch imported: the
post-import baseline counts against the cap, as it does for a container or a Ray worker; the kernel does
not move existing charges with a process, so they are subtracted from the limit instead).  There it
builds the bench model (blocks of Linear(1024, 4096) -> GELU -> Linear(4096, 1024), 8.4M parameters each)
and trains ``--steps`` steps of ZeRO-3 with AdamW.

- rayzero: the model built under ``rayzero.zero_init``, config defaults besides the offload: ``cpu`` puts
  the optimizer on the CPU, ``nvme`` the optimizer and the parameters on NVMe.
- deepspeed: the model built under ``deepspeed.zero.Init(config_dict_or_path=..., remote_device=...)``, then
  ``deepspeed.initialize``; ``cpu`` / ``nvme`` offload optimizer and parameters both (ZeRO-Infinity).  The
  plain configs keep DeepSpeed's defaults for sub_group_size and the swap buffers; ``-sized`` sets them for
  this model (see ``deepspeed_zero_config``).  DeepSpeed chooses the AdamW implementation itself
  (DeepSpeedCPUAdam when offloaded, its FusedAdam op otherwise); the trial reports which.

A trial passes when every rank finishes; it fails when a rank is killed for memory (the machine has no
swap), or when the system raises (rayzero refusing the plan at start-up with its own memory check,
DeepSpeed failing an assertion or an allocation): the message is reported.  Sizes go up a ladder of block
counts and a config stops at its first failure.

The table gives, per config, the largest model trained, its model states per rank (16 bytes per parameter
over the world: fp32 master, gradient and AdamW's two moments) and that figure over the cap: the issue's
target is at least 3x with optimizer and parameters on NVMe.  Needs root and a writable
/sys/fs/cgroup/memory (cgroup v1); DeepSpeed's install is in bench/README.md ("DeepSpeed rows").
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
import traceback

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from spawn_ranks import free_port, spawn  # noqa: E402

MIB = 1 << 20
CGROUP = "/sys/fs/cgroup/memory"
BLOCK_PARAMS = 2 * 1024 * 4096 + 4096 + 1024


def _group(parent: str, rank: int) -> str:
    return os.path.join(CGROUP, parent, f"rank{rank}")


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _join_capped_group(path: str, cap: int) -> int:
    """Move this process into the group at ``path`` with a limit such that what it already holds counts
    against ``cap``: this kernel does not move existing charges with a process (``move_charge_at_immigrate``
    is refused), so the group's limit is the cap less the resident set at the move.  Returns that limit."""
    os.makedirs(path, exist_ok=True)
    limit = cap - _rss_bytes()
    with open(os.path.join(path, "memory.limit_in_bytes"), "w") as f:
        f.write(str(limit))
    with open(os.path.join(path, "cgroup.procs"), "w") as f:
        f.write(str(os.getpid()))
    return limit


def _read(path: str, name: str) -> int:
    with open(os.path.join(path, name)) as f:
        return int(f.read())


def _phase(out: dict, group: str, name: str) -> None:
    """Note the rank's charge (the held baseline included) now and its peak so far, after the phase ``name``."""
    out.setdefault("phases", []).append((name, out["held_before"] + _read(group, "memory.usage_in_bytes"),
                                         out["held_before"] + _read(group, "memory.max_usage_in_bytes")))


def bench_model(blocks: int) -> torch.nn.Module:
    """The bench model: ``blocks`` of Linear(1024, 4096) -> GELU -> Linear(4096, 1024)."""
    return torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(1024, 4096), torch.nn.GELU(),
                                                     torch.nn.Linear(4096, 1024)) for _ in range(blocks)])


def _train(engine, rank: int, steps: int, out: dict, group: str) -> None:
    """``steps`` steps of either system's engine (forward, backward, step), each phase's charge recorded;
    then the peak charge of the rank's group (the post-import baseline included)."""
    g = torch.Generator().manual_seed(rank)
    for i in range(steps):
        x = torch.randn(4, 1024, generator=g)
        loss = torch.nn.functional.mse_loss(engine(x), x)
        _phase(out, group, f"step {i}: forward")
        engine.backward(loss)
        _phase(out, group, f"step {i}: backward")
        engine.step()
        _phase(out, group, f"step {i}: optimizer step")
    out["peak"] = out["held_before"] + _read(group, "memory.max_usage_in_bytes")


def _enter_capped_rank(rank: int, world: int, port: int, parent: str, cap: int) -> tuple[str, dict]:
    """A trial rank's start, either system: into its capped group (what it holds already counted), then the
    gloo process group.  Returns the group's path and the rank's record (``held_before``)."""
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    group = _group(parent, rank)
    out = {"held_before": cap - _join_capped_group(group, cap)}
    dist.init_process_group("gloo", rank=rank, world_size=world)
    return group, out


def _rank_main(rank: int, world: int, port: int, parent: str, cap: int, blocks: int, offload: str,
               nvme_path: str, steps: int, queue) -> None:
    import pickle

    import torch.distributed as dist

    try:
        group, out = _enter_capped_rank(rank, world, port, parent, cap)
        import rayzero

        _phase(out, group, "imported, process group up")
        zero: dict = {"stage": 3}
        if offload == "cpu":
            zero["offload_optimizer"] = {"device": "cpu"}
        elif offload == "nvme":
            zero["offload_optimizer"] = {"device": "nvme", "nvme_path": nvme_path}
            zero["offload_param"] = {"device": "nvme", "nvme_path": nvme_path}
        cfg = {"train_batch_size": 4 * world, "train_micro_batch_size_per_gpu": 4, "zero_optimization": zero,
               "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}}}
        with rayzero.zero_init(config=cfg):
            model = bench_model(blocks)
        _phase(out, group, "model built")
        engine = rayzero.initialize(model, cfg)
        _phase(out, group, "initialized")
        _train(engine, rank, steps, out, group)
        engine.destroy()
        queue.put((rank, "ok", pickle.dumps(out)))
    except BaseException:
        queue.put((rank, "error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


LARGEST_PARAM = 4096 * 1024  # the bench model's largest parameter (each Linear's weight), elements


def deepspeed_zero_config(offload: str, nvme_path: str) -> tuple[dict, str | None]:
    """The ``zero_optimization`` section of a DeepSpeed ZeRO-3 trial and ``zero.Init``'s ``remote_device``.

    ``none``: nothing offloaded.  ``cpu`` / ``nvme``: optimizer states and parameters both offloaded to that
    device (ZeRO-Infinity), everything else at DeepSpeed's defaults (sub_group_size 1e9 elements, parameter
    buffers 5 x 1e8 elements, optimizer buffer_count 4).  A ``-sized`` suffix sets them for the bench model:
    sub_group_size and the parameter buffer_size to its largest parameter (4,194,304 elements, one Linear
    weight), parameter buffer_count 4 and optimizer buffer_count 4 (the DeepSpeed default written out).
    """
    base, _, sized = offload.partition("-")
    if base not in ("none", "cpu", "nvme") or offload not in (base, base + "-sized"):
        raise ValueError(f"unknown DeepSpeed config {offload!r}: none, cpu, nvme, optionally with -sized")
    zero: dict = {"stage": 3}
    remote = None
    if base != "none":
        where = {"device": base}
        if base == "nvme":
            where["nvme_path"] = nvme_path
        zero["offload_optimizer"] = dict(where)
        zero["offload_param"] = dict(where)
        remote = base
    if sized:
        zero["sub_group_size"] = LARGEST_PARAM
        if base == "nvme":
            zero["offload_param"].update(buffer_size=LARGEST_PARAM, buffer_count=4)
            zero["offload_optimizer"].update(buffer_count=4)
    return zero, remote


def _rank_main_deepspeed(rank: int, world: int, port: int, parent: str, cap: int, blocks: int, offload: str,
                         nvme_path: str, steps: int, queue) -> None:
    """One DeepSpeed rank of a trial: the same cap, model, batch and steps as ``_rank_main``, ZeRO-3 with the
    model built under ``deepspeed.zero.Init``; DeepSpeed picks the optimizer implementation for ``AdamW``
    (DeepSpeedCPUAdam with the optimizer offloaded, its FusedAdam op otherwise; reported)."""
    import pickle
    import types

    import torch.distributed as dist

    try:
        group, out = _enter_capped_rank(rank, world, port, parent, cap)
        from bench_zero import deepspeed_optimizer, init_deepspeed

        deepspeed = init_deepspeed()
        _phase(out, group, "imported, process group up")
        zero, remote = deepspeed_zero_config(offload, nvme_path)
        cfg = {"train_batch_size": 4 * world, "train_micro_batch_size_per_gpu": 4, "zero_optimization": zero,
               "optimizer": deepspeed_optimizer(types.SimpleNamespace(lr=1e-4))}
        with deepspeed.zero.Init(config_dict_or_path=cfg, remote_device=remote):
            model = bench_model(blocks)
        _phase(out, group, "model built")
        engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
        _phase(out, group, "initialized")
        out["optimizer"] = type(getattr(engine.optimizer, "optimizer", engine.optimizer)).__name__
        _train(engine, rank, steps, out, group)
        queue.put((rank, "ok", pickle.dumps(out)))
    except BaseException:
        queue.put((rank, "error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _short(error: str) -> str:
    lines = [line for line in error.strip().splitlines() if line.strip()]
    last = lines[-1] if lines else error
    if "exited with code -9" in error or "exited with code 137" in error:
        return "killed for memory (OOM)"
    if "Connection closed by peer" in error or "Connection reset by peer" in error:
        return "a rank died (killed for memory: no swap here) and its peer lost the connection"
    return last[:300]


def trial(a, system: str, blocks: int, offload: str) -> tuple[bool, str, float]:
    parent = f"rayzero-cap-{os.getpid()}-{system}-{blocks}-{offload}"
    os.makedirs(os.path.join(CGROUP, parent), exist_ok=True)
    target = _rank_main if system == "rayzero" else _rank_main_deepspeed
    # DeepSpeed's swap files go to a folder of their own under --nvme-path, removed after the trial
    nvme_path = a.nvme_path if system == "rayzero" else os.path.join(a.nvme_path, parent)
    t0 = time.perf_counter()
    port = free_port()
    try:
        ranks, error = spawn(target, lambda r: (r, a.world, port, parent, a.cap_mib * MIB, blocks,
                                                offload, nvme_path, a.steps), a.world, a.timeout)
    finally:
        for r in range(a.world):
            try:
                os.rmdir(_group(parent, r))
            except OSError:
                pass
        try:
            os.rmdir(os.path.join(CGROUP, parent))
        except OSError:
            pass
        if system != "rayzero":
            shutil.rmtree(nvme_path, ignore_errors=True)
    wall = time.perf_counter() - t0
    if error is not None:
        return False, _short(error), wall
    peak = max(r["peak"] for r in ranks) / MIB
    what = f"peak charge {peak:.0f} MiB"
    if "optimizer" in ranks[0]:
        what += f", optimizer {ranks[0]['optimizer']}"
    if a.phases:
        for r, out in enumerate(ranks):
            for name, now, peak in out["phases"]:
                print(f"[cap]   {system} {offload} {blocks} blocks, rank {r}, {name}: charge {now / MIB:.0f} MiB, "
                      f"peak so far {peak / MIB:.0f} MiB", file=sys.stderr, flush=True)
    return True, what, wall


DEFAULT_CONFIGS = {"rayzero": "none,cpu,nvme", "deepspeed": "none,cpu,cpu-sized,nvme,nvme-sized"}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cap-mib", type=int, default=1024, help="memory.limit_in_bytes of each rank, MiB")
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--system", default="rayzero",
                   help="rayzero, deepspeed or both (comma-separated); deepspeed needs `import deepspeed`")
    p.add_argument("--configs", default=None,
                   help="offload configs to try, comma-separated (default: rayzero none,cpu,nvme; deepspeed "
                        "none,cpu,cpu-sized,nvme,nvme-sized)")
    p.add_argument("--blocks", default="1,2,4,8,12,16,24,32,48", help="the ladder of block counts")
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per trial")
    p.add_argument("--phases", action="store_true",
                   help="print each rank's charge and peak after set-up, build, initialize and each step's "
                        "forward, backward and optimizer step (passed trials)")
    p.add_argument("--nvme-path", default=os.path.join(tempfile.gettempdir(), "rayzero-bench-cap-swap"))
    a = p.parse_args(argv)
    if not os.access(CGROUP, os.W_OK):
        print(f"{CGROUP} is not writable (needs root and cgroup v1's memory controller)", file=sys.stderr)
        return 2
    systems = [s.strip() for s in a.system.split(",") if s.strip()]
    for system in systems:
        if system not in DEFAULT_CONFIGS:
            p.error(f"unknown system {system!r}: rayzero or deepspeed")
    ladder = [int(b) for b in a.blocks.split(",")]
    rows = []
    for system in systems:
        configs = a.configs or DEFAULT_CONFIGS[system]
        for offload in [c.strip() for c in configs.split(",") if c.strip()]:
            best, failed, best_what = 0, "", ""
            for blocks in ladder:
                ok, what, wall = trial(a, system, blocks, offload)
                print(f"[cap] {system} {offload} {blocks} blocks ({blocks * BLOCK_PARAMS / 1e6:.0f}M params): "
                      f"{'ok' if ok else 'FAILED'}, {what} ({wall:.0f} s)", file=sys.stderr, flush=True)
                if not ok:
                    failed = f"{blocks} blocks: {what}"
                    break
                best, best_what = blocks, what
            rows.append((system, offload, best, best_what, failed))
    cap = a.cap_mib * MIB
    print(f"\nCap {a.cap_mib} MiB per rank (cgroup v1 memory.limit_in_bytes, the post-import baseline included), "
          f"world {a.world}, ZeRO-3 with the model built under rayzero.zero_init / deepspeed.zero.Init, "
          f"{a.steps} steps.\n")
    print("| system | offload | largest trained | parameters | model states per rank | / cap | there | first failure |")
    print("|---|---|---:|---:|---:|---:|---|---|")
    for system, offload, best, best_what, failed in rows:
        n = best * BLOCK_PARAMS
        states = 16 * n / a.world
        print(f"| {system} | {offload} | {best} blocks | {n / 1e6:.0f}M | {states / MIB:.0f} MiB | "
              f"{states / cap:.2f}x | {best_what or '-'} | {failed or '-'} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
