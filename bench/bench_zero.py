"""rayzero ZeRO stages 0-3 against torch DDP, FSDP2 and DeepSpeed on the same work, on 2 CPU ranks.

    python bench/bench_zero.py                  # full run (a few minutes on 2 cores)
    python bench/bench_zero.py --quick          # tiny model, 3 steps: every code path in seconds
    python bench/bench_zero.py --json out.json  # also write the results as JSON
    python bench/bench_zero.py --memory         # peak RSS of the timed steps against ZeRO theory, per stage

Every system runs in its own fresh spawn of ``--world`` processes (gloo on 127.0.0.1, one torch thread per
rank), so peak RSS is per system.  Each rank builds the same model from the same seed and trains on its own
slice of the same random global batches: forward, MSE loss, backward, gradient clipping at 1.0, AdamW.
A single process doing one rank's share of the work without any communication, with torch's fused AdamW
(the fastest any row runs), gives the compute-only baseline; a process that only imported torch gives the runtime baseline for memory.  See bench/README.md.

``--memory`` measures memory instead of speed: every rank runs with ``MALLOC_MMAP_THRESHOLD_=65536`` (glibc
returns every large ``free`` to the OS, so RSS follows the live tensors), takes its own baseline after the
runtime is warm and before the model exists, and reports the peak RSS of the timed steps above it against
the model states of docs/design.md's "Memory per rank" table plus activations plus the configured buckets.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import importlib
import json
import os
import pickle
import statistics
import sys
import tempfile
import time
import traceback

import torch

from spawn_ranks import free_port, spawn
from swap_traffic import IO_KEYS, add_disk_ratio, io_counters, settle, swap_stores

MIB = 1024 * 1024

# ---------------------------------------------------------------------------------------------------------
# Workload
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


def make_batches(n: int, world: int, micro: int, dim: int, seed: int = 1234) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``n`` global batches of ``world * micro`` samples; rank r trains on rows [r*micro, (r+1)*micro)."""
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(world * micro, dim, generator=g), torch.randn(world * micro, dim, generator=g)) for _ in range(n)]


# ---------------------------------------------------------------------------------------------------------
# Memory probes (Linux /proc)
# ---------------------------------------------------------------------------------------------------------


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return -1


def rss_mib() -> float:
    return _status_kib("VmRSS") / 1024


def hwm_mib() -> float:
    return _status_kib("VmHWM") / 1024


def cpu_busy_s() -> float:
    """CPU seconds all cores of the machine spent busy since boot (/proc/stat), to detect competing load."""
    try:
        with open("/proc/stat") as f:
            fields = [int(v) for v in f.readline().split()[1:9]]
        user, nice, system, _idle, _iowait, irq, softirq, steal = fields
        return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError):
        return float("nan")


def reset_hwm() -> bool:
    """Reset VmHWM to the current RSS (``echo 5 > /proc/self/clear_refs``); False where not permitted."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


CGROUP_V1_MEMORY = "/sys/fs/cgroup/memory"


def _cgroup_parent() -> str:
    return os.path.join(CGROUP_V1_MEMORY, f"rayzero-bench-{os.getppid() if _IN_RANK else os.getpid()}")


_IN_RANK = False


def join_own_memory_cgroup(rank: int) -> str | None:
    """Move this rank into a memory cgroup (v1) of its own, so its charge can be read: what the kernel bills
    this process for, where pages of memory the ranks of a host share count once, for the rank that touched
    them first (VmHWM counts them in every rank that maps them).  None where cgroup v1 is not writable."""
    try:
        path = os.path.join(_cgroup_parent(), f"rank{rank}")
        os.makedirs(path, exist_ok=True)
        with open(os.path.join(path, "cgroup.procs"), "w") as f:
            f.write(str(os.getpid()))
        return path
    except OSError:
        return None


def cgroup_read(path: str | None, name: str) -> int | None:
    if path is None:
        return None
    with open(os.path.join(path, name)) as f:
        return int(f.read())


def cgroup_reset_peak(path: str | None) -> None:
    if path is not None:
        with open(os.path.join(path, "memory.max_usage_in_bytes"), "w") as f:
            f.write("0")  # the peak starts again from the current usage


def remove_rank_cgroups() -> None:
    """Remove the ranks' cgroups once they exited (their pages' charges move to the parent group)."""
    parent = _cgroup_parent()
    if not os.path.isdir(parent):
        return
    for name in os.listdir(parent):
        if name.startswith("rank"):
            try:
                os.rmdir(os.path.join(parent, name))
            except OSError:
                pass


def malloc_trim() -> None:
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def warm_runtime(kind: str) -> None:
    """What every system pays before its model exists, paid before the memory baseline is taken: the
    lazy imports of autograd and of both AdamW kernels (``torch._dynamo`` among them) and the system's
    own modules."""
    m = torch.nn.Linear(4, 4)
    for kw in ({}, {"fused": True}):
        opt = torch.optim.AdamW(m.parameters(), **kw)
        m(torch.randn(2, 4)).sum().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    modules = {"fsdp2": ["torch.distributed.fsdp", "torch.distributed.device_mesh"],
               "ddp": ["torch.nn.parallel"], "rayzero": ["rayzero", "rayzero.zero.export"]}
    for name in modules.get(kind, []):
        try:
            importlib.import_module(name)
        except ImportError:  # an older rayzero without it
            pass
    if kind == "deepspeed":  # its import, its communication backend (and shm op) over the gloo group
        init_deepspeed()
    del m, opt
    malloc_trim()


# ---------------------------------------------------------------------------------------------------------
# Memory theory: docs/design.md "Memory per rank" (fp32 compute, AdamW, fp32 gradients in communication)
# ---------------------------------------------------------------------------------------------------------


def design_model_state_bytes(spec: dict, a, world: int) -> float:
    """Steady-state model states per rank of DDP (16 bytes per parameter) and FSDP2 (16/W); rayzero rows
    take theirs from ``rayzero_memory_model``."""
    n = param_count(a.dim, a.hidden, a.blocks)
    if spec["kind"] == "fsdp2":
        return 16 * n / world
    return 16.0 * n  # DDP, compute-only


def rayzero_memory_model(spec: dict, a, world: int, activations: int):
    """``rayzero.memory.rank_memory`` for a rayzero row: its config, its world, its host (all ranks on this
    one; they share memory through the shared-memory transport unless the row turns it off)."""
    from rayzero.config import Config
    from rayzero.memory import rank_memory

    cfg = zero_config(a, world, spec["stage"], spec.get("defaults", False))
    cfg["zero_optimization"].update(row_zero(spec, a))
    shm = spec.get("env", {}).get("RAYZERO_SHM", os.environ.get("RAYZERO_SHM", "1")) != "0"
    with torch.device("meta"):
        model = build_model(a.dim, a.hidden, a.blocks)
    return rank_memory(model, Config.from_any(cfg), world, activations=activations, local_ranks=world if shm else 1)


def bucket_allowance(spec: dict, a, world: int) -> tuple[float, str]:
    """Transient buffers DDP and FSDP2 keep by design beyond their model states, in bytes, with how (rayzero
    rows count theirs with ``rayzero_memory_model``)."""
    kind = spec["kind"]
    n = param_count(a.dim, a.hidden, a.blocks)
    if kind == "ddp":  # gradient_as_bucket_view=False: DDP's flat buckets are a second copy of the gradients
        return 4.0 * n, "DDP's buckets: a copy of every gradient"
    if kind == "fsdp2":
        block = max(sum(p.numel() for p in b.parameters()) for b in build_model(a.dim, a.hidden, 1)) * 4
        grads = 2 * block  # unsharded gradients of the block being reduced and the one in flight
        if spec["raf"]:
            return float(2 * block + grads), f"2 x {block / MIB:.0f} MiB unsharded blocks + 2 for their grads"
        return float(4 * n + grads), f"every block unsharded forward to backward ({4 * n / MIB:.0f} MiB) + 2 grad blocks"
    return 0.0, "none"


def saved_activation_bytes(a) -> int:
    """Bytes autograd saves for backward on one rank's micro-batch, parameters excluded (the same model
    and micro-batch for every system)."""
    model = build_model(a.dim, a.hidden, a.blocks)
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, int] = {}

    def pack(t):
        st = t.untyped_storage()
        if st.data_ptr() not in params:
            seen[st.data_ptr()] = st.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        x = torch.randn(a.micro, a.dim)
        loss = torch.nn.functional.mse_loss(model(x), torch.randn(a.micro, a.dim))
    del loss
    return sum(seen.values())


# ---------------------------------------------------------------------------------------------------------
# Systems: each returns ``step(x, y) -> (loss, grad_norm)`` for one training step on this rank
# ---------------------------------------------------------------------------------------------------------


def _float(t) -> float:
    if hasattr(t, "full_tensor"):  # a DTensor (FSDP2 grad norm)
        t = t.full_tensor()
    return float(t)


def adamw_kwargs(a) -> dict:
    """AdamW settings shared by every system: lr, and torch's fused kernel only when --adam-fused asks."""
    return {"lr": a.lr, "fused": True} if a.adam_fused else {"lr": a.lr}


