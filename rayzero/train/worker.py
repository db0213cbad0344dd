"""The loop each Ray Train worker runs: build the Engine, resume, train, checkpoint, report.

Every (re)start of the worker group lands here with whatever world size Ray gave it.  The worker re-plans
the step for that world size (the global batch stays; a size that cannot host the run's tensor x expert
parallel layout stops with a ConfigError), loads the latest universal checkpoint resharded to its own
partition (and EP/TP slices), and continues at the next global sample.  Data is cut by the engine's
data-parallel coordinate (``engine.dp_rank`` of ``engine.dp_world_size``), so the ranks of one TP group
feed the same samples.  Checkpoints are written by every rank straight into the run's storage and handed
to ``ray.train.report`` as already-uploaded, so Ray keeps track of them (and of how many to keep) without
copying any data.
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

import torch
import torch.distributed as dist

import rayzero
from rayzero.checkpoint.storage import Storage
from rayzero.train.data import GlobalOrder, micro_batches
from rayzero.train.metrics import MetricsWriter
from rayzero.train.planning import plan_step
from rayzero.train.failures import NodePreempted
from rayzero.train.stop import (PREEMPT, PREEMPTION_NO_DEADLINE_S, PREEMPTION_WAIT_S, STOP, agree, preempted_message,
                                preemption_notice)

SAMPLES_FILE = "samples.jsonl"
TAG_FORMAT = "checkpoint_step{:08d}"  # the tag of the checkpoint saved after that many steps
TAG_PATTERN = re.compile(r"checkpoint_step(\d{8})")


@dataclass
class WorkerSpec:
    """Everything a worker needs, pickled once by the driver."""

    model: Any  # an nn.Module, or a zero-argument factory returning one
    config: dict
    global_batch: int
    max_steps: int
    data: Any = None  # torch map-style Dataset, factory of an iterable, or None with a ray.data Dataset
    loss_fn: Callable | None = None
    train_step: Callable | None = None
    collate: Callable | None = None
    micro_batch_sizes: list[int] | None = None
    checkpoint_every: int = 50
    seed: int = 0
    shuffle: bool = True
    record_samples: bool = False
    zero_init: bool = False
    tp: int = 1  # tensor_parallel.autotp_size
    ep: int = 1  # expert_parallel.autoep_size when expert_parallel is enabled, else 1
    world_sizes: list[int] | None = None  # the sizes of the elastic range the driver planned (for errors)
    compile_cache: str | None = None  # graph capture's cache: the run's compile_cache/ (a path or a URI)
    extra: dict = field(default_factory=dict)


def _default_collate(items: list) -> Any:
    return torch.utils.data.default_collate(items)


def to_device(batch: Any, device: torch.device, pin: Callable[[torch.Tensor], torch.Tensor] | None = None) -> Any:
    """``batch`` with every tensor in it (nested in tuples, lists, named tuples and dicts) on ``device``, so
    the model and the loss function get device inputs and targets.  ``pin``: pins a host tensor first, so its
    copy runs without blocking the host (a pinned source is copied with ``non_blocking``)."""
    if isinstance(batch, torch.Tensor):
        if batch.device == device:
            return batch
        if pin is not None and batch.device.type == "cpu":
            batch = pin(batch)
        return batch.to(device, non_blocking=batch.device.type == "cpu" and batch.is_pinned())
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):  # a named tuple
        return type(batch)(*(to_device(x, device, pin) for x in batch))
    if isinstance(batch, (tuple, list)):
        return type(batch)(to_device(x, device, pin) for x in batch)
    if isinstance(batch, Mapping):
        moved = {k: to_device(v, device, pin) for k, v in batch.items()}
        try:
            return type(batch)(moved)
        except TypeError:  # a mapping that cannot be built from a dict: a plain one carries the same keys
            return moved
    return batch


def _forward_loss(engine, spec: WorkerSpec, batch) -> torch.Tensor:
    inputs = batch[0] if isinstance(batch, (tuple, list)) else batch
    out = engine(**inputs) if isinstance(inputs, dict) else engine(inputs)
    if spec.loss_fn is None:
        return model_loss(out)
    return spec.loss_fn(out, batch)


def model_loss(out: Any) -> torch.Tensor:
    """The loss ``fit`` takes from the model's own output when no ``loss_fn`` is given: a scalar tensor as it
    is, another tensor's mean, or the ``loss`` of a Hugging Face ``ModelOutput`` (or a dict with a "loss"),
    which the model computes when the batch holds its ``labels``."""
    if torch.is_tensor(out):
        return out if out.dim() == 0 else out.float().mean()
    loss = getattr(out, "loss", None)
    if loss is None and isinstance(out, Mapping):
        loss = out.get("loss")
    if torch.is_tensor(loss):
        return loss if loss.dim() == 0 else loss.float().mean()
    keys = f" (keys {list(out.keys())})" if isinstance(out, Mapping) else ""
    raise rayzero.ConfigError(
        f"fit got no loss_fn and the model returned a {type(out).__name__}{keys} with no loss; give the batch "
        "the model's labels (a Hugging Face model then returns its loss: a dict batch like {'input_ids': ..., "
        "'labels': ...}), or pass loss_fn(model_output, batch) -> loss, or train_step(engine, batch)"
    )


def _collated(ids_per_micro_batch, data, collate: Callable, seen: list):
    for ids in ids_per_micro_batch:
        seen.extend(ids)
        yield collate([data[i] for i in ids])


def run_step(engine, spec: WorkerSpec, batches, accumulation: int) -> torch.Tensor:
    """One optimizer step over ``batches`` (its micro-batches, each moved to the engine's device first);
    returns this rank's mean loss as a one-element tensor on the communicator's device, unread, so the
    micro-batches queue on the device without the host waiting for each loss."""
    device = engine.accelerator.device()
    pin = None if device.type == "cpu" else engine.accelerator.pin_memory  # copies that do not block the host
    step_loss = torch.zeros(1, device=engine.comm.device)
    for batch in batches:
        if device.type != "cpu":
            batch = to_device(batch, device, pin)
        if spec.train_step is not None:
            loss = spec.train_step(engine, batch)
        else:
            loss = _forward_loss(engine, spec, batch)
            engine.backward(loss)
            engine.step()
        if not torch.is_tensor(loss):  # a train_step that returned a number
            loss = torch.tensor(float(loss))
        step_loss += loss.detach().reshape(1).to(step_loss) / accumulation
    return step_loss


def _build_model(spec: WorkerSpec) -> torch.nn.Module:
    if isinstance(spec.model, torch.nn.Module):
        return spec.model
    if spec.zero_init:
        with rayzero.zero_init(seed=spec.seed, config=spec.config):
            return spec.model()
    torch.manual_seed(spec.seed)
    return spec.model()


def train_loop_per_worker(spec: WorkerSpec) -> dict:
    """One worker's run.  With NVMe offload it first leases this rank's swap directory from its node's
    NodeSwapStore (``$RAYZERO_SWAP_DIR``, which the engine uses), and releases it when the loop ends."""
    lease = _lease_swap_dir(spec)
    try:
        return _train(spec)
    finally:
        if lease is not None:
            lease()


def _lease_swap_dir(spec: WorkerSpec) -> Callable[[], None] | None:
    """Lease this rank's swap directory when the config offloads to NVMe (or may: ``auto`` with a path);
    returns the function that gives it back."""
    import ray
    import ray.train

    from rayzero.offload.swap_dirs import SWAP_DIR_ENV
    from rayzero.train.swap_actor import node_swap_store

    zero = spec.config.get("zero_optimization") or {}
    nvme_path = None
    for key in ("offload_optimizer", "offload_param"):
        section = zero.get(key) or {}
        if section.get("device") in ("nvme", "auto") and section.get("nvme_path"):
            nvme_path = nvme_path or section["nvme_path"]
    if nvme_path is None:
        return None
    ctx = ray.train.get_context()
    rank, pid = ctx.get_world_rank(), os.getpid()
    store = node_swap_store(nvme_path, ctx.get_experiment_name(), detached=True)  # kept by release()
    os.environ[SWAP_DIR_ENV] = ray.get(store.lease.remote(rank, pid))

    def release() -> None:
        os.environ.pop(SWAP_DIR_ENV, None)
        try:
            ray.get(store.release.remote(rank, pid), timeout=60)
        except Exception as e:  # the store is gone (the run is ending): its shutdown removes the files
            logging.getLogger("rayzero").warning("could not release the swap directory of rank %d: %s", rank, e)

    return release


def _lease_compile_cache(spec: WorkerSpec, ctx) -> str:
    """This node's compile cache directory, from the run's NodeCompileCache actor on this node."""
    import ray

    from rayzero.accelerator import get_accelerator
    from rayzero.train.compile_actor import node_compile_cache

    try:
        owner = node_compile_cache(spec.compile_cache, ctx.get_experiment_name(), detached=True)
        return ray.get(owner.lease.remote(get_accelerator().name), timeout=600)
    except Exception as e:  # noqa: BLE001 - no node actor: read and write the run's cache directly
        logging.getLogger("rayzero").warning(
            "rayzero: this node's compile cache is unavailable (%s); using the run's %s directly", e, spec.compile_cache)
        return spec.compile_cache


def _train(spec: WorkerSpec) -> dict:
    import ray.train
    from ray.train import Checkpoint, CheckpointUploadMode

    ctx = ray.train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    torch.set_num_threads(max(1, int(os.environ.get("RAYZERO_THREADS_PER_WORKER", "1"))))
    _bind_device()  # before zero_init or the engine makes a device tensor or a process group
    plan = _plan_for(spec, world)
    config = {**spec.config, **plan.config_overrides()}
    if rank == 0:  # the bucket sizes rayzero derives reach the console as a start-up phase line
        from rayzero.zero import buckets

        buckets.announce = lambda text: _phase(ctx, text)
    run_storage = ctx.get_storage()
    storage = Storage.on(run_storage.storage_filesystem, run_storage.experiment_fs_path)
    capture = config.get("graph_capture") or {}
    if capture.get("enabled") and not capture.get("cache_dir") and spec.compile_cache:
        # the node's compile cache, which its actor keeps in step with the run's compile_cache/ (beside the
        # checkpoints): a restarted or resized worker group, or a node that just joined, loads what the run
        # compiled instead of compiling again
        config["graph_capture"] = {**capture, "cache_dir": _lease_compile_cache(spec, ctx)}
    engine = rayzero.initialize(_build_model(spec), config)
    # the data coordinate: ranks of one TP group feed the same batch, so data is cut over dp, not world
    dp_rank, dp_world = engine.dp_rank, engine.dp_world_size
    if dp_world != plan.dp:
        raise RuntimeError(
            f"the engine laid {world} workers out with {dp_world} data shards, the plan with {plan.dp} "
            f"(tp {plan.tp} x ep {plan.ep}); the config sent to the workers and the plan disagree"
        )

    resumed_from = None
    checkpoint = ray.train.get_checkpoint()
    given = os.path.basename(checkpoint.path.rstrip("/")) if checkpoint is not None else None
    newer = _newer_commit(storage, given) if rank == 0 else None
    if world > 1:  # every rank loads the same one
        box = [newer]
        dist.broadcast_object_list(box, src=0)
        newer = box[0]
    loading = newer or given
    if rank == 0 and loading:
        m = TAG_PATTERN.fullmatch(loading)
        _phase(ctx, f"loading checkpoint {loading}" + (f" (step {int(m.group(1))})" if m else ""))
    if newer is not None:
        # A worker died after committing ``newer`` but before Ray Train recorded it: resume from that commit
        # (redoing its steps could fork from it, and an object store refuses to overwrite it), and record it
        # with Ray now, so that Ray's latest checkpoint, keep_checkpoints and later restarts agree.
        _load_checkpoint(engine, storage, newer)
        resumed_from = newer
        ray.train.report(
            {"step": engine.global_steps, "samples": engine.global_samples, "world_size": world,
             "resumed_from": newer},
            checkpoint=Checkpoint(path=storage.join(newer), filesystem=storage.fs),
            checkpoint_upload_mode=CheckpointUploadMode.NO_UPLOAD,
        )
    elif checkpoint is not None:
        parent, tag = os.path.split(checkpoint.path.rstrip("/"))
        _load_checkpoint(engine, Storage.on(checkpoint.filesystem, parent), tag)
        resumed_from = tag
    start_step = engine.global_steps
    if rank == 0:
        _prune_unrecorded(storage, loading)
        _phase(ctx, f"first step: step {start_step + 1} of {spec.max_steps}")

    metrics = MetricsWriter(storage) if rank == 0 else None
    order = GlobalOrder(len(spec.data), spec.seed, spec.shuffle) if _is_map_dataset(spec.data) else None
    stream = None if order is not None else _stream_batches(spec, dp_rank, dp_world, plan, start_step)
    samples_log = storage.join(SAMPLES_FILE) if spec.record_samples and storage.local else None
    collate = spec.collate or _default_collate
    last_time = time.perf_counter()
    loss_value = float("nan")
    skipped = engine.skipped_steps  # steps the engine skipped (fp16 overflow, nonfinite_grad "skip")
    watcher = _watch_for_stop(ctx) if rank == 0 else None
    stopped_at = None
    for step in range(start_step, spec.max_steps):
        ids_seen: list = []
        if order is not None:
            ids = micro_batches(order, step, spec.global_batch, dp_world, dp_rank, plan.micro_batch)
            batches = _collated(ids, spec.data, collate, ids_seen)
        else:
            batches = (next(stream) for _ in range(plan.accumulation))
        step_loss = run_step(engine, spec, batches, plan.accumulation)
        # the step's one read of the loss, summed over the world (every data shard appears tp times in it, so
        # the world mean is the shards' mean) in the all-reduce that also agrees on a stop (rayzero/train/stop.py)
        total, flag = agree(engine.comm, step_loss, watcher.flag() if watcher is not None else 0.0, world)
        stop, preempt = flag == STOP, flag == PREEMPT
        loss_value = total / world
        if not math.isfinite(loss_value) and engine.skipped_steps == skipped:
            raise _non_finite_loss(loss_value, step + 1, spec)
        skipped = engine.skipped_steps
        if samples_log is not None:
            with open(samples_log, "a") as f:
                f.write(json.dumps({"step": step, "rank": rank, "world_size": world, "dp_rank": dp_rank,
                                    "dp_world_size": dp_world, "ids": ids_seen}) + "\n")
        now = time.perf_counter()
        record = {
            "step": step + 1,
            "loss": loss_value,
            "grad_norm": engine.global_grad_norm,
            "lr": engine.get_lr()[0],
            "world_size": world,
            "micro_batch": plan.micro_batch,
            "accumulation": plan.accumulation,
            "tp": plan.tp,
            "ep": plan.ep,
            "dp": dp_world,
            "samples": engine.global_samples,
            "samples_per_s": spec.global_batch / max(now - last_time, 1e-9),
            "time": time.time(),
        }
        last_time = now
        done = step + 1 == spec.max_steps
        stop, preempt = stop and not done, preempt and not done  # the last step ends the run anyway
        if stop:
            record["stopped"] = True
        if preempt:
            record["preempted"] = True
        if metrics is not None:
            metrics.write(record)
        tag = None
        if ((spec.checkpoint_every and (step + 1) % spec.checkpoint_every == 0) or done or preempt
                or (stop and spec.extra.get("save_on_stop", True))):
            tag = engine.save_checkpoint(storage, tag=TAG_FORMAT.format(step + 1))
            ray.train.report(
                record,
                checkpoint=Checkpoint(path=storage.join(tag), filesystem=storage.fs),
                checkpoint_upload_mode=CheckpointUploadMode.NO_UPLOAD,
            )
        if stop:  # every rank agreed: the driver asked the run to stop (SIGINT/SIGTERM)
            stopped_at = step + 1
            break
        if preempt:  # every rank agreed: a node of the group is being preempted (rayzero/train/stop.py)
            if watcher is not None:
                watcher.close()
            if metrics is not None:
                metrics.close()
            engine.destroy()
            _await_preemption(rank, step + 1, tag)
    if watcher is not None:
        watcher.close()
    if metrics is not None:
        metrics.close()
    result = {"final_loss": loss_value, "world_size": world, "start_step": start_step, "resumed_from": resumed_from,
              "stopped_at": stopped_at}
    engine.destroy()
    return result


def _load_checkpoint(engine, storage: Storage, tag: str) -> None:
    """Load checkpoint ``tag``; a checkpoint this rank cannot load ends the run without retry (every retry
    would load the same one), except the error that only reports another rank's failure: that rank's own
    error decides."""
    from rayzero.checkpoint.format import CheckpointError
    from rayzero.train.failures import mark_fatal

    try:
        engine.load_checkpoint(storage, tag=tag)
    except CheckpointError as e:
        if "failed on another rank" not in str(e):  # engine.load_checkpoint's message for a peer's failure
            mark_fatal(e)
        raise


def _non_finite_loss(value: float, step: int, spec: WorkerSpec) -> Exception:
    from rayzero.train.failures import NonFiniteLossError

    where = "train_step" if spec.train_step is not None else "loss_fn" if spec.loss_fn is not None else "model"
    return NonFiniteLossError(
        f"the loss of step {step} is {value} (from the {where}) and the step was not skipped; a retry from the "
        "last checkpoint would meet it again, so the run stops here. Check the data and the loss for inf/nan, "
        'lower the learning rate, or set "nonfinite_grad": "skip" in the config to skip steps whose gradients '
        "are not finite"
    )


def _await_preemption(rank: int, step: int, tag: str | None) -> None:
    """After the checkpoint saved on a preemption notice: wait for Ray Train, which tears the worker group down
    at the node's deadline and restarts the run on the nodes that stay, from that checkpoint (a preemption,
    charged to ``FailureConfig.max_preemption_failures``).  Returning would end the run as finished, and a
    restart before the deadline would count the draining node's resources and wait for it.  Should the
    teardown not come (``PREEMPTION_WAIT_S`` past the deadline), the workers raise ``NodePreempted``, which
    rayzero's failure policy also hands Ray Train as a preemption."""
    info = preemption_notice()
    message = preempted_message(step, tag, info)
    if rank == 0:
        print(f"[rayzero] {message}", flush=True)
    deadline_ms = getattr(info, "deadline_ms", None)
    until = (deadline_ms / 1000 if deadline_ms else time.time() + PREEMPTION_NO_DEADLINE_S) + PREEMPTION_WAIT_S
    while time.time() < until:
        time.sleep(0.5)
    raise NodePreempted(message, info)


