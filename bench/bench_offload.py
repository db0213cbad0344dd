"""rayzero optimizer offload (none / cpu / nvme) per ZeRO stage: step time and peak RSS against theory, on 2 CPU ranks.

    python bench/bench_offload.py                       # full run (3 rounds, 15-25 minutes on 2 cores)
    python bench/bench_offload.py --quick               # tiny model, 3 steps, 1 round, all systems in one
                                                        # spawn of 2 ranks: smoke test (10-25 s)
    python bench/bench_offload.py --stages 2 --devices none,nvme --rounds 1 --swap-dir /mnt/nvme

The workload is bench_zero.py's (4 blocks of Linear(1024,4096) -> GELU -> Linear(4096,1024), 33.6M parameters,
fp32, AdamW, clipping 1.0, micro-batch 8 per rank), with the config a user would write: the stage and
``offload_optimizer`` only (bucket sizes, ``buffer_count``, ``aio`` at their defaults), and for ``nvme`` also
each ``--sub-group-sizes`` value (``default``: the key left out, rayzero's choice; 1e9 keeps a rank's partition
in one sub-group, DeepSpeed's default; a smaller one splits it, so the next sub-group is read while the current
one steps).  Peers: torch DDP, FSDP2 and FSDP2 with
``CPUOffloadPolicy``; DeepSpeed ZeRO-Offload when ``import deepspeed`` works.

Every system runs in its own fresh spawn of 2 ranks (gloo on 127.0.0.1, one torch thread per rank), in the
environment a user has (glibc as it comes; ``--live-tensors`` sets ``MALLOC_MMAP_THRESHOLD_=65536`` so that RSS
follows the live tensors instead), a per-rank baseline taken once the runtime is warm and before the model
exists (bench_zero's ``--memory`` method), and VmHWM reset after the warm-up steps.  The systems take turns
over ``--rounds`` rounds; the tables give the median over rounds of the slowest rank's median step.
For NVMe rows the bench also reads the swap store's byte counters and times, from outside rayzero (wrapping
the engine's swap object in the rank process), how long each step waits for swap reads and writes.  It measures
the disk's raw O_DIRECT throughput on the swap directory once, before the rows (bench_swap's dd, one stream per
rank at once, ``--disk-mb`` MiB each), and sets every NVMe row against it: the bytes all ranks' swap stores moved
per step (their SwapStore.stats counters, every store the engine holds), the I/O floor (those bytes at the raw
read and rewrite rates) and floor / step time (1.0: the step is as fast as the disk allows).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import pickle
import shutil
import statistics
import sys
import tempfile
import time
import traceback

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(1, os.path.dirname(HERE))

import torch  # noqa: E402

from bench_zero import (  # noqa: E402
    MIB, _provenance_line, _short_error, bucket_allowance, build_model, cpu_busy_s, deepspeed_available,
    design_model_state_bytes, hwm_mib, make_batches, malloc_trim, param_count, reset_hwm, rss_mib,
    saved_activation_bytes, setup_ddp, setup_fsdp2, source_provenance, warm_runtime,
)
from spawn_ranks import free_port, spawn  # noqa: E402
from swap_traffic import IO_KEYS, add_disk_ratio, io_counters, settle, swap_stores  # noqa: E402


# ---------------------------------------------------------------------------------------------------------
# Systems
# ---------------------------------------------------------------------------------------------------------


def offload_config(a, world: int, stage: int, device: str, sub_group: int | None, nvme_path: str | None) -> dict:
    """What a user would write: the stage and offload_optimizer, everything else at rayzero's defaults."""
    zero: dict = {"stage": stage}
    if device != "none":
        zero["offload_optimizer"] = {"device": device, **({"nvme_path": nvme_path} if device == "nvme" else {})}
    if sub_group is not None:  # None: left out, rayzero's (or DeepSpeed's) default
        zero["sub_group_size"] = sub_group
    return {
        "train_batch_size": a.micro * world,
        "train_micro_batch_size_per_gpu": a.micro,
        "zero_optimization": zero,
        "optimizer": {"type": "AdamW", "params": {"lr": a.lr}},
        "gradient_clipping": a.clip,
    }


class _Timer:
    """Seconds spent inside wrapped calls; a call made inside another wrapped call of the same ``guard`` is
    counted only in the outermost one."""

    def __init__(self, guard: list | None = None):
        self.seconds = 0.0
        self._guard = guard if guard is not None else [0]

    def wrap(self, fn):
        @functools.wraps(fn)
        def inner(*args, **kw):
            if self._guard[0]:
                return fn(*args, **kw)
            self._guard[0] += 1
            t0 = time.perf_counter()
            try:
                return fn(*args, **kw)
            finally:
                self.seconds += time.perf_counter() - t0
                self._guard[0] -= 1

        return inner


WAITS = {"swap_in": "wait_read", "_take_slot": "wait_slot", "flush": "wait_flush"}


