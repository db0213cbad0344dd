"""Stand-in accelerators for CPU tests of the engine's device path.

* :class:`StandInAccelerator` computes on the CPU, but keeps a random generator of its own (as a GPU
  does), counts how often it is synchronized and records ``set_device``.
  Its streams and events (:class:`StandInStream`, :class:`StandInEvent`) record the order of work as a
  device would see it: which stream is current (so a copy can be traced to the stream it ran on, see
  :class:`CopyLog`), the device-side waits (``stream.wait_event``) and the host waits
  (``event.synchronize()``, ``stream.synchronize()``, ``synchronize()``), counted in ``host_waits``.
  ``pin_memory`` cannot pin on a CPU-only build (torch 2.13 raises NotImplementedError for
  ``Tensor.pin_memory()`` once a PrivateUse1 device is registered without a pinned-memory allocator), so it
  returns a copy marked as pinned, which ``is_pinned`` reports; ``available_memory`` can be set.
* :class:`StandInDeviceAccelerator` is the same with its tensors on the ``standin`` device
  (tests/standin_device.py: a second device kind whose values sit in CPU memory) and its process groups on
  the ``standin`` backend, which refuses host tensors as NCCL does.  ZeRO stage 3 resizes parameter
  storages, which a device registered from Python cannot do, so stage 3 runs on the first one.
"""

from __future__ import annotations

import contextlib
import os
import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from rayzero.accelerator.cpu import CpuAccelerator

import standin_device


class StandInEvent:
    """An event of the stand-in: records the stream it was recorded on; a host wait is counted."""

    def __init__(self, acc: "StandInAccelerator", enable_timing: bool = False) -> None:
        self.acc = acc
        self.stream: StandInStream | None = None
        self.id = acc._next_id()
        self.done = False  # known finished: only a host wait tells (the conservative device)

    def record(self, stream=None) -> None:
        self.stream = stream if stream is not None else self.acc.current_stream()
        self.stream.recorded.append(self)
        self.acc.log.append(("record", self.stream.name, self.id))

    def wait(self, stream=None) -> None:
        (stream if stream is not None else self.acc.current_stream()).wait_event(self)

    def synchronize(self) -> None:
        self.acc.host_waits += 1
        self.acc.log.append(("host_wait", self.stream.name if self.stream else None, self.id))
        if self.stream is not None:  # what was queued before it on its stream has finished too
            for e in self.stream.recorded[: self.stream.recorded.index(self) + 1]:
                e.done = True

    def query(self) -> bool:
        return self.done

    def elapsed_time(self, end_event) -> float:
        return 0.0


class StandInStream:
    """A stream of the stand-in: work runs at once (on the CPU), but every wait is logged."""

    def __init__(self, acc: "StandInAccelerator", name: str) -> None:
        self.acc = acc
        self.name = name
        self.recorded: list[StandInEvent] = []

    def synchronize(self) -> None:
        self.acc.host_waits += 1
        self.acc.log.append(("host_wait", self.name, None))
        for e in self.recorded:
            e.done = True

    def wait_stream(self, stream) -> None:
        self.acc.log.append(("wait_stream", self.name, stream.name))

    def wait_event(self, event) -> None:
        self.acc.log.append(("wait_event", self.name, event.id))

    def record_event(self, event=None):
        event = event if event is not None else StandInEvent(self.acc)
        event.record(self)
        return event

    def query(self) -> bool:
        return all(e.done for e in self.recorded)

    def __repr__(self) -> str:
        return f"StandInStream({self.name})"