def _watch_for_stop(ctx):
    """Rank 0's reader of the driver's stop request (``rayzero.train.stop``), started."""
    from rayzero.train.stop import StopWatcher

    watcher = StopWatcher(ctx.get_experiment_name())
    watcher.start()
    return watcher


def _bind_device() -> None:
    """Make this worker's device current.  Ray assigns each GPU worker its GPUs and shows it those of its
    node's workers (CUDA_VISIBLE_DEVICES); the device is the position of its own GPU there, which LOCAL_RANK
    need not be, so that position is what the worker binds."""
    from rayzero.accelerator import DEVICE_INDEX_ENV_VAR, bind_rank_device, get_accelerator

    acc = get_accelerator()
    if acc.name == "cpu":
        return
    if DEVICE_INDEX_ENV_VAR not in os.environ:
        try:
            from ray.train.torch import get_device

            assigned = get_device()
        except Exception:  # noqa: BLE001 - no devices assigned by Ray: LOCAL_RANK decides
            assigned = None
        if assigned is not None and assigned.type == acc.device().type and assigned.index is not None:
            os.environ[DEVICE_INDEX_ENV_VAR] = str(assigned.index)
    bind_rank_device(acc)


def _phase(ctx, text: str) -> None:
    """Tell the driver (its start-up phase lines) what rank 0 is doing now."""
    from rayzero.train.metrics import publish_phase

    publish_phase(ctx.get_experiment_name(), text)