def instrument(engine) -> dict:
    """Timers on the engine's optimizer and (NVMe) swap object, set as instance attributes in this rank process:
    rayzero's code is not changed.  wait_read: in swap_in (waiting for a sub-group's reads); wait_slot: in
    _take_slot (waiting for a slot's earlier writes); wait_flush: in the step's final flush (the last writes)."""
    timers = {"adam": _Timer()}
    opt = engine.optimizer
    opt.step = timers["adam"].wrap(opt.step)
    swap = engine.swap
    if swap is not None:
        timers["swap_step"] = _Timer()
        swap.step = timers["swap_step"].wrap(swap.step)
        guard = [0]
        for name, key in WAITS.items():
            timers[key] = _Timer(guard)
            setattr(swap, name, timers[key].wrap(getattr(swap, name)))
    return timers


def pool_allocated_bytes(engine) -> int:
    """Bytes the NVMe swap slots hold now (their aligned buffers, kept from step to step)."""
    if engine.swap is None:
        return 0
    return sum(b.untyped_storage().nbytes() for slot in engine.swap.slots for b in slot.buffers.values())


def setup_rayzero(model, a, world, spec):
    import rayzero

    cfg = offload_config(a, world, spec["stage"], spec["offload"], spec.get("sub_group"), a.nvme_path)
    engine = rayzero.initialize(model, cfg)
    mse = torch.nn.functional.mse_loss

    def step(x, y):
        loss = mse(engine(x), y)
        engine.backward(loss)
        engine.step()
        return loss.detach(), engine.global_grad_norm

    step.engine = engine
    return step, engine.destroy


def setup_fsdp2_offload(model, a, world):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard

    from bench_zero import _plain_step, adamw_kwargs

    mesh = init_device_mesh("cpu", (world,))
    policy = CPUOffloadPolicy(pin_memory=False)  # pinning needs an accelerator
    for block in model:
        fully_shard(block, mesh=mesh, offload_policy=policy)
    fully_shard(model, mesh=mesh, offload_policy=policy)
    opt = torch.optim.AdamW(model.parameters(), **adamw_kwargs(a))
    return _plain_step(model, opt, a.clip), lambda: None


def setup_deepspeed_offload(model, a, world, spec):
    """DeepSpeed ZeRO-Offload with the same user config as rayzero's rows (stage + offload_optimizer, the rest
    at DeepSpeed's defaults), the optimizer section aside: the others' AdamW hyper-parameters written out
    (bench_zero.deepspeed_optimizer).  DeepSpeed steps the offloaded states with its DeepSpeedCPUAdam (C++
    op, JIT-built on first use); its NVMe swapping (stage 3) needs the async_io op, i.e. libaio."""
    from bench_zero import deepspeed_step

    return deepspeed_step(model, a, offload_config(a, world, spec["stage"], spec["offload"], spec.get("sub_group"),
                                                   a.nvme_path))


# DeepSpeed's stages 1 and 2 accept offload_optimizer.device "nvme" but keep the optimizer states in CPU memory
# (stage_1_and_2.py: any device but none is cpu_offload); only stage 3 swaps them to the nvme_path.
DS_NVME_STAGE12 = "DeepSpeed swaps optimizer states to NVMe only at stage 3 (stages 1-2 treat nvme as cpu)"


def system_specs(a) -> list[dict]:
    specs = [dict(name="torch DDP", kind="ddp", stage=None, offload="none"),
             dict(name="FSDP2", kind="fsdp2", raf=True, stage=None, offload="none"),
             dict(name="FSDP2 CPUOffloadPolicy", kind="fsdp2", raf=True, cpu_offload=True, stage=None, offload="cpu")]
    for s in a.stages:
        for d in a.devices:
            subs = a.sub_groups if d == "nvme" else [None]
            for sg in subs:
                tag = "" if d != "nvme" else ", sub_group " + (
                    "default" if sg is None else f"{sg:.3g}".replace("e+0", "e").replace("e+", "e"))
                specs.append(dict(name=f"rayzero stage {s} {d}{tag}", kind="rayzero", stage=s, offload=d, sub_group=sg))
    for s in a.stages:
        for d in a.devices:
            if d != "none":
                specs.append(dict(name=f"DeepSpeed stage {s} {d}", kind="deepspeed", stage=s, offload=d,
                                  sub_group=None, **({"skip": DS_NVME_STAGE12} if d == "nvme" and s < 3 else {})))
    if a.only:
        keys = [k.strip().lower() for k in a.only.split(",") if k.strip()]
        specs = [s for s in specs if any(k in s["name"].lower() for k in keys)]
    return specs


# ---------------------------------------------------------------------------------------------------------
# Theory
# ---------------------------------------------------------------------------------------------------------