class StandInAccelerator(CpuAccelerator):
    name = "standin"

    def __init__(self) -> None:
        super().__init__()
        self.index = 0
        self.generator = torch.Generator().manual_seed(99)  # the "device's" generator
        self.synchronized = 0
        self.set_devices: list[int] = []
        self.log: list[tuple] = []  # records, stream waits, host waits, record_stream, in order
        self.host_waits = 0
        self._ids = 0
        self.compute = StandInStream(self, "compute")
        self._current = self.compute
        self.streams: list[StandInStream] = []
        self._pinned: dict[int, weakref.ref] = {}  # storage address -> the pinned storage's tensor
        self.free_memory: int | None = None  # what available_memory reports when set

    def _next_id(self) -> int:
        self._ids += 1
        return self._ids

    # ---- streams and events: ordering recorded ----------------------------------------------------------
    def stream(self, index: int | None = None) -> StandInStream:
        s = StandInStream(self, f"side{len(self.streams)}")
        self.streams.append(s)
        return s

    def current_stream(self, index: int | None = None) -> StandInStream:
        return self._current

    @contextlib.contextmanager
    def stream_context(self, stream):
        before = self._current
        self._current = stream if stream is not None else before
        try:
            yield stream
        finally:
            self._current = before

    def Event(self, enable_timing: bool = False) -> StandInEvent:  # noqa: N802 - mirrors torch.cuda.Event
        return StandInEvent(self, enable_timing)

    def record_stream(self, tensor: torch.Tensor, stream) -> None:
        self.log.append(("record_stream", stream.name, None))

    # ---- pinned memory: marked, as real pinning is impossible without a driver -------------------------
    def pin_memory(self, tensor: torch.Tensor) -> torch.Tensor:
        if tensor.device.type != "cpu" or self.is_pinned(tensor):
            return tensor
        pinned = tensor.clone()
        self._pinned[pinned.untyped_storage().data_ptr()] = weakref.ref(pinned)
        return pinned

    def mark_pinned(self, tensor: torch.Tensor) -> None:
        """Count ``tensor``'s storage as pinned where it is (a partition the engine allocated)."""
        self._pinned[tensor.untyped_storage().data_ptr()] = weakref.ref(tensor)

    def is_pinned(self, tensor: torch.Tensor) -> bool:
        if tensor.device.type != "cpu":
            return False
        ref = self._pinned.get(tensor.untyped_storage().data_ptr())
        return ref is not None and ref() is not None

    def available_memory(self, index: int | None = None) -> int:
        return self.free_memory if self.free_memory is not None else super().available_memory(index)

    def current_device_index(self) -> int:
        return self.index

    def set_device(self, index: int) -> None:
        self.set_devices.append(index)
        self.index = index

    def device_count(self) -> int:
        return 2  # a two-device node: LOCAL_RANK picks the device

    def synchronize(self, index: int | None = None) -> None:
        self.synchronized += 1
        self.host_waits += 1
        self.log.append(("host_wait", "device", None))
        for s in [self.compute] + self.streams:
            for e in s.recorded:
                e.done = True

    def manual_seed(self, seed: int) -> None:
        super().manual_seed(seed)
        self.generator.manual_seed(seed)

    def get_rng_state(self, index: int | None = None) -> torch.Tensor:
        return self.generator.get_state()

    def set_rng_state(self, state: torch.Tensor, index: int | None = None) -> None:
        self.generator.set_state(state)


class StandInDeviceAccelerator(StandInAccelerator):
    def __init__(self) -> None:
        super().__init__()
        standin_device.install()

    def device(self, index: int | None = None) -> torch.device:
        return torch.device(standin_device.DEVICE, self.index if index is None else index)

    def communication_backend(self) -> str:
        return standin_device.DEVICE


class CopyLog(TorchDispatchMode):
    """Records every copy between host and device: the stream current when it ran, whether it was
    ``non_blocking``, and whether its host side was pinned (per ``acc``).  For the stand-in whose "device" is
    the CPU (``cpu_device``), the copies to the device are the ``copy_`` calls out of pinned host memory."""

    def __init__(self, acc: StandInAccelerator, cpu_device: bool = False) -> None:
        super().__init__()
        self.acc = acc
        self.cpu_device = cpu_device
        self.copies: list[dict] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func._opname
        if name in ("copy_", "_to_copy") and isinstance(args[0], torch.Tensor):
            src = args[1] if name == "copy_" else args[0]
            dst_device = args[0].device if name == "copy_" else torch.device(kwargs.get("device") or src.device)
            if self.cpu_device and name == "copy_" and self.acc.is_pinned(src):
                self.copies.append({"to": "device", "stream": self.acc.current_stream().name,
                                    "non_blocking": bool(args[2] if len(args) > 2 else kwargs.get("non_blocking", False)),
                                    "pinned": True})
            elif src.device.type != dst_device.type:
                host = args[0] if dst_device.type == "cpu" else src
                self.copies.append({
                    "to": dst_device.type, "stream": self.acc.current_stream().name,
                    "non_blocking": bool(args[2] if name == "copy_" and len(args) > 2 else kwargs.get("non_blocking", False)),
                    "pinned": self.acc.is_pinned(host) if name == "copy_" else False,
                })
        return func(*args, **kwargs)