def _prune_unrecorded(storage: Storage, resumed_from: str | None) -> None:
    """keep_checkpoints: delete checkpoint folders no record holds (``retention.prune``); a failure to delete
    is only logged."""
    from rayzero.train.retention import prune

    try:
        prune(storage, resumed_from)
    except OSError as e:
        logging.getLogger("rayzero").warning("rayzero: could not remove old checkpoint folders: %s", e)


def _newer_commit(storage: Storage, given: str | None) -> str | None:
    """The newest checkpoint committed (its manifest written) in the run's storage when it is newer than
    ``given``, the one Ray Train handed back (None: none); else None."""
    from rayzero.checkpoint.format import MANIFEST

    floor = int(m.group(1)) if given and (m := TAG_PATTERN.fullmatch(given)) else -1
    steps = sorted((int(m.group(1)), n) for n in storage.listdir(storage.root) if (m := TAG_PATTERN.fullmatch(n)))
    for step, name in reversed(steps):
        if step <= floor:
            break
        if storage.exists(storage.join(name, MANIFEST)):
            return name
    return None


def _plan_for(spec: WorkerSpec, world: int):
    """This world size's plan; a size the layout cannot host (or the batch cannot be cut over) stops the
    worker group with a ConfigError that says which sizes work, rather than training with a wrong layout."""
    try:
        return plan_step(spec.global_batch, world, spec.micro_batch_sizes, spec.tp, spec.ep)
    except rayzero.ConfigError as e:
        usable = f"; world sizes of the range that work: {spec.world_sizes}" if spec.world_sizes else ""
        fix = ""
        if spec.tp * spec.ep > 1:
            fix = (f". Give the cluster resources for one of those sizes, or use an elastic range whose sizes are "
                   f"all multiples of tp x ep = {spec.tp * spec.ep}")
        raise rayzero.ConfigError(
            f"Ray Train started the worker group with {world} workers, which this run cannot use: {e}{usable}{fix}"
        ) from None