def _plain_step(model, opt, clip):
    mse = torch.nn.functional.mse_loss

    def step(x, y):
        loss = mse(model(x), y)
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach(), norm

    return step


def setup_compute_only(model, a, world):
    # the limit: the fastest AdamW any row runs (torch's fused kernel, rayzero's default), whatever the others
    # use, and the host allocator settings rayzero applies on CPU (freed memory kept for reuse), so no
    # system can come out faster than the work it does
    from rayzero.accelerator.host_allocator import keep_freed_memory

    keep_freed_memory()
    opt = torch.optim.AdamW(model.parameters(), lr=a.lr, fused=True)
    return _plain_step(model, opt, a.clip), lambda: None


def setup_ddp(model, a, world):
    from torch.nn.parallel import DistributedDataParallel as DDP

    ddp = DDP(model, bucket_cap_mb=a.bucket_elements * 4 / MIB)
    opt = torch.optim.AdamW(ddp.parameters(), **adamw_kwargs(a))
    return _plain_step(ddp, opt, a.clip), lambda: None


def setup_fsdp2(model, a, world, reshard_after_forward: bool):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (world,))
    for block in model:
        fully_shard(block, mesh=mesh, reshard_after_forward=reshard_after_forward)
    fully_shard(model, mesh=mesh, reshard_after_forward=reshard_after_forward)
    opt = torch.optim.AdamW(model.parameters(), **adamw_kwargs(a))
    return _plain_step(model, opt, a.clip), lambda: None


def zero_config(a, world: int, stage: int, defaults: bool = False) -> dict:
    """The rayzero config of a row.  ``defaults``: what a user writes, with no tuning key at all (batch,
    stage, optimizer, clipping); rayzero derives bucket and prefetch sizes itself."""
    zero = {"stage": stage}
    if not defaults:
        zero.update(
            reduce_bucket_size=a.bucket_elements,
            allgather_bucket_size=a.bucket_elements,
            stage3_prefetch_bucket_size=a.bucket_elements,
            stage3_param_persistence_threshold=a.persistence_threshold,
            overlap_comm=True,
        )
    return {
        "train_batch_size": a.micro * world,
        "train_micro_batch_size_per_gpu": a.micro,
        "zero_optimization": zero,
        "optimizer": {"type": "AdamW", "params": adamw_kwargs(a)},
        "gradient_clipping": a.clip,
    }


def setup_rayzero(model, a, world, stage: int, defaults: bool = False, capture: list | None = None,
                  zero: dict | None = None):
    import rayzero

    cfg = zero_config(a, world, stage, defaults)
    cfg["zero_optimization"].update(zero or {})
    if capture:
        cfg["graph_capture"] = {"enabled": True, "targets": capture}
    engine = rayzero.initialize(model, cfg)
    mse = torch.nn.functional.mse_loss

    def step(x, y):
        loss = mse(engine(x), y)
        engine.backward(loss)
        engine.step()
        return loss.detach(), engine.global_grad_norm

    step.engine = engine  # the NVMe row's swap stores (their byte counters)
    return step, engine.destroy


def init_deepspeed():
    """Import DeepSpeed in a rank whose gloo process group is already up, and have it use that group.

    On a machine without CUDA DeepSpeed runs on its CPU accelerator (``DS_ACCELERATOR=cpu``), which defaults
    to the oneCCL backend; ``init_distributed(dist_backend="gloo")`` adopts torch's initialised gloo group
    instead.  DeepSpeed reads ``LOCAL_RANK`` (one host here: the rank) besides RANK/WORLD_SIZE/MASTER_*.
    """
    import logging

    import torch.distributed as dist

    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    os.environ["LOCAL_RANK"] = str(dist.get_rank())
    os.environ["LOCAL_SIZE"] = str(dist.get_world_size())
    import deepspeed

    deepspeed.utils.logger.setLevel(logging.WARNING)  # its per-step INFO lines would drown the bench's output
    deepspeed.init_distributed(dist_backend="gloo")
    return deepspeed