def use_standin(on_device: bool = False) -> StandInAccelerator:
    """Make a stand-in this process's accelerator.  ``on_device``: the one on the ``standin`` device, whose
    ranks then join a ``standin`` process group (run such cases with ``run_distributed(..., init_pg=False)``)."""
    import torch.distributed as dist

    from rayzero.accelerator import get_accelerator, register_accelerator

    register_accelerator("standin", StandInDeviceAccelerator if on_device else StandInAccelerator, replace=True)
    os.environ["RAYZERO_ACCELERATOR"] = "standin"
    acc = get_accelerator()
    if on_device and not dist.is_initialized():
        dist.init_process_group(standin_device.DEVICE, rank=int(os.environ["RANK"]),
                                world_size=int(os.environ["WORLD_SIZE"]))
    return acc


def rng_and_timers(rank: int, world: int, ckpt: str) -> dict:
    """Save with the device generator at one state, move it on, load: it is back.  Then the wall-clock
    breakdown's timers wait for the device (one synchronize per clock reading)."""
    import rayzero
    from zero_cases import base_config, batches, make_model

    acc = use_standin(on_device=True)
    engine = rayzero.initialize(make_model(), base_config(1, world, 4))
    torch.randn(3, generator=acc.generator)  # the device stream moves during training
    saved = acc.get_rng_state().clone()
    engine.save_checkpoint(ckpt, tag="t")
    torch.randn(5, generator=acc.generator)
    moved = acc.get_rng_state().clone()
    engine.load_checkpoint(ckpt, tag="t")
    restored = acc.get_rng_state().clone()
    engine.destroy()

    counts = {}
    for breakdown in (False, True):
        engine = rayzero.initialize(make_model(), base_config(1, world, 4, wall_clock_breakdown=breakdown))
        x, y = (t.to(acc.device()) for t in batches(1, 4)[0])
        before = acc.synchronized
        engine.backward(torch.nn.functional.mse_loss(engine(x[rank * 2 : rank * 2 + 2]), y[rank * 2 : rank * 2 + 2]))
        engine.step()
        counts[breakdown] = acc.synchronized - before
        engine.destroy()
    return {"saved": saved, "moved": moved, "restored": restored, "accelerator": acc.name, "syncs": counts}


def off_cpu_path(rank: int, world: int, standin: bool) -> dict:
    """Stage 3 on a model built under zero_init, through the off-CPU set-up (set_device from LOCAL_RANK,
    the model and zero_init's shards placed on the accelerator's device) with the stand-in, or on the CPU
    accelerator: the two must train alike."""
    import rayzero
    from zero_cases import base_config, batches, make_model

    os.environ["LOCAL_RANK"] = str(rank)
    acc = use_standin() if standin else None
    with rayzero.zero_init():
        model = make_model()
    engine = rayzero.initialize(model, base_config(3, world, 4))
    norms = []
    device = acc.device() if acc else torch.device("cpu")
    for x, y in batches(3, 4):
        x, y = x.to(device), y.to(device)
        engine.backward(torch.nn.functional.mse_loss(engine(x[rank * 2 : rank * 2 + 2]), y[rank * 2 : rank * 2 + 2]))
        engine.step()
        norms.append(engine.global_grad_norm)
    out = {"norms": norms, "state": engine.full_state_dict(), "set_devices": acc.set_devices if acc else None}
    engine.destroy()
    return out


def backend_refuses_host_tensors(rank: int, world: int) -> dict:
    """The stand-in device and backend themselves: device collectives work, host tensors are refused."""
    import torch.distributed as dist

    acc = use_standin(on_device=True)
    summed = torch.full((3,), float(rank + 1), device=acc.device())
    dist.all_reduce(summed)
    refused = {}
    for what, call in {
        "collective": lambda: dist.all_reduce(torch.ones(3)),
        "operator": lambda: summed + torch.ones(3),
    }.items():
        try:
            call()
            refused[what] = None
        except standin_device.HostTensorError as e:
            refused[what] = str(e)
    return {"device": str(summed.device), "summed": summed.cpu(), "refused": refused}


