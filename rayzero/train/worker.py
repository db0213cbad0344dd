"""The loop each Ray Train worker runs: build the Engine, resume, train, checkpoint, report.

Every (re)start of the worker group lands here with whatever world size Ray gave it.  The worker re-plans
the step for that world size (the global batch stays), loads the latest universal checkpoint resharded to
its own partition, and continues at the next global sample.  Checkpoints are written by every rank
straight into the run's storage and handed to ``ray.train.report`` as already-uploaded, so Ray keeps
track of them (and of how many to keep) without copying any data.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.distributed as dist

import rayzero
from rayzero.checkpoint.storage import Storage
from rayzero.train.data import GlobalOrder, micro_batches
from rayzero.train.metrics import MetricsWriter
from rayzero.train.planning import plan_step

SAMPLES_FILE = "samples.jsonl"


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
    extra: dict = field(default_factory=dict)


def _default_collate(items: list) -> Any:
    return torch.utils.data.default_collate(items)


def _forward_loss(engine, spec: WorkerSpec, batch) -> torch.Tensor:
    inputs = batch[0] if isinstance(batch, (tuple, list)) else batch
    out = engine(**inputs) if isinstance(inputs, dict) else engine(inputs)
    if spec.loss_fn is None:
        return out if torch.is_tensor(out) and out.dim() == 0 else out.float().mean()
    return spec.loss_fn(out, batch)


def _build_model(spec: WorkerSpec) -> torch.nn.Module:
    if isinstance(spec.model, torch.nn.Module):
        return spec.model
    if spec.zero_init:
        with rayzero.zero_init(seed=spec.seed):
            return spec.model()
    torch.manual_seed(spec.seed)
    return spec.model()


def train_loop_per_worker(spec: WorkerSpec) -> dict:
    import ray.train
    from ray.train import Checkpoint, CheckpointUploadMode

    ctx = ray.train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    torch.set_num_threads(max(1, int(os.environ.get("RAYZERO_THREADS_PER_WORKER", "1"))))
    plan = plan_step(spec.global_batch, world, spec.micro_batch_sizes)
    config = {**spec.config, **plan.config_overrides()}
    engine = rayzero.initialize(_build_model(spec), config)

    run_storage = ctx.get_storage()
    storage = Storage.on(run_storage.storage_filesystem, run_storage.experiment_fs_path)
    resumed_from = None
    checkpoint = ray.train.get_checkpoint()
    if checkpoint is not None:
        parent, tag = os.path.split(checkpoint.path.rstrip("/"))
        engine.load_checkpoint(Storage.on(checkpoint.filesystem, parent), tag=tag)
        resumed_from = tag
    start_step = engine.global_steps

    metrics = MetricsWriter(storage) if rank == 0 else None
    order = GlobalOrder(len(spec.data), spec.seed, spec.shuffle) if _is_map_dataset(spec.data) else None
    stream = None if order is not None else _stream_batches(spec, rank, world, plan, start_step)
    samples_log = storage.join(SAMPLES_FILE) if spec.record_samples and storage.local else None
    collate = spec.collate or _default_collate
    last_time = time.perf_counter()
    loss_value = float("nan")
    for step in range(start_step, spec.max_steps):
        step_loss = torch.zeros(1)
        if order is not None:
            batches = micro_batches(order, step, spec.global_batch, world, rank, plan.micro_batch)
        else:
            batches = (next(stream) for _ in range(plan.accumulation))
        ids_seen = []
        for ids_or_batch in batches:
            if order is not None:
                ids_seen.extend(ids_or_batch)
                batch = collate([spec.data[i] for i in ids_or_batch])
            else:
                batch = ids_or_batch
            if spec.train_step is not None:
                loss = spec.train_step(engine, batch)
            else:
                loss = _forward_loss(engine, spec, batch)
                engine.backward(loss)
                engine.step()
            step_loss += float(loss.detach() if torch.is_tensor(loss) else loss) / plan.accumulation
        if world > 1:
            dist.all_reduce(step_loss)
        loss_value = step_loss.item() / world
        if samples_log is not None:
            with open(samples_log, "a") as f:
                f.write(json.dumps({"step": step, "rank": rank, "world_size": world, "ids": ids_seen}) + "\n")
        now = time.perf_counter()
        record = {
            "step": step + 1,
            "loss": loss_value,
            "grad_norm": engine.global_grad_norm,
            "lr": engine.get_lr()[0],
            "world_size": world,
            "micro_batch": plan.micro_batch,
            "accumulation": plan.accumulation,
            "samples": engine.global_samples,
            "samples_per_s": spec.global_batch / max(now - last_time, 1e-9),
            "time": time.time(),
        }
        last_time = now
        if metrics is not None:
            metrics.write(record)
        done = step + 1 == spec.max_steps
        if (spec.checkpoint_every and (step + 1) % spec.checkpoint_every == 0) or done:
            tag = engine.save_checkpoint(storage, tag=f"checkpoint_step{step + 1:08d}")
            ray.train.report(
                record,
                checkpoint=Checkpoint(path=storage.join(tag), filesystem=storage.fs),
                checkpoint_upload_mode=CheckpointUploadMode.NO_UPLOAD,
            )
    if metrics is not None:
        metrics.close()
    result = {"final_loss": loss_value, "world_size": world, "start_step": start_step, "resumed_from": resumed_from}
    engine.destroy()
    return result


def _is_map_dataset(data) -> bool:
    return data is not None and hasattr(data, "__getitem__") and hasattr(data, "__len__")


def _stream_batches(spec: WorkerSpec, rank: int, world: int, plan, start_step: int):
    """Micro-batches from a ray.data shard or a user factory; a resumed run skips what was consumed."""
    import ray.train

    if spec.data is None:
        shard = ray.train.get_dataset_shard("train")
        if shard is None:
            raise ValueError("fit() got no data: pass a torch Dataset, a ray.data Dataset or an iterable factory")
        source = shard.iter_torch_batches(batch_size=plan.micro_batch, drop_last=True)
    elif callable(spec.data):
        source = iter(spec.data(rank, world, plan.micro_batch))
    else:
        raise ValueError(f"unsupported data {type(spec.data).__name__}: use a map-style Dataset or a factory")
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