def deepspeed_optimizer(a) -> dict:
    """DeepSpeed's ``optimizer`` section with the AdamW hyper-parameters the other systems train with.

    The others run ``torch.optim.AdamW(lr=...)``, i.e. torch's defaults for betas, eps and weight_decay
    (0.01); DeepSpeed's own AdamW (FusedAdam, or DeepSpeedCPUAdam with offload) defaults weight_decay to 0,
    so torch's defaults are written out.  The implementation stays DeepSpeed's default, as it does for the
    others; with --adam-fused every system runs ``torch.optim.AdamW(fused=True)``, DeepSpeed too (torch_adam).
    """
    import inspect

    sig = inspect.signature(torch.optim.AdamW).parameters
    params = {"lr": a.lr, "betas": list(sig["betas"].default), "eps": sig["eps"].default,
              "weight_decay": sig["weight_decay"].default}
    if getattr(a, "adam_fused", False):
        params.update(torch_adam=True, fused=True)
    return {"type": "AdamW", "params": params}


def setup_deepspeed(model, a, world, stage: int):
    return deepspeed_step(model, a, zero_config(a, world, stage))


def deepspeed_step(model, a, cfg: dict):
    """A DeepSpeed engine from ``cfg`` with the others' AdamW (``deepspeed_optimizer``), and its MSE train step
    returning (loss, grad norm); plus the engine's destroy."""
    deepspeed = init_deepspeed()
    cfg["optimizer"] = deepspeed_optimizer(a)
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    mse = torch.nn.functional.mse_loss

    def step(x, y):
        loss = mse(engine(x), y)
        engine.backward(loss)
        engine.step()
        return loss.detach(), engine.get_global_grad_norm()

    return step, getattr(engine, "destroy", lambda: None)


def deepspeed_available() -> tuple[bool, str]:
    os.environ.setdefault("DS_ACCELERATOR", "cpu")  # no CUDA here; the spawned ranks inherit it
    try:
        import deepspeed  # noqa: F401

        return True, ""
    except ImportError:
        return False, "not installed"
    except Exception as e:  # installed but broken
        return False, f"import failed: {type(e).__name__}: {e}"


# name, kind, world (None: --world), options, ZeRO stage whose model-state figure applies (None: 16/W, full shard)
def system_specs(world: int, memory: bool = False) -> list[dict]:
    specs = [] if memory else [dict(name="compute-only (1 proc, no comm)", kind="compute", world=1, theory_stage=0)]
    specs.append(dict(name="torch DDP", kind="ddp", world=world, theory_stage=0))
    for s in range(4):
        specs.append(dict(name=f"rayzero stage {s}", kind="rayzero", world=world, stage=s, theory_stage=s))
    if not memory:  # the config a user writes: no bucket, prefetch or persistence key (issue 13)
        for s in range(4):
            specs.append(dict(name=f"rayzero stage {s}, config defaults", kind="rayzero", world=world, stage=s,
                              theory_stage=s, defaults=True))
    specs.append(dict(name="rayzero stage 3, zero_init", kind="rayzero", world=world, stage=3, theory_stage=3,
                      zero_init=True))
    if memory:  # what offload saves, as the user's process has it (issue 27): config defaults besides the offload
        specs.append(dict(name="rayzero stage 3, zero_init, config defaults", kind="rayzero", world=world, stage=3,
                          theory_stage=3, zero_init=True, defaults=True))
        specs.append(dict(name="rayzero stage 3, zero_init, optimizer on cpu", kind="rayzero", world=world, stage=3,
                          theory_stage=3, zero_init=True, defaults=True, offload="cpu"))
        specs.append(dict(name="rayzero stage 3, zero_init, optimizer and parameters on nvme", kind="rayzero",
                          world=world, stage=3, theory_stage=3, zero_init=True, defaults=True, offload="nvme"))
    if not memory:  # config defaults, but gathering leaf module by leaf module instead of block by block
        specs.append(dict(name="rayzero stage 3, config defaults, leaf units", kind="rayzero", world=world, stage=3,
                          theory_stage=3, defaults=True, zero={"stage3_gather_unit": "module"}))
    if not memory:  # config defaults, but gathering even on one host (what stage 3 does across hosts)
        specs.append(dict(name="rayzero stage 3, config defaults, gathered", kind="rayzero", world=world,
                          stage=3, theory_stage=3, defaults=True, zero={"stage3_share_weights": False}))
    if not memory:  # stages 1-2 with every group on gloo, as across hosts: the weights are gathered after a
        # step, inside it or (overlap_param_gather) during the next forward
        for s in (1, 2):
            for overlap in (False, True):
                specs.append(dict(name=f"rayzero stage {s}, config defaults, gloo only"
                                  + (", overlap_param_gather" if overlap else ""), kind="rayzero", world=world,
                                  stage=s, theory_stage=s, defaults=True, env={"RAYZERO_SHM": "0"},
                                  zero={"overlap_param_gather": True} if overlap else None))
    if not memory:  # the same config defaults with "graph_capture" on (compiled during the warm-up steps)
        for s in (1, 2, 3):
            specs.append(dict(name=f"rayzero stage {s}, graph capture", kind="rayzero", world=world, stage=s,
                              theory_stage=s, defaults=True, capture=["step"]))
        specs.append(dict(name="rayzero stage 2, graph capture + model", kind="rayzero", world=world, stage=2,
                          theory_stage=2, defaults=True, capture=["step", "model"]))
    for raf in (False, True):
        specs.append(
            dict(name=f"FSDP2 reshard_after_forward={raf}", kind="fsdp2", world=world, raf=raf, theory_stage=3)
        )
    if not memory:
        for s in (1, 2, 3):
            specs.append(dict(name=f"DeepSpeed stage {s}", kind="deepspeed", world=world, stage=s, theory_stage=s))
    return specs


def row_zero(spec: dict, a) -> dict:
    """A rayzero row's zero_optimization keys beyond ``zero_config``'s: its own, and its offload."""
    zero = dict(spec.get("zero") or {})
    if spec.get("offload") == "cpu":
        zero["offload_optimizer"] = {"device": "cpu"}
    elif spec.get("offload") == "nvme":
        zero["offload_optimizer"] = {"device": "nvme", "nvme_path": a.nvme_path}
        zero["offload_param"] = {"device": "nvme", "nvme_path": a.nvme_path}
    return zero