def device_training(rank: int, world: int, stage: int, on_device: bool, ckpt: str, offload: bool | str = False) -> dict:
    """Three steps of two micro-batches with clipping, a save, a load into a fresh engine and one more
    step, on the stand-in device (``on_device``) or the CPU; ``offload``: the optimizer in host memory
    (True), or ``"nvme"``: in swap files (the gradients go there too, from the device through the host)."""
    import rayzero
    from zero_cases import base_config, batches, make_model

    acc = use_standin(on_device=True) if on_device else None
    device = acc.device() if acc else torch.device("cpu")
    cfg = base_config(stage, world, 8, gas=2)
    if offload == "nvme":
        swap = ckpt + "-swap"
        cfg["zero_optimization"]["offload_optimizer"] = {"device": "nvme", "nvme_path": swap}
        cfg["zero_optimization"]["sub_group_size"] = 2000  # several sub-groups, each swapped on its own
    elif offload:
        cfg["zero_optimization"]["offload_optimizer"] = {"device": "cpu"}
    data = batches(4, 8)
    engine = rayzero.initialize(make_model(), cfg)
    norms, losses = [], []

    def step(engine, x, y) -> None:
        for micro in range(2):
            rows = slice(rank * 4 + micro * 2, rank * 4 + micro * 2 + 2)
            loss = torch.nn.functional.mse_loss(engine(x[rows].to(device)), y[rows].to(device))
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
        norms.append(engine.global_grad_norm)

    for x, y in data[:3]:
        step(engine, x, y)
    engine.save_checkpoint(ckpt, tag="t")
    engine.destroy()
    engine = rayzero.initialize(make_model(seed=5), cfg)
    engine.load_checkpoint(ckpt, tag="t")
    step(engine, *data[3])
    state = {k: v.cpu() for k, v in engine.full_state_dict().items()}
    devices = sorted({str(p.device) for p in engine.module.parameters()})
    engine.destroy()
    return {"norms": norms, "losses": losses, "state": state, "devices": devices}


def parallel_on_device(rank: int, world: int, on_device: bool, model: str, ep: int = 1, tp: int = 1) -> dict:
    """A tiny transformers model (tests/moe_cases.py) under AutoEP / AutoTP at stage 2, on the stand-in
    device or the CPU: losses, norms and the consolidated weights."""
    import rayzero
    from moe_cases import MODELS, batches, engine_config

    acc = use_standin(on_device=True) if on_device else None
    device = acc.device() if acc else torch.device("cpu")
    engine = rayzero.initialize(MODELS[model](), engine_config(2, ep=ep, tp=tp))
    data = batches(2, engine.dp_world_size, 2)
    losses, norms = [], []
    for step in range(2):
        ids = data[step, 0, engine.dp_rank].to(device)
        out = engine(input_ids=ids, labels=ids)
        engine.backward(out.loss)
        engine.step()
        losses.append(out.loss.item())
        norms.append(engine.global_grad_norm)
    weights = {k: v.cpu() for k, v in engine.full_state_dict().items()}
    engine.destroy()
    return {"losses": losses, "norms": norms, "weights": weights}


# ---- copies between host and device (tests/test_device_streams.py) --------------------------------------


def _train(engine, rank: int, device, data, on_step=None) -> tuple[list, list]:
    """Steps of two micro-batches each (four samples per rank per step); ``on_step(i)`` after each step."""
    losses, norms = [], []
    for i, (x, y) in enumerate(data):
        for micro in range(2):
            rows = slice(rank * 4 + micro * 2, rank * 4 + micro * 2 + 2)
            loss = torch.nn.functional.mse_loss(engine(x[rows].to(device)), y[rows].to(device))
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
        norms.append(engine.global_grad_norm)
        if on_step is not None:
            on_step(i)
    return losses, norms