def rayzero_bucket_allowance(engine) -> tuple[float, str]:
    """Transient buffers a rayzero engine keeps by design beyond its model states, in bytes, with how: the
    reduce buckets in flight (stages 2-3), stage 3's gathered units (in use and prefetched), and at stages 1-2
    the step's weight all-gather buckets, whichever is larger (the step's and the backward's do not overlap).
    (bench_zero's memory report counts rayzero rows with rayzero.memory.rank_memory instead.)"""
    from rayzero.zero.publish import WeightPublisher
    from rayzero.zero.reducer import GradientReducer

    s = engine.stage
    comm = torch.empty(0, dtype=engine.config.comm_dtype).element_size()
    compute = torch.empty(0, dtype=engine.compute_dtype).element_size()
    rb = max((b.group.world * b.cols * comm for b in engine.reducer.buckets), default=0)
    pb = max((g.world * sum(e.chunk for e, _ in m) * compute for g, m in engine.publisher.buckets), default=0)
    ub = 0
    if engine.gatherer is not None:
        entry = engine.partitions.entry_of
        ub = max((sum(e.padded_numel for e in (entry[p] for p in u.params)) * compute for u in engine.gatherer.units),
                 default=0)
    parts = []
    backward = 0
    if s >= 2:  # the bucket filling and MAX_INFLIGHT reduce-scatters in flight
        k = GradientReducer.MAX_INFLIGHT + 1
        backward += k * rb
        parts.append(f"{k} x {rb / MIB:.0f} MiB reduce buckets")
    if s == 3:  # the unit in use and the prefetched one
        backward += 2 * ub
        parts.append(f"2 x {ub / MIB:.0f} MiB gathered units")
    publish = WeightPublisher.MAX_INFLIGHT * pb if s in (1, 2) else 0
    if publish > backward:
        return float(publish), f"{WeightPublisher.MAX_INFLIGHT} x {pb / MIB:.0f} MiB all-gather buckets (step)"
    return float(backward), " + ".join(parts) if parts else "none (buckets are views of the gradient partition)"


class _AsStage:
    """The engine seen with another ``stage``: offloaded stage 1 reduces like stage 2 (engine.py), so its
    buckets are stage 2's; rayzero_bucket_allowance reads ``engine.stage``."""

    def __init__(self, engine, stage: int):
        self._engine, self.stage = engine, stage

    def __getattr__(self, name):
        return getattr(self._engine, name)


def theory_rayzero(spec: dict, a, world: int, engine) -> dict:
    from rayzero.memory import ram_bytes_per_param

    n = param_count(a.dim, a.hidden, a.blocks)
    s, dev = spec["stage"], spec["offload"]
    states = ram_bytes_per_param(s, world, False, 8, dev) * n
    if s == 3:  # persistent (small) parameters stay whole, as bench_zero counts them
        states += 4 * sum(p.numel() for p in engine.gatherer.persistent)
    view = _AsStage(engine, 2) if (dev != "none" and s == 1) else engine
    buckets, how = rayzero_bucket_allowance(view)
    pool = 0
    if engine.swap is not None:  # the swap pool's bound (not in ram_bytes_per_param): per slot, the largest
        largest = max(g.layout.partition_numel for g in engine.partitions.groups)  # sub-group x (master + 2)
        pool = len(engine.swap.slots) * 3 * largest * 4
    return dict(states_bytes=states, buckets_bytes=buckets, buckets_how=how, pool_bytes=pool,
                groups=len(engine.partitions.groups),
                largest_group=max(g.layout.partition_numel for g in engine.partitions.groups),
                direct_io=getattr(engine._swap_store, "direct", None))


def theory_peer(spec: dict, a, world: int) -> dict:
    zspec = {"kind": spec["kind"], "raf": spec.get("raf", True), "stage": spec.get("stage")}
    if spec["kind"] == "deepspeed":  # rayzero's per-parameter figures (DeepSpeed's design); its buckets not counted
        from rayzero.memory import ram_bytes_per_param

        n = param_count(a.dim, a.hidden, a.blocks)
        return dict(states_bytes=ram_bytes_per_param(spec["stage"], world, False, 8, spec["offload"]) * n,
                    buckets_bytes=0.0, buckets_how="not counted", pool_bytes=0)
    buckets, how = bucket_allowance(zspec, a, world)
    return dict(states_bytes=design_model_state_bytes(zspec, a, world), buckets_bytes=buckets, buckets_how=how,
                pool_bytes=0)


# ---------------------------------------------------------------------------------------------------------
# One rank of one system
# ---------------------------------------------------------------------------------------------------------