def _is_map_dataset(data) -> bool:
    return data is not None and hasattr(data, "__getitem__") and hasattr(data, "__len__")


def _stream_batches(spec: WorkerSpec, rank: int, world: int, plan, start_step: int):
    """Micro-batches from a ray.data shard or a user factory; a resumed run skips what was consumed.

    ``rank`` / ``world`` are the data-parallel coordinate (``engine.dp_rank`` / ``engine.dp_world_size``):
    a factory is called with them, so the ranks of one TP group get the same stream."""
    import ray.train

    if spec.data is None:
        shard = ray.train.get_dataset_shard("train")
        if shard is None:
            raise rayzero.ConfigError(
                "fit() got no data: pass a torch Dataset, a ray.data Dataset or an iterable factory")
        source = shard.iter_torch_batches(batch_size=plan.micro_batch, drop_last=True)
    elif callable(spec.data):
        source = iter(spec.data(rank, world, plan.micro_batch))
    else:
        raise rayzero.ConfigError(
            f"unsupported data {type(spec.data).__name__}: use a map-style Dataset or a factory")
    def fresh():
        if callable(spec.data):
            return iter(spec.data(rank, world, plan.micro_batch))
        return iter(ray.train.get_dataset_shard("train").iter_torch_batches(batch_size=plan.micro_batch, drop_last=True))

    it = iter(source)
    skip = start_step * plan.accumulation  # micro-batches this rank consumed before the restart
    while True:
        try:
            batch = next(it)
        except StopIteration:  # one pass is over: start the next
            it = fresh()
            batch = next(it)
        if skip:
            skip -= 1
            continue
        yield batch