def stage3_staged_training(rank: int, world: int, mode: str, bf16: bool) -> dict:
    """Stage 3 with the optimizer offloaded to the CPU, three steps of two micro-batches.  ``mode`` "cpu":
    the CPU accelerator (gathers cast host shards with ``.to``); "pinned" / "unpinned": the stand-in
    accelerator, the gathers' host shards going through HostStaging's pinned buffers and its copy stream
    (``through_buffer``), with the master partitions marked pinned ("pinned": fp32 shards are then copied
    straight from them) or not."""
    import rayzero
    from rayzero.offload.staging import HostStaging
    from zero_cases import base_config, batches, make_model

    acc = use_standin() if mode != "cpu" else None
    extra = {"bf16": {"enabled": True}} if bf16 else {}
    cfg = base_config(3, world, 8, gas=2, **extra)
    cfg["zero_optimization"]["offload_optimizer"] = {"device": "cpu", "pin_memory": mode == "pinned"}
    cfg["zero_optimization"]["stage3_share_weights"] = False  # gathered, as across hosts or on a device
    engine = rayzero.initialize(make_model(), cfg)
    out: dict = {}
    if acc is not None:
        if mode == "pinned":
            for g in engine.partitions.groups:
                acc.mark_pinned(g.master)
        engine.gatherer.staging = HostStaging("cpu", engine.compute_dtype, acc, through_buffer=True)
        log = CopyLog(acc, cpu_device=True)
        waits = []
        before = [acc.host_waits]

        def on_step(i):
            waits.append(acc.host_waits - before[0])
            before[0] = acc.host_waits

        with log:
            losses, norms = _train(engine, rank, torch.device("cpu"), batches(3, 8), on_step)
        staging = engine.gatherer.staging
        out.update(copies=log.copies, waits_per_step=waits, sends=staging.sends, direct=staging.direct.records,
                   copy_stream=staging.copy_stream.name,
                   buffers_pinned=[acc.is_pinned(b) for b in staging.buffers], log=list(acc.log))
    else:
        losses, norms = _train(engine, rank, torch.device("cpu"), batches(3, 8))
    out.update(losses=losses, norms=norms, state=engine.full_state_dict())
    engine.destroy()
    return out


def offload_copies(rank: int, world: int, on_device: bool, pin: bool, bucket: int = 500) -> dict:
    """Stage 2 with the optimizer offloaded to the CPU, on the stand-in device or the CPU: three steps of two
    micro-batches.  On the device, every copy between host and device is logged (CopyLog) with the step it
    ran in, and the host waits are counted per step."""
    import rayzero
    from zero_cases import base_config, batches, make_model

    acc = use_standin(on_device=True) if on_device else None
    device = acc.device() if acc else torch.device("cpu")
    cfg = base_config(2, world, 8, gas=2)
    cfg["zero_optimization"]["reduce_bucket_size"] = bucket
    cfg["zero_optimization"]["offload_optimizer"] = {"device": "cpu", "pin_memory": pin}
    engine = rayzero.initialize(make_model(), cfg)
    out: dict = {}
    if acc is not None:
        log = CopyLog(acc)
        steps: list[dict] = []
        mark = [0, acc.host_waits, getattr(engine.reducer, "host_waits", 0)]

        def on_step(i):
            steps.append({"copies": log.copies[mark[0]:], "host_waits": acc.host_waits - mark[1],
                          "reducer_waits": getattr(engine.reducer, "host_waits", 0) - mark[2]})
            mark[:] = [len(log.copies), acc.host_waits, getattr(engine.reducer, "host_waits", 0)]

        with log:
            losses, norms = _train(engine, rank, device, batches(3, 8), on_step)
        out.update(steps=steps, buckets=len(engine.reducer.buckets),
                   params=sum(len(m) for _, m in engine.publisher.buckets),
                   masters_pinned=[acc.is_pinned(g.master) for g in engine.partitions.groups])
    else:
        losses, norms = _train(engine, rank, device, batches(3, 8))
    out.update(losses=losses, norms=norms, state={k: v.cpu() for k, v in engine.full_state_dict().items()})
    engine.destroy()
    return out


def async_save_on_device(rank: int, world: int, sync_dir: str, async_dir: str, hold_s: float) -> dict:
    """On the stand-in device at stage 1: save one step synchronously and asynchronously (the save's thread
    held back ``hold_s`` so the next step must wait for its copies), train on meanwhile; returns the copies
    the async save made in save_checkpoint (CopyLog) and the ordering log of that call."""
    import time

    import rayzero
    from rayzero.checkpoint import engine_io
    from zero_cases import base_config, batches, make_model

    acc = use_standin(on_device=True)
    device = acc.device()
    engine = rayzero.initialize(make_model(), base_config(1, world, 8, gas=2))
    _train(engine, rank, device, batches(2, 8))
    engine.save_checkpoint(sync_dir, tag="t")
    start_thread = engine_io.BackgroundSave
    engine_io.BackgroundSave = lambda work: start_thread(lambda: (time.sleep(hold_s), work()))
    # the copies are logged inside the snapshot and the device copies it queues (torch 2.13 cannot make a
    # tensor on a PrivateUse1 device from data under a dispatch mode, which the save's collectives do)
    log = CopyLog(acc)
    originals = {name: getattr(engine_io, name) for name in ("snapshot", "copy_from_device") if hasattr(engine_io, name)}

    def logged(fn):
        def run(*args, **kwargs):
            with log:
                return fn(*args, **kwargs)
        return run

    for name, fn in originals.items():
        setattr(engine_io, name, logged(fn))
    first = len(acc.log)
    try:
        engine.save_checkpoint(async_dir, tag="t", async_save=True)
        order = list(acc.log[first:])
    finally:
        engine_io.BackgroundSave = start_thread
        for name, fn in originals.items():
            setattr(engine_io, name, fn)
    _train(engine, rank, device, batches(3, 8)[2:])  # the step waits for the save's copies
    engine.save_checkpoint(sync_dir, tag="later")  # waits for the async save first
    engine.destroy()
    return {"copies": log.copies, "order": order}