def _one_system(rank: int, world: int, spec: dict, a: argparse.Namespace) -> dict:
    """Build, warm up and time one system in this (already initialised) rank process."""
    import torch.distributed as dist

    out: dict = {"rank": rank}
    dist.barrier()
    out["baseline_mib"] = rss_mib()  # runtime warm, no model yet (and the previous system, if any, gone)
    reset_hwm()
    model = build_model(a.dim, a.hidden, a.blocks)
    engine = None
    if spec["kind"] == "rayzero":
        step, destroy = setup_rayzero(model, a, world, spec)
        engine = step.engine
        out.update(theory_rayzero(spec, a, world, engine))
        timers = instrument(engine)
        stores = swap_stores(engine)
        out["swap_stores"] = len(stores)
    else:
        if spec["kind"] == "ddp":
            step, destroy = setup_ddp(model, a, world)
        elif spec["kind"] == "fsdp2" and spec.get("cpu_offload"):
            step, destroy = setup_fsdp2_offload(model, a, world)
        elif spec["kind"] == "fsdp2":
            step, destroy = setup_fsdp2(model, a, world, spec["raf"])
        else:
            step, destroy = setup_deepspeed_offload(model, a, world, spec)
        out.update(theory_peer(spec, a, world))
        timers, stores = None, []
    out["hwm_setup_mib"] = hwm_mib() - out["baseline_mib"]

    data = make_batches(a.warmup + a.steps, world, a.micro, a.dim)
    lo, hi = rank * a.micro, (rank + 1) * a.micro
    losses, times, per_step = [], [], []
    for i, (x, y) in enumerate(data):
        if i == a.warmup:
            settle(stores)  # the warm-up's last writes belong to the warm-up
            dist.barrier()
            out["hwm_warmup_mib"] = hwm_mib() - out["baseline_mib"]
            reset_hwm()  # from here VmHWM is the peak of the timed steps alone
            io0 = io_counters(stores) if stores else None
            timed_t0, busy0, own0 = time.perf_counter(), cpu_busy_s(), time.process_time()
        before = io_counters(stores) if stores else None
        tm0 = {k: t.seconds for k, t in timers.items()} if timers else {}
        t0 = time.perf_counter()
        loss, _norm = step(x[lo:hi], y[lo:hi])
        dt = time.perf_counter() - t0
        losses.append(float(loss))
        if i >= a.warmup:
            times.append(dt)
            rec = {k: t.seconds - tm0[k] for k, t in timers.items()} if timers else {}
            if "wait_read" in rec:
                rec["wait"] = sum(rec[k] for k in WAITS.values())
            if stores:
                now = io_counters(stores)
                rec.update({k: now[k] - before[k] for k in before})
            per_step.append(rec)
    out["hwm_timed_mib"] = hwm_mib() - out["baseline_mib"]
    if engine is not None:
        out["pool_allocated_bytes"] = pool_allocated_bytes(engine)
    out["steady_mib"] = rss_mib() - out["baseline_mib"]
    out["timed_wall_s"] = time.perf_counter() - timed_t0
    out["timed_machine_busy_s"] = cpu_busy_s() - busy0
    out["timed_own_cpu_s"] = time.process_time() - own0
    if stores:  # what the timed steps moved, their last writes included: per step, exactly
        settle(stores)
        io1 = io_counters(stores)
        out["io_per_step"] = {k: (io1[k] - io0[k]) / a.steps for k in IO_KEYS}
    out["step_s"] = times
    out["median_step_ms"] = statistics.median(times) * 1000
    out["per_step"] = per_step
    t = torch.tensor(losses, dtype=torch.float64)
    dist.all_reduce(t)
    out["losses"] = (t / world).tolist()
    del engine, step
    destroy()
    malloc_trim()
    return out