def setup_system(spec, model, a, world):
    kind = spec["kind"]
    if kind == "compute":
        return setup_compute_only(model, a, world)
    if kind == "ddp":
        return setup_ddp(model, a, world)
    if kind == "fsdp2":
        return setup_fsdp2(model, a, world, spec["raf"])
    if kind == "rayzero":
        return setup_rayzero(model, a, world, spec["stage"], spec.get("defaults", False), spec.get("capture"),
                             row_zero(spec, a))
    if kind == "deepspeed":
        return setup_deepspeed(model, a, world, spec["stage"])
    raise ValueError(kind)


# ---------------------------------------------------------------------------------------------------------
# One rank of one system
# ---------------------------------------------------------------------------------------------------------


def _rank_main(rank: int, world: int, port: int, spec: dict, a: argparse.Namespace, queue) -> None:
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    os.environ.update(spec.get("env", {}))
    torch.set_num_threads(1)
    global _IN_RANK
    _IN_RANK = True
    cgroup = join_own_memory_cgroup(rank) if a.memory else None
    try:
        out: dict = {"rank": rank}
        out["hwm_reset_ok"] = reset_hwm()  # drop whatever the interpreter start-up touched beyond the runtime
        out["rss_start_mib"] = rss_mib()
        if spec["kind"] != "compute":
            dist.init_process_group("gloo", rank=rank, world_size=world)
        if a.memory:
            out["malloc_mmap_threshold"] = os.environ.get("MALLOC_MMAP_THRESHOLD_")
            warm_runtime(spec["kind"])
            if dist.is_initialized():
                dist.barrier()
            out["baseline_mib"] = rss_mib()  # the rank's own floor: runtime warm, no model yet
            reset_hwm()
            cgroup_reset_peak(cgroup)
            out["cgroup_baseline"] = cgroup_read(cgroup, "memory.usage_in_bytes")
        if spec.get("zero_init"):
            import rayzero

            cfg = zero_config(a, world, spec["stage"], spec.get("defaults", False))
            cfg["zero_optimization"].update(row_zero(spec, a))
            with rayzero.zero_init(config=cfg):  # as a user passes it (DeepSpeed's zero.Init(config_dict_or_path))
                model = build_model(a.dim, a.hidden, a.blocks)  # seeds itself: the same weights as plain
        else:
            model = build_model(a.dim, a.hidden, a.blocks)
        step, destroy = setup_system(spec, model, a, world)
        out["rss_after_setup_mib"] = rss_mib()
        if a.memory:
            out["hwm_setup_mib"] = hwm_mib()
            if spec["kind"] != "rayzero":  # rayzero rows: rank_memory, in the driver (rayzero_memory_model)
                out["theory_bytes"] = design_model_state_bytes(spec, a, world)
                out["buckets_bytes"], out["buckets_how"] = bucket_allowance(spec, a, world)

        stores = swap_stores(step.engine) if hasattr(step, "engine") else []
        data = make_batches(a.warmup + a.steps, a.data_world, a.micro, a.dim)
        lo, hi = rank * a.micro, (rank + 1) * a.micro
        losses, norms, times = [], [], []
        for i, (x, y) in enumerate(data):
            if i == a.warmup:
                if stores:
                    settle(stores)  # the warm-up's last writes belong to the warm-up
                    io0 = io_counters(stores)
                if dist.is_initialized():
                    dist.barrier()
                out["hwm_setup_warmup_mib"] = hwm_mib()
                out["rss_before_timed_mib"] = rss_mib()
                reset_hwm()  # from here VmHWM is the peak of the timed steps alone
                timed_t0, busy0, own0 = time.perf_counter(), cpu_busy_s(), time.process_time()
            t0 = time.perf_counter()
            loss, norm = step(x[lo:hi], y[lo:hi])
            dt = time.perf_counter() - t0
            losses.append(float(loss))
            norms.append(_float(norm) if norm is not None else float("nan"))
            if i >= a.warmup:
                times.append(dt)
        out["hwm_timed_mib"] = hwm_mib()
        out["rss_after_timed_mib"] = rss_mib()
        out["cgroup_peak"] = cgroup_read(cgroup, "memory.max_usage_in_bytes")
        out["timed_wall_s"] = time.perf_counter() - timed_t0
        out["timed_machine_busy_s"] = cpu_busy_s() - busy0
        out["timed_own_cpu_s"] = time.process_time() - own0  # all threads of this rank (gloo's included)
        if stores:  # swap traffic of the timed steps, their last writes included, per step
            settle(stores)
            io1 = io_counters(stores)
            out["swap_stores"] = len(stores)
            out["io_per_step"] = {k: (io1[k] - io0[k]) / a.steps for k in IO_KEYS}
        del stores
        out["peak_rss_mib"] = max(out["hwm_setup_warmup_mib"], out["hwm_timed_mib"])
        out["step_s"] = times
        out["median_step_ms"] = statistics.median(times) * 1000
        if dist.is_initialized():  # the loss of the whole global batch (mean over ranks), for cross-checks
            t = torch.tensor(losses, dtype=torch.float64)
            dist.all_reduce(t)
            losses = (t / world).tolist()
        out["losses"] = losses
        out["grad_norms"] = norms
        destroy()
        queue.put((rank, "ok", pickle.dumps(out)))
    except BaseException:
        queue.put((rank, "error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _baseline_main(queue) -> None:
    """A process that imported torch (this module) and built nothing: the runtime floor of every rank.

    Also reports the floor after one tiny training step: the first ``optimizer.step()`` pulls in more of
    torch (``torch._dynamo`` among others), which every system below pays as well.
    """
    torch.set_num_threads(1)
    out = {"rss_mib": rss_mib(), "hwm_mib": hwm_mib()}
    m = torch.nn.Linear(4, 4)
    opt = torch.optim.AdamW(m.parameters())
    m(torch.randn(2, 4)).sum().backward()
    opt.step()
    out["after_tiny_step_hwm_mib"] = hwm_mib()
    queue.put((0, "ok", pickle.dumps(out)))




def run_system(spec: dict, a: argparse.Namespace) -> dict:
    world = spec["world"]
    res = {k: v for k, v in spec.items()}
    if spec["kind"] == "deepspeed":
        ok, why = deepspeed_available()
        if not ok:
            res.update(status="skipped", error=why)
            return res
    port = free_port()
    t0 = time.perf_counter()
    try:
        ranks, error = spawn(_rank_main, lambda r: (r, world, port, spec, a), world, a.timeout)
    finally:
        if a.memory:
            remove_rank_cgroups()
    res["wall_s"] = time.perf_counter() - t0
    if error is not None:
        res.update(status="error", error=error)
        return res
    res.update(
        status="ok",
        ranks=ranks,
        median_step_ms=max(r["median_step_ms"] for r in ranks),  # the slowest rank sets the pace
        peak_rss_mib=max(r["peak_rss_mib"] for r in ranks),
        timed_peak_rss_mib=max(r["hwm_timed_mib"] for r in ranks),
        # cores kept busy during the timed steps by anything other than these ranks: should be ~0
        # (None when the timed steps are too short for /proc/stat's 10 ms ticks to say anything)
        foreign_cores=max(0.0, (ranks[0]["timed_machine_busy_s"] - sum(r["timed_own_cpu_s"] for r in ranks))
                          / ranks[0]["timed_wall_s"]) if ranks[0]["timed_wall_s"] >= 1.0 else None,
        losses=ranks[0]["losses"],
        grad_norms=ranks[0]["grad_norms"],
    )
    if all("io_per_step" in r for r in ranks):  # swap traffic: every rank's, through the one disk
        slow = max(ranks, key=lambda r: r["median_step_ms"])
        res["swap_stores"] = max(r["swap_stores"] for r in ranks)
        for key in IO_KEYS:
            res[key + "_ranks"] = sum(r["io_per_step"][key] for r in ranks)
        for key in ("read_seconds", "write_seconds"):
            res[key + "_slowest"] = slow["io_per_step"][key]
    if a.memory:  # above each rank's own baseline, the largest rank
        res.update(
            mem_timed_peak_mib=max(r["hwm_timed_mib"] - r["baseline_mib"] for r in ranks),
            # VmHWM from the baseline on, never reset: set-up, warm-up and timed steps
            mem_peak_mib=max(max(r["hwm_setup_warmup_mib"], r["hwm_timed_mib"]) - r["baseline_mib"] for r in ranks),
            mem_setup_peak_mib=max(r["hwm_setup_mib"] - r["baseline_mib"] for r in ranks),
            mem_steady_mib=max(r["rss_after_timed_mib"] - r["baseline_mib"] for r in ranks),
            mem_baseline_mib=max(r["baseline_mib"] for r in ranks),
            # the kernel's charge of each rank's own cgroup over its baseline (shared pages once, for the rank that
            # touched them first); None without a writable cgroup v1
            mem_charged_peak_mib=(max((r["cgroup_peak"] - r["cgroup_baseline"]) / MIB for r in ranks)
                                  if all(r.get("cgroup_peak") is not None for r in ranks) else None),
            theory_bytes=max(r.get("theory_bytes", 0.0) for r in ranks),
            buckets_bytes=max(r.get("buckets_bytes", 0.0) for r in ranks),
            buckets_how=ranks[0].get("buckets_how", ""),
            malloc_mmap_threshold=ranks[0]["malloc_mmap_threshold"],
        )
    return res


# ---------------------------------------------------------------------------------------------------------
# Theory and report
# ---------------------------------------------------------------------------------------------------------


def theory_bytes_per_param(stage: int | None, world: int) -> float:
    """ZeRO paper figure for fp32 AdamW: weights 4 + grads 4 + Adam moments 8 bytes per parameter."""
    w = world
    return {0: 16.0, 1: 4 + 4 + 8 / w, 2: 4 + (4 + 8) / w, 3: 16 / w}[stage]


def _short_error(msg: str) -> str:
    lines = [ln.strip() for ln in msg.strip().splitlines() if ln.strip()]
    last = lines[-1] if lines else msg
    return (last[:140] + "...") if len(last) > 140 else last


def _provenance_line(p: dict) -> str:
    if "rayzero_sources_sha256" not in p:
        return f"rayzero: {p.get('error', 'unknown version')}"
    line = f"rayzero: git {p.get('git_commit', '?')}"
    if p.get("rayzero_dirty"):
        line += " + uncommitted changes in rayzero/"
    line += f", sources sha256 {p['rayzero_sources_sha256']}; torch {torch.__version__}."
    if p.get("sources_changed_during_run"):
        line += (f" WARNING: rayzero changed during the run (sources sha256 {p.get('rayzero_sources_sha256_after')} "
                 "at the end); rows may mix versions.")
    return line


def render(results: list[dict], meta: dict) -> str:
    best_of = f", best of {meta['repeat']} runs" if meta.get("repeat", 1) > 1 else ""
    ddp = next((r for r in results if r["kind"] == "ddp" and r["status"] == "ok"), None)
    comp = next((r for r in results if r["kind"] == "compute" and r["status"] == "ok"), None)
    base = meta["baseline_rss_mib"]
    lines = [
        f"Workload: {meta['blocks']} x [Linear({meta['dim']},{meta['hidden']}) -> GELU -> "
        f"Linear({meta['hidden']},{meta['dim']})] = {meta['params']:,} params, fp32, AdamW lr {meta['lr']}, "
        f"clip {meta['clip']}, micro-batch {meta['micro']}/rank, world {meta['world']} (gloo, 1 thread/rank), "
        f"{meta['warmup']} warm-up + {meta['steps']} timed steps, buckets {meta['bucket_elements']:,} elements "
        f"(rows 'config defaults': none set){best_of}"
        f"{', AdamW fused=True in every system' if meta['adam_fused'] else ''}; AdamW: compute-only fused, "
        f"rayzero fused (its default){', peers torch default (foreach)' if not meta['adam_fused'] else ', peers fused'}.",
        _provenance_line(meta.get("provenance", {})),
        f"Runtime baseline (process that imported torch, built nothing): {base:.0f} MiB RSS; after one tiny "
        f"forward/backward/AdamW step (lazy imports such as torch._dynamo): {meta['baseline_after_tiny_step_mib']:.0f} MiB.",
        "",
        "| system | step ms | x compute-only | x DDP | peak RSS MiB | timed-steps peak MiB | theory MiB (+ baseline) | other load |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in results:
        w = r["world"]
        theory = theory_bytes_per_param(r["theory_stage"], w) * meta["params"] / MIB
        fmt = ".0f" if theory >= 10 else ".2f"
        theory_s = f"{theory:{fmt}} (+{base:.0f} = {theory + base:{fmt}})"
        if r["status"] != "ok":
            lines.append(f"| {r['name']} | {r['status']}: {_short_error(r['error'])} | | | | | {theory_s} | |")
            continue
        ms = r["median_step_ms"]
        xc = f"{ms / comp['median_step_ms']:.2f}" if comp else "n/a"
        xd = f"{ms / ddp['median_step_ms']:.2f}" if ddp else "n/a"
        lines.append(
            f"| {r['name']} | {ms:.1f} | {xc} | {xd} | {r['peak_rss_mib']:.0f} | {r['timed_peak_rss_mib']:.0f} | "
            f"{theory_s} | {'-' if r['foreign_cores'] is None else format(r['foreign_cores'], '.2f')} |"
        )
    lines += [
        "",
        "step ms: median over timed steps per rank, slowest rank. peak RSS: VmHWM of the rank over set-up, "
        "warm-up and timed steps (max over ranks); timed-steps peak: VmHWM reset after warm-up. theory: ZeRO "
        "model states (fp32 weights 4 + grads 4 + AdamW 8 bytes/param; stage 1: 4+4+8/W, stage 2: 4+(4+8)/W, "
        "stage 3 and FSDP2: 16/W; DDP and compute-only: 16). Activations, communication buffers and the "
        "runtime baseline come on top. other load: cores kept busy by processes outside the bench during the "
        "timed steps (from /proc/stat); step times are only comparable where it is near 0.",
        "",
        "Cross-check (loss of the global batch, grad norm as the system reports it):",
        "",
        "| system | loss step 1 | loss last | grad norm step 1 | grad norm last |",
        "|---|---:|---:|---:|---:|",
    ]
    for r in results:
        if r["status"] != "ok":
            continue
        lines.append(
            f"| {r['name']} | {r['losses'][0]:.6f} | {r['losses'][-1]:.6f} | {r['grad_norms'][0]:.6f} | "
            f"{r['grad_norms'][-1]:.6f} |"
        )
    lines.append("")
    lines.append("compute-only trains on rank 0's half of each global batch, so its losses differ from the others.")
    return "\n".join(lines)


def memory_target(world: int) -> float:
    """Issue 27: a rayzero row's peak (set-up included) within 1.25x its memory model at world 2, 1.10x at
    worlds 3 and 4."""
    return 1.25 if world <= 2 else 1.10


NVME_TARGET = 0.6  # issue 27: optimizer and parameters on NVMe peak at most 0.6x the plain ZeRO-3 row's


def render_memory(results: list[dict], meta: dict) -> str:
    act = meta["activation_bytes"] / MIB
    live = any("mem_live_peak_mib" in r for r in results)
    lines = [
        f"Workload: {meta['blocks']} x [Linear({meta['dim']},{meta['hidden']}) -> GELU -> "
        f"Linear({meta['hidden']},{meta['dim']})] = {meta['params']:,} params, fp32, AdamW lr {meta['lr']}, "
        f"micro-batch {meta['micro']}/rank, world {meta['world']} (gloo, 1 thread/rank, one host), "
        f"{meta['warmup']} warm-up + {meta['steps']} timed steps, buckets {meta['bucket_elements']:,} elements "
        f"(rows without 'config defaults'), stage-3 persistence threshold {meta['persistence_threshold']:,}; "
        f"glibc settings in the environment: {meta['malloc_env']}.",
        _provenance_line(meta.get("provenance", {})),
        "",
        "| system | model states | transient | swap pools | host-shared | model total | set-up peak | "
        "timed-steps peak | peak | peak / model |" + (" live-tensors peak |" if live else ""),
        "|---|" + "---:|" * (9 + (1 if live else 0)),
    ]
    notes = []
    plain = next((r for r in results if r["name"] == "rayzero stage 3, zero_init, config defaults"
                  and r["status"] == "ok"), None)
    for r in results:
        if r["status"] != "ok":
            lines.append(f"| {r['name']} | {r['status']}: {_short_error(r['error'])} |")
            continue
        m = r.get("model")
        if m is not None:  # rayzero: rayzero.memory.rank_memory
            states, transient = m.model_states() / MIB, m.transient() / MIB
            pools, shared, total = m.swap_pool / MIB, m.host_shared / MIB, m.total() / MIB
        else:
            states, transient = r["theory_bytes"] / MIB, act + r["buckets_bytes"] / MIB
            pools = shared = 0.0
            total = states + transient
            notes.append(f"- {r['name']}: transient = activations + {r['buckets_how']}")
        ratio = r["mem_peak_mib"] / total
        flag = "" if r["kind"] != "rayzero" or ratio <= memory_target(r["world"]) else " **over**"
        row = (f"| {r['name']} | {states:.0f} | {transient:.0f} | {pools:.0f} | {shared:.0f} | {total:.0f} | "
               f"{r['mem_setup_peak_mib']:.0f} | {r['mem_timed_peak_mib']:.0f} | {r['mem_peak_mib']:.0f} | "
               f"{ratio:.2f}{flag} |")
        if live:
            row += f" {r.get('mem_live_peak_mib', float('nan')):.0f} |"
        lines.append(row)
    if plain is not None:
        for r in results:
            if r["status"] == "ok" and r.get("offload"):
                x = r["mem_peak_mib"] / plain["mem_peak_mib"]
                target = f" (target <= {NVME_TARGET})" if r["offload"] == "nvme" else ""
                notes.append(f"- {r['name']}: peak {x:.2f}x the plain ZeRO-3 row's (config defaults){target}"
                             + (" **over**" if r["offload"] == "nvme" and x > NVME_TARGET else ""))
    lines += render_swap_against_disk(results, meta)
    lines += [
        "",
        "Every figure is MiB above the rank's own baseline (RSS once the runtime is warm: torch, the process "
        f"group, one tiny AdamW step of each kernel; ~{meta['baseline_mib']:.0f} MiB), the largest rank, in the "
        "environment a user has (glibc as it comes, plus what rayzero sets by itself). set-up peak: VmHWM from the "
        "baseline through building the model and the system; timed-steps peak: VmHWM reset after the warm-up "
        "steps; peak: VmHWM from the baseline on, set-up, warm-up and timed steps together. model: for rayzero "
        "rayzero.memory.rank_memory for the row's config (model states; transient = stage 3's gathered units, "
        "the reduce buckets in flight, autograd's largest gradient before it reaches a bucket, activations; swap "
        "pools; host-shared = the weights one copy per host keeps for its ranks, which every rank maps and so "
        "counts in its VmHWM); DDP 16 and FSDP2 16/W bytes per parameter plus their buckets. activations: what "
        "autograd saves for backward on one micro-batch, parameters excluded. The JSON also keeps each rank's "
        "cgroup v1 charge (mem_charged_peak_mib; it counts kernel memory too). live-tensors (--live-tensors): the same row run again "
        "with MALLOC_MMAP_THRESHOLD_=65536, so every large free goes back to the OS at once. Targets (issue 27): "
        "rayzero peak / model <= 1.25 at world 2, <= 1.10 at worlds 3-4; with optimizer and parameters on NVMe "
        f"peak <= {NVME_TARGET}x the plain ZeRO-3 row's.",
        "",
        *notes,
    ]
    return "\n".join(lines)


def render_swap_against_disk(results: list[dict], meta: dict) -> list[str]:
    """The rows that swap to NVMe against the disk's raw O_DIRECT throughput (bench_offload.py has the same table
    for its rows; the step times here are those of this memory run)."""
    disk = meta.get("disk")
    rows = [r for r in results if r["status"] == "ok" and "floor_over_step" in r]
    if disk is None or not rows:
        return []
    lines = [
        "",
        f"Swap traffic against the disk ({disk['streams']} dd streams at once on {disk['directory']}, "
        f"{disk['size_mb']} MiB each, bs={disk['bs_mb']}M, median of {disk['repeat']}: read {disk['read_gbs']:.2f} "
        f"GB/s, rewrite in place {disk['rewrite_gbs']:.2f} GB/s):",
        "",
        "| system | swap MiB/step read / written (all ranks) | I/O floor ms | step ms | floor / step | "
        "store I/O ms read + write (slowest rank) |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        ms = lambda s: f"{s * 1000:.0f}" if s >= 0.01 else f"{s * 1000:.2f}"
        rd, wr = r["read_seconds_slowest"], r["write_seconds_slowest"]
        lines.append(f"| {r['name']} | {r['bytes_read_ranks'] / MIB:.1f} / {r['bytes_written_ranks'] / MIB:.1f} | "
                     f"{ms(r['io_floor_s'])} | {r['median_step_ms']:.0f} | {r['floor_over_step']:.2f} | "
                     f"{ms(rd + wr)} ({ms(rd)} + {ms(wr)}) |")
    lines += [
        "",
        "swap MiB/step: the byte counters of every swap store the rank's engine holds (swap_traffic.swap_stores) "
        "over the timed steps, their last writes included, per step, summed over the ranks; I/O floor: read "
        "bytes / raw read + written bytes / raw rewrite; floor / step: 1.00 = the step is as fast as the disk "
        "allows (bench/README.md, bench_offload's 'NVMe rows against the disk').",
    ]
    return lines


def source_provenance() -> dict:
    """Which rayzero the ranks imported: git commit, whether rayzero/ differs from it, a hash of its sources.

    Read-only git calls (``--no-optional-locks``: no index refresh).  The hash is taken before and after
    the run; a difference means rayzero changed while the bench ran and the rows may mix versions.
    """
    import hashlib
    import subprocess

    try:
        import rayzero

        root = os.path.dirname(os.path.abspath(rayzero.__file__))
    except Exception as e:
        return {"error": f"{type(e).__name__}: {e}"}
    h = hashlib.sha256()
    for dirpath, dirnames, filenames in sorted(os.walk(root)):
        dirnames.sort()
        for name in sorted(filenames):
            if name.endswith(".py"):
                path = os.path.join(dirpath, name)
                h.update(os.path.relpath(path, root).encode())
                with open(path, "rb") as f:
                    h.update(f.read())
    out = {"rayzero_path": root, "rayzero_sources_sha256": h.hexdigest()[:16]}
    repo = os.path.dirname(root)

    def git(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(["git", "--no-optional-locks", "-C", repo, *args], capture_output=True, text=True,
                              timeout=20)

    try:
        head = git("rev-parse", "--short", "HEAD")
        if head.returncode == 0:
            out["git_commit"] = head.stdout.strip()
            out["rayzero_dirty"] = git("diff", "--quiet", "HEAD", "--", "rayzero").returncode != 0
    except (OSError, subprocess.SubprocessError):
        pass
    return out


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=None, help="timed steps per system (default 10; --quick: 3)")
    p.add_argument("--warmup", type=int, default=None, help="warm-up steps per system (default 3; --quick: 1)")
    p.add_argument("--quick", action="store_true", help="tiny model, 3 steps: a smoke test of every code path")
    p.add_argument("--json", default=None, help="also write the results as JSON to this path")
    p.add_argument("--world", type=int, default=2, help="ranks per distributed system (default 2)")
    p.add_argument("--only", default=None, help="comma-separated substrings: run only systems whose name matches")
    p.add_argument("--timeout", type=float, default=None, help="seconds per system before it is reported as hung")
    p.add_argument("--bucket-elements", type=int, default=None,
                   help="reduce/all-gather bucket size in elements for rayzero and DeepSpeed, and DDP's "
                        "bucket_cap_mb (x4 bytes); default 6,553,600 = DDP's 25 MiB")
    p.add_argument("--repeat", type=int, default=1,
                   help="run every system this many times, one after another in turn; each row is its fastest run")
    p.add_argument("--hidden", type=int, default=None,
                   help="hidden width of each block (default 4096; 320 gives a model ten times smaller)")
    p.add_argument("--memory", action="store_true",
                   help="measure peak RSS of the timed steps against ZeRO theory instead of speed (ranks run "
                        "with MALLOC_MMAP_THRESHOLD_=65536; default 2 warm-up + 3 timed steps)")
    p.add_argument("--live-tensors", action="store_true",
                   help="with --memory: run every system a second time with MALLOC_MMAP_THRESHOLD_=65536 (glibc "
                        "then returns every large free to the OS, so RSS follows the live tensors) and report that "
                        "peak as a second column; the first column is always the environment a user has")
    p.add_argument("--nvme-path", default=os.path.join(tempfile.gettempdir(), "rayzero-bench-swap"),
                   help="with --memory: the directory the NVMe offload row swaps under (a local disk)")
    p.add_argument("--disk-mb", type=int, default=None,
                   help="MiB per dd stream for the disk's raw O_DIRECT throughput on --nvme-path, measured once "
                        "before the rows when a row swaps to NVMe (0 skips it; default 256, --quick 64)")
    p.add_argument("--adam-fused", action="store_true",
                   help="AdamW(fused=True) in every system (default: each system's own default; rayzero's is fused)")
    a = p.parse_args(argv)
    if a.quick:
        a.dim, a.hidden, a.blocks = 32, 128, 2
        a.steps = 3 if a.steps is None else a.steps
        a.warmup = 1 if a.warmup is None else a.warmup
        a.bucket_elements = a.bucket_elements or 3000  # several buckets; each weight (4096) is bigger than one
        a.persistence_threshold = 64  # weights gathered, small biases persistent: both stage-3 paths run
        a.timeout = a.timeout or 120.0
        a.disk_mb = 64 if a.disk_mb is None else a.disk_mb
    else:
        a.dim, a.hidden, a.blocks = 1024, a.hidden or 4096, 4
        a.steps = (3 if a.memory else 10) if a.steps is None else a.steps
        a.warmup = (2 if a.memory else 3) if a.warmup is None else a.warmup
        a.bucket_elements = a.bucket_elements or 25 * MIB // 4
        a.persistence_threshold = 100_000  # rayzero/DeepSpeed default: biases stay whole, weights shard
        a.timeout = a.timeout or 600.0
        a.disk_mb = 256 if a.disk_mb is None else a.disk_mb
    if a.steps < 1 or a.warmup < 0:
        p.error("--steps must be >= 1 and --warmup >= 0")
    a.micro, a.lr, a.clip = 8, 1e-4, 1.0
    a.data_world = a.world  # the compute-only run reads rank 0's slice of the same global batches
    return a


def main(argv=None) -> int:
    a = parse_args(argv)
    meta = dict(
        dim=a.dim, hidden=a.hidden, blocks=a.blocks, params=param_count(a.dim, a.hidden, a.blocks), lr=a.lr,
        clip=a.clip, micro=a.micro, world=a.world, warmup=a.warmup, steps=a.steps, quick=a.quick,
        bucket_elements=a.bucket_elements, persistence_threshold=a.persistence_threshold, adam_fused=a.adam_fused,
        repeat=a.repeat,
        torch=torch.__version__, python=sys.version.split()[0], cpus=os.cpu_count(),
        command=" ".join([os.path.basename(sys.executable), *sys.argv]),
    )
    meta["provenance"] = source_provenance()
    if a.memory:
        # the environment a user has: glibc's settings as they are (and whatever rayzero sets by itself)
        chosen = {k: v for k, v in os.environ.items() if k.startswith("MALLOC_")}
        meta["malloc_env"] = ", ".join(f"{k}={v}" for k, v in sorted(chosen.items())) or "none set"
        meta["activation_bytes"] = saved_activation_bytes(a)
    base, err = spawn(_baseline_main, lambda r: (), 1, 60.0)
    meta["baseline_rss_mib"] = base[0]["hwm_mib"] if base else float("nan")
    meta["baseline_after_tiny_step_mib"] = base[0]["after_tiny_step_hwm_mib"] if base else float("nan")
    if err:
        print(f"runtime baseline probe failed: {err}", file=sys.stderr)

    specs = system_specs(a.world, a.memory)
    if a.only:
        keys = [k.strip().lower() for k in a.only.split(",") if k.strip()]
        specs = [s for s in specs if any(k in s["name"].lower() for k in keys)]
    meta["disk"] = None
    if a.disk_mb > 0 and any(s.get("offload") == "nvme" for s in specs):
        from bench_swap import disk_for_swap

        os.makedirs(a.nvme_path, exist_ok=True)
        print(f"[bench] disk: raw O_DIRECT throughput, {a.world} dd stream(s) x {a.disk_mb} MiB ...", file=sys.stderr,
              flush=True)
        meta["disk"] = disk_for_swap(a.nvme_path, a.disk_mb, a.world)
    results = []
    for spec in specs * a.repeat:  # --repeat: every system once, then again; each row keeps its best run
        print(f"[bench] {spec['name']} ...", file=sys.stderr, flush=True)
        r = run_system(spec, a)
        if a.memory and a.live_tensors and r["status"] == "ok":
            # the same system again with every large free going back to the OS (read by glibc at each rank's
            # start): what the live tensors reach, without what the allocator keeps
            saved = os.environ.get("MALLOC_MMAP_THRESHOLD_")
            os.environ["MALLOC_MMAP_THRESHOLD_"] = "65536"
            try:
                live = run_system(spec, a)
            finally:
                if saved is None:
                    os.environ.pop("MALLOC_MMAP_THRESHOLD_", None)
                else:
                    os.environ["MALLOC_MMAP_THRESHOLD_"] = saved
            r["mem_live_peak_mib"] = live["mem_peak_mib"] if live["status"] == "ok" else float("nan")
        msg = f"{r['median_step_ms']:.1f} ms/step, peak {r['peak_rss_mib']:.0f} MiB" if r["status"] == "ok" else (
            f"{r['status']}: {_short_error(r['error'])}")
        if a.memory and r["status"] == "ok":
            msg += (f", peak {r['mem_peak_mib']:.0f} MiB above the rank's baseline (set-up included; timed steps "
                    f"{r['mem_timed_peak_mib']:.0f})")
        print(f"[bench]   {msg}", file=sys.stderr, flush=True)
        if r["status"] == "error":
            print(r["error"], file=sys.stderr, flush=True)
        prev = next((i for i, q in enumerate(results) if q["name"] == r["name"]), None)
        if prev is None:
            results.append(r)
        elif r["status"] == "ok" and (results[prev]["status"] != "ok"
                                      or r["median_step_ms"] < results[prev]["median_step_ms"]):
            results[prev] = r

    for r in results:
        add_disk_ratio(r, meta["disk"])
    after = source_provenance().get("rayzero_sources_sha256")
    meta["provenance"]["rayzero_sources_sha256_after"] = after
    meta["provenance"]["sources_changed_during_run"] = after != meta["provenance"].get("rayzero_sources_sha256")
    if meta["provenance"]["sources_changed_during_run"]:
        print("[bench] WARNING: rayzero's sources changed while the bench ran; rows may mix versions. Re-run.",
              file=sys.stderr, flush=True)
    busy = [r["name"] for r in results if r["status"] == "ok" and (r["foreign_cores"] or 0.0) > 0.25]
    if busy and not a.memory:  # (memory mode reports no step times)
        print(f"[bench] WARNING: other processes used CPU during: {', '.join(busy)}; their step times are "
              "inflated. Re-run on an idle machine.", file=sys.stderr, flush=True)
    if a.memory:
        meta["baseline_mib"] = max((r["mem_baseline_mib"] for r in results if r["status"] == "ok"), default=float("nan"))
        for r in results:
            if r["kind"] == "rayzero":
                r["model"] = rayzero_memory_model(r, a, r["world"], meta["activation_bytes"])
    if a.memory:
        try:
            os.rmdir(_cgroup_parent())
        except OSError:
            pass
    print(render_memory(results, meta) if a.memory else render(results, meta))
    if a.json:
        for r in results:
            r["theory_mib"] = theory_bytes_per_param(r["theory_stage"], r["world"]) * meta["params"] / MIB
        with open(a.json, "w") as f:
            json.dump({"meta": meta, "results": results}, f, indent=1, default=str)
        print(f"\nJSON written to {a.json}")
    return 0 if all(r["status"] in ("ok", "skipped") for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