def auto_offload_choice(rank: int, world: int, free_per_param: float, stage: int = 2) -> dict:
    """One rank on the stand-in accelerator whose device reports ``free_per_param`` bytes free per parameter
    of the model: what ``offload_optimizer.device: "auto"`` becomes (or the error), and two steps' losses."""
    import rayzero
    from zero_cases import batches, make_model

    acc = use_standin()
    model = make_model()
    acc.free_memory = int(free_per_param * sum(p.numel() for p in model.parameters()))
    try:
        engine = rayzero.initialize(model, {
            "train_batch_size": 4, "zero_optimization": {"stage": stage, "offload_optimizer": {"device": "auto"}},
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}}})
    except Exception as e:  # noqa: BLE001 - the refusal is the result
        return {"error": f"{type(e).__name__}: {e}"}
    losses = []
    for x, y in batches(2, 4):
        loss = torch.nn.functional.mse_loss(engine(x), y)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    out = {"offload": engine.offload_device, "losses": losses,
           "grad_device": str(engine.partitions.groups[0].grad.device)}
    engine.destroy()
    return out


def stage3_gather_group(rank: int, world: int, separate: bool | None) -> dict:
    """Stage 3 on gloo, two steps; ``separate`` forces the second group for parameter gathers
    (parallel/state.py SEPARATE_GATHER_GROUPS; None: decided by the transport, none on gloo).  Counts the
    collectives each communicator ran."""
    import rayzero
    from rayzero.parallel import state
    from zero_cases import base_config, batches, make_model

    state.SEPARATE_GATHER_GROUPS = separate
    cfg = base_config(3, world, 8, gas=2)
    cfg["zero_optimization"]["stage3_share_weights"] = False
    engine = rayzero.initialize(make_model(), cfg)
    domain = engine.partitions.groups[0].domain
    counts = {"reduce": {"all_gather": 0, "reduce_scatter": 0}, "gather": {"all_gather": 0, "reduce_scatter": 0}}

    def counted(comm, key):
        for op in ("all_gather", "reduce_scatter"):
            fn = getattr(comm, op)

            def run(*args, _fn=fn, _op=op, **kwargs):
                counts[key][_op] += 1
                return _fn(*args, **kwargs)
            setattr(comm, op, run)

    twin = getattr(domain, "gather_comm", None)
    counted(domain.comm, "reduce")
    if twin is not None:
        counted(twin, "gather")
    losses, norms = _train(engine, rank, torch.device("cpu"), batches(2, 8))
    import torch.distributed as dist

    out = {"losses": losses, "norms": norms, "state": engine.full_state_dict(), "counts": counts,
           "separate": twin is not None}
    if twin is not None:
        out["same_ranks"] = (dist.get_process_group_ranks(twin.group)
                             == dist.get_process_group_ranks(domain.comm.group or dist.group.WORLD))
        out["same_group"] = twin.group is domain.comm.group
    engine.destroy()
    return out


def gather_group_on_device_backend(rank: int, world: int) -> dict:
    """The stand-in backend is a device backend (native transport): its domains get a second group for
    stage-3 gathers, over the same ranks, and collectives run on it."""
    import rayzero
    from zero_cases import base_config, make_model
    import torch.distributed as dist

    acc = use_standin(on_device=True)
    engine = rayzero.initialize(make_model(), base_config(2, world, 4))
    domain = engine.partitions.groups[0].domain
    twin = domain.gather_comm
    rows = torch.empty(world, 3, device=acc.device())
    twin.all_gather(rows, torch.full((3,), float(rank), device=acc.device())).wait()
    out = {"has_twin": twin is not None, "distinct": twin.group is not domain.comm.group,
           "ranks": dist.get_process_group_ranks(twin.group), "rows": rows.cpu(),
           "backend": dist.get_backend(twin.group)}
    engine.destroy()
    return out