def _rank_main(rank: int, world: int, port: int, specs: list[dict], a: argparse.Namespace, queue) -> None:
    """One rank: every system of ``specs`` in turn (one per spawn, except with --quick)."""
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    try:
        reset_hwm()
        dist.init_process_group("gloo", rank=rank, world_size=world)
        kinds = [k for s in specs for k in (("rayzero", "deepspeed") if s["kind"] == "deepspeed" else (s["kind"],))]
        for kind in dict.fromkeys(kinds):  # DeepSpeed's rows also read rayzero's offload plan for their theory
            warm_runtime(kind)
        outs = [_one_system(rank, world, spec, a) for spec in specs]
        queue.put((rank, "ok", pickle.dumps(outs)))
    except BaseException:
        queue.put((rank, "error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _median_of(per_step: list[dict], key: str) -> float:
    vals = [r[key] for r in per_step if key in r]
    return statistics.median(vals) if vals else float("nan")


def _summarise(spec: dict, ranks: list[dict]) -> dict:
    res = dict(spec)
    slow = max(ranks, key=lambda r: r["median_step_ms"])
    res.update(
        status="ok",
        ranks=ranks,
        median_step_ms=slow["median_step_ms"],
        peak_mib=max(r["hwm_timed_mib"] for r in ranks),
        setup_peak_mib=max(max(r["hwm_setup_mib"], r["hwm_warmup_mib"]) for r in ranks),
        steady_mib=max(r["steady_mib"] for r in ranks),
        baseline_mib=max(r["baseline_mib"] for r in ranks),
        foreign_cores=max(0.0, (ranks[0]["timed_machine_busy_s"] - sum(r["timed_own_cpu_s"] for r in ranks))
                          / ranks[0]["timed_wall_s"]) if ranks[0]["timed_wall_s"] >= 1.0 else None,
        losses=ranks[0]["losses"],
    )
    for k in ("states_bytes", "buckets_bytes", "buckets_how", "pool_bytes", "groups", "largest_group", "direct_io",
              "pool_allocated_bytes"):
        if k in ranks[0]:
            res[k] = ranks[0][k]
    # per-step phase times and swap counters, of the slowest rank
    for key in ("adam", "swap_step", "wait", *WAITS.values(), "bytes_read", "bytes_written", "read_seconds",
                "write_seconds"):
        res[key] = _median_of(slow["per_step"], key)
    if any(r.get("swap_stores") for r in ranks):  # what all ranks move through the one disk per step
        res["swap_stores"] = max(r.get("swap_stores", 0) for r in ranks)
        for key in IO_KEYS:
            res[key + "_ranks"] = sum(r["io_per_step"][key] for r in ranks)
        for key in ("read_seconds", "write_seconds"):
            res[key + "_slowest"] = slow["io_per_step"][key]
    return res


def run_systems(specs: list[dict], a: argparse.Namespace) -> list[dict]:
    """Run ``specs`` in one spawn of ``a.world`` ranks; on a failure, each on its own to find which one."""
    results: list[dict | None] = [None] * len(specs)
    todo = []
    for i, spec in enumerate(specs):
        if spec["kind"] == "deepspeed":
            ok, why = deepspeed_available()
            if not ok or spec.get("skip"):
                results[i] = dict(spec, status="skipped", error=why if not ok else spec["skip"])
                continue
        todo.append(i)
    if todo:
        batch = [specs[i] for i in todo]
        port = free_port()
        ranks, error = spawn(_rank_main, lambda r: (r, a.world, port, batch, a), a.world, a.timeout * len(batch))
        if error is None:
            for j, i in enumerate(todo):
                results[i] = _summarise(specs[i], [rk[j] for rk in ranks])
        elif len(todo) == 1:
            results[todo[0]] = dict(specs[todo[0]], status="error", error=error)
        else:
            for i in todo:
                results[i] = run_systems([specs[i]], a)[0]
    return results


# ---------------------------------------------------------------------------------------------------------
# Report
# ---------------------------------------------------------------------------------------------------------


def _merge_rounds(rounds: list[list[dict]]) -> list[dict]:
    """One row per system: medians over the rounds (and the step-time range)."""
    merged = []
    for i, first in enumerate(rounds[0]):
        runs = [r[i] for r in rounds]
        ok = [r for r in runs if r["status"] == "ok"]
        if not ok:
            merged.append(dict(first, rounds_ok=0))
            continue
        row = dict(ok[0], rounds_ok=len(ok), rounds=len(runs))
        for k in ("median_step_ms", "peak_mib", "setup_peak_mib", "steady_mib", "adam", "swap_step", "wait",
                  *WAITS.values(),
                  "bytes_read", "bytes_written", "read_seconds", "write_seconds", "baseline_mib",
                  *(k + "_ranks" for k in IO_KEYS), "read_seconds_slowest", "write_seconds_slowest", "io_floor_s",
                  "floor_over_step"):
            vals = [r[k] for r in ok if k in r and r[k] == r[k]]
            if vals:
                row[k] = statistics.median(vals)
        row["step_ms_all"] = [r["median_step_ms"] for r in ok]
        row["foreign_all"] = [r["foreign_cores"] for r in ok]
        if len(ok) < len(runs):
            row["failed_rounds"] = [_short_error(r.get("error", "")) for r in runs if r["status"] != "ok"]
        merged.append(row)
    return merged


def _mb(nbytes: float) -> str:
    return f"{nbytes / 1e6:.0f}" if nbytes >= 10e6 else f"{nbytes / 1e6:.3f}"


def _ms(seconds: float) -> str:
    return f"{seconds * 1000:.0f}" if seconds >= 0.01 else f"{seconds * 1000:.2f}"


def _fmt_sub(sg) -> str:
    return "unset (default)" if sg is None else f"{sg:,}"


def render(rows: list[dict], meta: dict) -> str:
    act = meta["activation_bytes"] / MIB
    ram = {r["stage"]: r for r in rows if r["kind"] == "rayzero" and r["offload"] == "none" and r.get("rounds_ok")}
    lines = [
        f"Workload: {meta['blocks']} x [Linear({meta['dim']},{meta['hidden']}) -> GELU -> "
        f"Linear({meta['hidden']},{meta['dim']})] = {meta['params']:,} params, fp32, AdamW lr {meta['lr']}, clip "
        f"{meta['clip']}, micro-batch {meta['micro']}/rank, world {meta['world']} (gloo, 1 thread/rank), "
        f"{meta['warmup']} warm-up + {meta['steps']} timed steps, {meta['rounds']} round(s); rayzero config: stage + "
        f"offload_optimizer only (defaults: buckets 5e7, buffer_count 4, aio block 1 MiB x queue 8, 1 thread). "
        f"MALLOC_MMAP_THRESHOLD_={meta['malloc_mmap_threshold'] or 'unset'}.",
        f"Swap directory: {meta['swap_root']} ({meta['swap_fs']}); {_provenance_line(meta.get('provenance', {}))}",
        "",
        "Step time:",
        "",
        "| system | stage | offload | sub_group_size | step ms (range over rounds) | x in-RAM same stage | "
        "optimizer phase ms (AdamW) | "
        "swap MB/step read+written | disk GB/s | blocked on swap I/O ms (% of step): read / slot / flush | loss last | "
        "other load |",
        "|---|---:|---|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        stage = "-" if r.get("stage") is None else str(r["stage"])
        sub = _fmt_sub(r.get("sub_group")) if r["kind"] in ("rayzero", "deepspeed") else "-"
        head = f"| {r['name']} | {stage} | {r['offload']} | {sub} |"
        if not r.get("rounds_ok"):
            lines.append(f"{head} {r['status']}: {_short_error(r.get('error', ''))} | | | | | | | |")
            continue
        ms = r["median_step_ms"]
        ref_stage = r["stage"] if r["kind"] in ("rayzero", "deepspeed") else (3 if r["kind"] == "fsdp2" else None)
        ref = ram.get(ref_stage)
        x = f"{ms / ref['median_step_ms']:.2f}" if ref is not None else "-"
        rng = f" ({min(r['step_ms_all']):.0f}-{max(r['step_ms_all']):.0f})" if len(r["step_ms_all"]) > 1 else ""
        adam = f"{r['adam'] * 1000:.0f}" if r.get("adam") == r.get("adam") and "adam" in r else "-"
        if r.get("swap_step") == r.get("swap_step") and r.get("swap_step") is not None:
            adam = f"{r['swap_step'] * 1000:.0f} ({adam})"
        if r.get("offload") == "nvme" and r["kind"] == "rayzero":
            moved = r["bytes_read"] + r["bytes_written"]
            busy = r["read_seconds"] + r["write_seconds"]
            io = (f"{_mb(r['bytes_read'])} + {_mb(r['bytes_written'])}", f"{moved / busy / 1e9:.2f}" if busy else "-",
                  f"{r['wait'] * 1000:.0f} ({100 * r['wait'] * 1000 / ms:.0f}%): {r['wait_read'] * 1000:.0f} / "
                  f"{r['wait_slot'] * 1000:.0f} / {r['wait_flush'] * 1000:.0f}")
        else:
            io = ("-", "-", "-")
        fc = [f for f in r["foreign_all"] if f is not None]
        other = f"{statistics.median(fc):.2f}" if fc else "-"
        lines.append(f"{head} {ms:.0f}{rng} | {x} | {adam} | {io[0]} | {io[1]} | {io[2]} | {r['losses'][-1]:.6f} | "
                     f"{other} |")
    lines += render_disk(rows, meta)
    lines += [
        "",
        "Memory (MiB above the rank's own baseline, largest rank, median over rounds):",
        "",
        "| system | stage | offload | sub_group_size | timed-steps peak | model states (theory) | activations | "
        "buckets | theory total | peak / theory | swap pool allocated (bound) | peak / (theory + pool allocated) | "
        "set-up peak | steady |",
        "|---|---:|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    notes = []
    for r in rows:
        stage = "-" if r.get("stage") is None else str(r["stage"])
        sub = _fmt_sub(r.get("sub_group")) if r["kind"] in ("rayzero", "deepspeed") else "-"
        head = f"| {r['name']} | {stage} | {r['offload']} | {sub} |"
        if not r.get("rounds_ok"):
            lines.append(f"{head} {r['status']} | | | | | | | | | |")
            continue
        states, buckets, pool = r["states_bytes"] / MIB, r["buckets_bytes"] / MIB, r.get("pool_bytes", 0) / MIB
        total = states + act + buckets
        alloc = r.get("pool_allocated_bytes", 0) / MIB
        pool_s = f"{alloc:.0f} ({pool:.0f})" if pool else "-"
        both = f"{r['peak_mib'] / (total + alloc):.2f}" if pool else "-"
        lines.append(f"{head} {r['peak_mib']:.0f} | {states:.0f} | {act:.1f} | {buckets:.0f} | {total:.0f} | "
                     f"{r['peak_mib'] / total:.2f} | {pool_s} | {both} | {r['setup_peak_mib']:.0f} | "
                     f"{r['steady_mib']:.0f} |")
        extra = ""
        if r["kind"] == "rayzero":
            extra = f"; {r['groups']} sub-group(s), largest {r['largest_group']:,} elements"
            if r.get("direct_io") is not None:
                extra += f", O_DIRECT {'on' if r['direct_io'] else 'off (buffered I/O)'}"
        notes.append(f"- {r['name']}: buckets = {r['buckets_how']}{extra}")
    lines += [
        "",
        "step ms: per rank the median over the timed steps, the slowest rank, then the median over rounds. optimizer "
        "phase: for NVMe the time in the swap step (read, step, write every sub-group), in brackets the time inside "
        "optimizer.step() (for NVMe summed over sub-groups); for the others optimizer.step() alone. swap MB/step: "
        "the swap store's "
        "byte counters over one step (10^6 B). disk GB/s: those bytes over the summed duration of the store's "
        "I/O calls (its busy time). blocked on swap I/O: time the step spends in swap_in (read: waiting for a "
        "sub-group's reads), taking a slot (slot: waiting for its earlier writes) and the final flush (flush: the "
        "last writes). theory: model states = "
        "rayzero.memory.ram_bytes_per_param x params (stage 3: + persistent parameters whole; peers: "
        "bench_zero's design figures, DDP 16, FSDP2 16/W bytes/param), activations saved for backward, and the "
        "buckets bench_zero's bucket_allowance (rayzero rows: rayzero_bucket_allowance) counts. swap pool: the aligned buffers the NVMe path allocates and "
        "keeps (master + 2 AdamW moments per slot), which ram_bytes_per_param does not count; allocated: the "
        "bytes its slots hold after the timed steps; bound: buffer_count slots x 3 x the largest sub-group x 4 "
        "bytes. "
        "set-up peak: VmHWM from the baseline through set-up and warm-up. steady: RSS after the timed steps.",
        "",
        *notes,
    ]
    return "\n".join(lines)


def render_disk(rows: list[dict], meta: dict) -> list[str]:
    """The NVMe rows against the disk's raw O_DIRECT throughput (issue 27)."""
    disk, one = meta.get("disk"), meta.get("disk_one_stream")
    nvme = [r for r in rows if r.get("rounds_ok") and "bytes_read_ranks" in r]
    if disk is None or not nvme:
        return []
    world = meta["world"]
    lines = [
        "",
        f"NVMe rows against the disk: raw O_DIRECT throughput on the swap directory, {disk['streams']} dd streams at "
        f"once ({disk['size_mb']} MiB each, bs={disk['bs_mb']}M, median of {disk['repeat']}): read "
        f"{disk['read_gbs']:.2f} GB/s, rewrite in place {disk['rewrite_gbs']:.2f} GB/s (write to a new file "
        f"{disk['write_gbs']:.2f})" + (f"; 1 stream: read {one['read_gbs']:.2f}, rewrite {one['rewrite_gbs']:.2f}, "
                                      f"write {one['write_gbs']:.2f} GB/s" if one else "") + ".",
        "",
        f"| system | sub_group_size | swap MiB/step read / written ({world} ranks) | I/O floor ms | step ms | "
        "floor / step | store I/O ms read + write (slowest rank) | blocked on swap I/O ms |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in nvme:
        rd, wr = r["read_seconds_slowest"], r["write_seconds_slowest"]
        lines.append(
            f"| {r['name']} | {_fmt_sub(r.get('sub_group'))} | {r['bytes_read_ranks'] / MIB:.1f} / "
            f"{r['bytes_written_ranks'] / MIB:.1f} | {_ms(r['io_floor_s'])} | {r['median_step_ms']:.0f} | "
            f"{r['floor_over_step']:.2f} | {_ms(rd + wr)} ({_ms(rd)} + {_ms(wr)}) | {r['wait'] * 1000:.0f} |")
    lines += [
        "",
        "swap MiB/step: the byte counters (SwapStore.stats) of every swap store the rank's engine holds, from "
        "before the first timed step to after the last one's writes are done, over the steps, summed over the "
        "ranks (they share the disk). I/O floor: read bytes / "
        "raw read + written bytes / raw rewrite (the swap files are rewritten in place every step), the dd "
        f"figures of {disk['streams']} streams at once (one per rank). floor / step: 1.00 = the step takes no "
        "longer than the disk needs for its bytes. store I/O: the summed duration of the stores' read and write "
        "calls per step, counted like the bytes (worker threads; they overlap compute and each other). blocked: "
        "as in the step-time table.",
    ]
    return lines


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=None, help="timed steps per system (default 10; --quick: 3)")
    p.add_argument("--warmup", type=int, default=None, help="warm-up steps (default 3; --quick 1); the first step "
                   "creates the optimizer state (with NVMe it reads only the masters), so keep >= 1")
    p.add_argument("--rounds", type=int, default=None, help="rounds, systems taking turns (default 3; --quick 1)")
    p.add_argument("--stages", default="1,2,3", help="ZeRO stages (default 1,2,3)")
    p.add_argument("--devices", default="none,cpu,nvme", help="offload_optimizer devices (default none,cpu,nvme)")
    p.add_argument("--sub-group-sizes", default=None,
                   help="sub_group_size values for the nvme rows ('default' leaves the key out; default "
                        "'default,1e9,5e6'; --quick 'default,1e9,3000')")
    p.add_argument("--swap-dir", default=None,
                   help="directory on the disk to swap to; the bench makes and removes a fresh subdirectory "
                        "(default: under the system temp dir)")
    p.add_argument("--quick", action="store_true", help="tiny model, 3 steps, 1 round: smoke test (< 60 s)")
    p.add_argument("--only", default=None, help="comma-separated substrings: run only systems whose name matches")
    p.add_argument("--live-tensors", action="store_true",
                   help="run the ranks with MALLOC_MMAP_THRESHOLD_=65536 (glibc returns every large free to the OS, "
                        "so RSS follows the live tensors); by default glibc is left as a user has it")
    p.add_argument("--json", default=None, help="also write every number as JSON")
    p.add_argument("--timeout", type=float, default=None, help="seconds per system before it counts as hung")
    p.add_argument("--disk-mb", type=int, default=None,
                   help="MiB per dd stream for the disk's raw O_DIRECT throughput, measured once before the rows when "
                        "there are NVMe rows (default 256; --quick 64; 0 skips it)")
    a = p.parse_args(argv)
    if a.quick:
        a.dim, a.hidden, a.blocks = 32, 128, 2
        a.steps = a.steps or 3
        a.warmup = 1 if a.warmup is None else a.warmup
        a.rounds = a.rounds or 1
        a.sub_group_sizes = a.sub_group_sizes or "default,1e9,3000"
        a.timeout = a.timeout or 120.0
        a.disk_mb = 64 if a.disk_mb is None else a.disk_mb
    else:
        a.dim, a.hidden, a.blocks = 1024, 4096, 4
        a.steps = a.steps or 10
        a.warmup = 3 if a.warmup is None else a.warmup
        a.rounds = a.rounds or 3
        a.sub_group_sizes = a.sub_group_sizes or "default,1e9,5e6"
        a.timeout = a.timeout or 600.0
        a.disk_mb = 256 if a.disk_mb is None else a.disk_mb
    a.stages = [int(s) for s in a.stages.split(",") if s.strip()]
    a.devices = [d.strip() for d in a.devices.split(",") if d.strip()]
    a.sub_groups = [None if s.strip() == "default" else int(float(s)) for s in a.sub_group_sizes.split(",")
                    if s.strip()]
    if any(s not in (1, 2, 3) for s in a.stages) or any(d not in ("none", "cpu", "nvme") for d in a.devices):
        p.error("--stages takes 1,2,3 and --devices none,cpu,nvme")
    if a.steps < 1 or a.warmup < 0 or a.rounds < 1:
        p.error("--steps and --rounds must be >= 1, --warmup >= 0")
    a.world, a.micro, a.lr, a.clip, a.adam_fused = 2, 8, 1e-4, 1.0, False
    a.bucket_elements = 25 * MIB // 4  # DDP's default bucket_cap_mb (25 MiB); rayzero keeps its own defaults
    return a


def _fs_type(path: str) -> str:
    best, kind = "", "?"
    with open("/proc/mounts") as f:
        for line in f:
            _dev, mnt, typ, *_ = line.split()
            if (path == mnt or path.startswith(mnt.rstrip("/") + "/")) and len(mnt) > len(best):
                best, kind = mnt, typ
    return f"{kind} on {best}"


def _progress(results: list[dict]) -> None:
    for r in results:
        if r["status"] == "ok":
            msg = f"{r['median_step_ms']:.0f} ms/step, timed-steps peak {r['peak_mib']:.0f} MiB above baseline"
        else:
            msg = f"{r['status']}: {_short_error(r.get('error', ''))}"
        print(f"[bench]   {r['name']}: {msg}", file=sys.stderr, flush=True)
        if r["status"] == "error":
            print(r["error"], file=sys.stderr, flush=True)


def measure_disk(a, specs: list[dict], streams: int | None = None) -> dict | None:
    """The disk's raw O_DIRECT throughput on the swap directory, once per run, before the rows (none without
    NVMe rows or with --disk-mb 0)."""
    if a.disk_mb <= 0 or not any(s["kind"] == "rayzero" and s["offload"] == "nvme" for s in specs):
        return None
    from bench_swap import disk_for_swap

    streams = a.world if streams is None else streams
    print(f"[bench] disk: raw O_DIRECT throughput, {streams} dd stream(s) x {a.disk_mb} MiB ...", file=sys.stderr,
          flush=True)
    return disk_for_swap(a.nvme_path, a.disk_mb, streams)


def main(argv=None) -> int:
    a = parse_args(argv)
    if a.live_tensors:
        os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", "65536")  # read by glibc when each rank starts
    base = a.swap_dir or tempfile.gettempdir()
    os.makedirs(base, exist_ok=True)
    a.nvme_path = tempfile.mkdtemp(prefix="rayzero-bench-offload-", dir=base)
    meta = dict(dim=a.dim, hidden=a.hidden, blocks=a.blocks, params=param_count(a.dim, a.hidden, a.blocks), lr=a.lr,
                clip=a.clip, micro=a.micro, world=a.world, warmup=a.warmup, steps=a.steps, rounds=a.rounds,
                malloc_mmap_threshold=os.environ.get("MALLOC_MMAP_THRESHOLD_"), swap_root=a.nvme_path,
                swap_fs=_fs_type(os.path.realpath(a.nvme_path)), torch=torch.__version__, cpus=os.cpu_count(),
                command=" ".join([os.path.basename(sys.executable), *sys.argv]))
    meta["provenance"] = source_provenance()
    meta["activation_bytes"] = saved_activation_bytes(a)
    specs = system_specs(a)
    rounds: list[list[dict]] = []
    try:
        disk = measure_disk(a, specs)
        meta["disk"] = disk
        if disk is not None:
            meta["disk_one_stream"] = measure_disk(a, specs, streams=1)
        for rnd in range(a.rounds):
            if a.quick:  # every system one after the other in the same two rank processes: seconds, not minutes
                print(f"[bench] round {rnd + 1}/{a.rounds}: {len(specs)} systems in one spawn ...", file=sys.stderr,
                      flush=True)
                results = run_systems(specs, a)
            else:
                results = []
                for spec in specs:
                    print(f"[bench] round {rnd + 1}/{a.rounds}: {spec['name']} ...", file=sys.stderr, flush=True)
                    results += run_systems([spec], a)
                    _progress(results[-1:])
            if a.quick:
                _progress(results)
            rounds.append(results)
    finally:
        shutil.rmtree(a.nvme_path, ignore_errors=True)
    after = source_provenance().get("rayzero_sources_sha256")
    meta["provenance"]["rayzero_sources_sha256_after"] = after
    meta["provenance"]["sources_changed_during_run"] = after != meta["provenance"].get("rayzero_sources_sha256")
    if meta["provenance"]["sources_changed_during_run"]:
        print("[bench] WARNING: rayzero's sources changed while the bench ran; rows may mix versions. Re-run.",
              file=sys.stderr, flush=True)
    for results in rounds:
        for r in results:
            add_disk_ratio(r, meta["disk"])
    rows = _merge_rounds(rounds)
    busy = [r["name"] for r in rows if r.get("rounds_ok")
            and statistics.median([f or 0.0 for f in r["foreign_all"]]) > 0.25]
    if busy:
        print(f"[bench] WARNING: other processes kept cores busy during {len(busy)} of the systems ({busy[0]}, ...); "
              "their step times are inflated. Re-run on an idle machine.", file=sys.stderr, flush=True)
    print(render(rows, meta))
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"meta": meta, "rounds": rounds}, f, indent=1, default=str)
        print(f"\nJSON written to {a.json}")
    return 0 if all(r["status"] in ("ok", "skipped") for rs in rounds for r in rs) else 1


if __name__ == "__main__":
    sys.exit(main())
