"""``rayzero.fit``: the driver.  Plans, checks, launches Ray Train workers, follows progress, returns a Result."""

from __future__ import annotations

import logging
import math
import os
import sys
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from rayzero.checkpoint.storage import Storage
from rayzero.config import Config, ConfigError
from rayzero.train.cluster_config import ClusterConfig
from rayzero.train.metrics import read_metrics
from rayzero.offload.optimizer import optimizer_state_bytes
from rayzero.train.offload_check import absolute_nvme_paths, check_swap_fits, node_slots, resolve_auto, swap_path
from rayzero.train.planning import MicroBatchSizes, StepPlan, plan_range, skipped_sizes
from rayzero.train.worker import WorkerSpec, train_loop_per_worker

logger = logging.getLogger("rayzero")


@dataclass
class Result:
    metrics: dict
    losses: list[float]
    checkpoint: str | None
    world_sizes: list[int]
    run_dir: str
    history: list[dict] = field(default_factory=list)


def _ensure_ray(cluster: ClusterConfig) -> None:
    import ray

    if ray.is_initialized():
        return
    address = cluster.address or os.environ.get("RAY_ADDRESS")
    if address:
        ray.init(address=address, log_to_driver=True)
    else:
        # No address: join a cluster started on this machine with `ray start`, else start one sized to it.
        ray.init(log_to_driver=True)


def _check_picklable(model: Any) -> None:
    import ray.cloudpickle as cloudpickle

    try:
        cloudpickle.dumps(model)
    except Exception as e:
        raise TypeError(
            f"the model cannot be sent to the workers ({type(e).__name__}: {e}); pass a zero-argument factory "
            "that builds it instead (e.g. rayzero.fit(lambda: MyModel(), ...)), which also lets ZeRO-3 build it "
            "without any rank holding it whole"
        ) from None


def _check_storage(path: str) -> None:
    storage = Storage.resolve(path)
    probe = storage.join(f".rayzero-write-probe-{uuid.uuid4().hex[:8]}")
    try:
        storage.makedirs(storage.root)
        storage.write_bytes_atomic(probe, b"ok")
        storage.fs.delete_file(probe)
    except Exception as e:
        raise PermissionError(
            f"cannot write to the run storage {path!r} ({type(e).__name__}: {e}); choose a writable path or URI "
            "in ClusterConfig(storage=...)"
        ) from None


def _wait_for_resources(cluster: ClusterConfig) -> None:
    import ray

    need = {k: v * cluster.min_workers for k, v in cluster.resources_per_worker.items()}
    if cluster.use_gpu and "GPU" not in need:  # Ray gives each worker one GPU unless told otherwise
        need["GPU"] = cluster.min_workers
    deadline = time.monotonic() + cluster.start_timeout_s
    while True:
        have = ray.cluster_resources()
        short = {k: (v, have.get(k, 0)) for k, v in need.items() if have.get(k, 0) < v}
        if not short:
            return
        if time.monotonic() > deadline:
            detail = ", ".join(f"{k}: need {n:g}, cluster has {h:g}" for k, (n, h) in short.items())
            raise RuntimeError(
                f"the Ray cluster is too small for {cluster.min_workers} worker(s) ({detail}) after waiting "
                f"{cluster.start_timeout_s:g}s; add nodes, lower workers, or lower resources_per_worker"
            )
        time.sleep(1.0)


class _Progress(threading.Thread):
    """Prints step, loss, samples/s and ETA from the run's metrics file: one line per update, readable in
    `ray job logs` (a carriage-return bar only when stdout is a terminal)."""

    def __init__(self, run_dir: str, max_steps: int, every_s: float = 2.0):
        super().__init__(daemon=True, name="rayzero-progress")
        self.run_dir, self.max_steps, self.every_s = run_dir, max_steps, every_s
        self.stop = threading.Event()
        self.tty = sys.stdout.isatty()
        self.last_step = 0

    def run(self) -> None:
        start = time.time()
        while not self.stop.wait(self.every_s):
            self.show(start)
        self.show(start)
        if self.tty:
            print(flush=True)

    def show(self, start: float) -> None:
        try:
            records = read_metrics(self.run_dir)
        except (FileNotFoundError, OSError):
            return
        if not records or records[-1]["step"] == self.last_step:
            return
        r = records[-1]
        self.last_step = r["step"]
        elapsed = time.time() - start
        rate = r["step"] / elapsed if elapsed > 0 else 0
        eta = (self.max_steps - r["step"]) / rate if rate > 0 else float("nan")
        line = (
            f"[rayzero] step {r['step']}/{self.max_steps}  loss {r['loss']:.4f}  "
            f"{r['samples_per_s']:.0f} samples/s  world {r['world_size']}  ETA {eta:.0f}s"
        )
        print(("\r" + line) if self.tty else line, end="" if self.tty else "\n", flush=True)


def fit(
    model: torch.nn.Module | Callable[[], torch.nn.Module],
    cluster_cfg: ClusterConfig | dict | int | None = None,
    config: Any = None,
    data: Any = None,
    loss_fn: Callable | None = None,
    max_steps: int = 100,
    train_step: Callable | None = None,
    collate: Callable | None = None,
    seed: int = 0,
    shuffle: bool = True,
    record_samples: bool = False,
    zero_init: bool | None = None,
) -> Result:
    """Train ``model`` on a Ray cluster with ZeRO; elastic when ``cluster_cfg.workers`` is ``(min, max)``.

    ``data``: a torch map-style Dataset (sharded by rayzero's resumable seeded sampler), a
    ``ray.data.Dataset`` (split across workers by Ray Train), or a factory ``(rank, world, micro_batch) ->
    iterable of batches``.  ``loss_fn(model_output, batch)`` gives the loss, where the model is called on
    ``batch[0]`` (or ``**batch`` for a dict); or ``train_step(engine, batch)`` runs forward, backward and
    step itself and returns the loss.

    With ``tensor_parallel.autotp_size`` / ``expert_parallel`` in ``config`` every world size is laid out as
    tp x dp (dp a multiple of ep) and the global batch is cut over the dp data shards: the ranks of one TP
    group read the same samples, and a factory is called with the data-parallel rank and size.
    """
    from ray.train import CheckpointConfig, FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    cluster = ClusterConfig.from_any(cluster_cfg)
    cfg = Config.from_any(config if config is not None else {})
    absolute_nvme_paths(cfg)
    # the model-parallel layout: tp ranks share one data shard; ep splits the data-parallel ranks further
    tp, ep = cfg.tensor_parallel.autotp_size, cfg.expert_parallel.size
    global_batch, micro_sizes, plans = _plan_run(cfg, cluster)
    skipped = skipped_sizes(cluster.min_workers, cluster.max_workers, tp, ep)
    if tp > 1 and _is_ray_dataset(data):
        raise ConfigError(
            f"a ray.data Dataset is split over every worker, but with tensor_parallel.autotp_size={tp} the {tp} "
            "ranks of a TP group must read the same samples; pass a map-style dataset or a factory "
            "(rank, world, micro_batch) -> iterable, which fit calls with the data-parallel rank and size"
        )
    if zero_init and (tp > 1 or cfg.expert_parallel.enabled):
        raise ConfigError(
            "zero_init=True is not used with expert_parallel or tensor_parallel in fit: the engine would gather "
            "the zero_init shards to cut the EP/TP slices, so it saves no memory there; leave zero_init unset "
            "(each rank builds the model, then keeps only its slices)"
        )
    if max_steps < 1:
        raise ConfigError(f"max_steps must be >= 1, got {max_steps}")
    if not isinstance(model, torch.nn.Module) and not callable(model):
        raise TypeError("model must be an nn.Module or a zero-argument factory that returns one")
    _check_picklable(model)
    name = cluster.name or f"rayzero-{time.strftime('%Y%m%d-%H%M%S')}"
    _check_storage(cluster.storage)

    _ensure_ray(cluster)
    _wait_for_resources(cluster)
    from rayzero.train.agent import format_node_table, node_table

    nodes = node_table()
    logger.info("nodes:\n%s", format_node_table(nodes))
    print(format_node_table(nodes), flush=True)
    counted = _model_for_count(model)
    auto = resolve_auto(counted, cfg, cluster, nodes)  # offload_optimizer "auto" -> "none" or "nvme"
    if auto:
        logger.info("%s", auto)
        print(f"[rayzero] {auto}", flush=True)
    if counted is not None:
        _check_fits(counted, cfg, cluster, nodes)
    for w, plan in plans.items():
        if plan.note:
            # the user's micro-batch / accumulation do not fit this world size: say what changed and why
            logger.warning("%s", plan.describe())
            print(f"[rayzero] {plan.describe()}", flush=True)
        else:
            logger.info("%s", plan.describe())
    if skipped:
        note = (f"[rayzero] world sizes {sorted(skipped)} of [{cluster.min_workers}, {cluster.max_workers}] cannot "
                f"host tp {tp} x ep {ep} and are skipped (a worker group started at one of them stops with a "
                f"ConfigError); usable sizes: {sorted(plans)}")
        print(note, flush=True)

    config_dict = cfg.to_dict()
    for key in ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps"):
        config_dict.pop(key, None)
    spec = WorkerSpec(
        model=model,
        config=config_dict,
        global_batch=global_batch,
        max_steps=max_steps,
        data=None if _is_ray_dataset(data) else data,
        loss_fn=loss_fn,
        train_step=train_step,
        collate=collate,
        micro_batch_sizes=micro_sizes,
        checkpoint_every=cluster.checkpoint_every,
        seed=seed,
        shuffle=shuffle,
        record_samples=record_samples,
        zero_init=bool(zero_init) if zero_init is not None else (
            cfg.zero_optimization.stage == 3 and not isinstance(model, torch.nn.Module)
            and tp == 1 and not cfg.expert_parallel.enabled  # AutoEP/AutoTP slice a whole model
        ),
        tp=tp,
        ep=ep,
        world_sizes=sorted(plans),
    )
    for what in ("data", "loss_fn", "train_step", "collate"):
        try:
            import ray.cloudpickle as cloudpickle

            cloudpickle.dumps(getattr(spec, what))
        except Exception as e:
            raise TypeError(f"{what} cannot be sent to the workers ({type(e).__name__}: {e}); make it picklable "
                            "(a module-level function or class, or a factory)") from None
    workers = (cluster.min_workers, cluster.max_workers) if cluster.elastic else cluster.min_workers
    trainer = TorchTrainer(
        train_loop_per_worker,
        train_loop_config=spec,
        scaling_config=ScalingConfig(
            num_workers=workers,
            use_gpu=cluster.use_gpu,
            resources_per_worker=cluster.resources_per_worker,
            elastic_resize_monitor_interval_s=cluster.elastic_check_interval_s,
        ),
        run_config=RunConfig(
            name=name,
            storage_path=cluster.storage,
            failure_config=FailureConfig(max_failures=cluster.max_failures),
            checkpoint_config=CheckpointConfig(num_to_keep=cluster.keep_checkpoints),
        ),
        datasets={"train": data} if _is_ray_dataset(data) else None,
    )
    # keep a URI's scheme (and query) so the driver reads the run where the workers write it
    if "://" in cluster.storage:
        base, _, query = cluster.storage.partition("?")
        run_dir = f"{base.rstrip('/')}/{name}" + (f"?{query}" if query else "")
    else:
        run_dir = os.path.join(cluster.storage, name)
    progress = _Progress(run_dir, max_steps) if cluster.progress else None
    swap_root = swap_path(cfg)  # with NVMe offload: one NodeSwapStore per node owns the run's swap files
    swap_stores: dict = {}  # their handles: a store lives while its creator holds one
    try:
        if swap_root:
            _start_swap(counted, cfg, cluster, sorted(plans), name, swap_root, swap_stores)
        if progress is not None:
            progress.start()
        result = trainer.fit()
    finally:
        if progress is not None and progress.is_alive():
            progress.stop.set()
            progress.join(timeout=10)
        if swap_root:
            from rayzero.train.swap_actor import shutdown_stores

            shutdown_stores(name, swap_stores)  # removes the run's swap files on every node, however the run ended
    if result.error is not None:
        raise result.error
    history = read_metrics(run_dir)
    by_step: dict[int, dict] = {}
    for r in history:  # a restart re-does steps after its checkpoint: the last record of a step wins
        by_step[r["step"]] = r
    worlds: list[int] = []
    for r in history:
        if not worlds or worlds[-1] != r["world_size"]:
            worlds.append(r["world_size"])
    return Result(
        metrics=dict(result.metrics or {}),
        losses=[by_step[s]["loss"] for s in sorted(by_step)],
        checkpoint=_checkpoint_location(cluster.storage, run_dir, result.checkpoint),
        world_sizes=worlds,
        run_dir=run_dir,
        history=history,
    )


def _start_swap(counted, cfg: Config, cluster: ClusterConfig, worlds: list[int], name: str, root: str,
                stores: dict) -> None:
    """Start the run's NodeSwapStore on every node that can host a worker, and refuse the plan (before any worker
    starts) when a node's disk under nvme_path cannot hold the swap of the ranks it may host."""
    from rayzero.train.swap_actor import start_stores

    slots = node_slots(cluster)
    capacity = start_stores(root, name, [node for node, (_, k) in slots.items() if k > 0], stores)
    if counted is not None:  # (an uncounted model also leaves "auto" to the engines)
        check_swap_fits(counted, cfg, worlds, slots, capacity)


def _plan_run(cfg: Config, cluster: ClusterConfig) -> tuple[int, list[int] | None, dict[int, StepPlan]]:
    """The global batch, the acceptable micro-batch sizes the workers get, and the plan of every world size.

    The config's ``train_micro_batch_size_per_gpu`` and ``gradient_accumulation_steps`` are the user's cut:
    they ride along with the acceptable sizes (``MicroBatchSizes``) so that the driver's plans and every
    worker's re-plan keep them where they fit the world size, and re-plan them with a note where they do not.
    """
    tp, ep = cfg.tensor_parallel.autotp_size, cfg.expert_parallel.size
    micro, accumulation = cfg.train_micro_batch_size_per_gpu, cfg.gradient_accumulation_steps
    global_batch = cfg.train_batch_size
    if global_batch is None:
        global_batch = (micro or 1) * (accumulation or 1) * max(1, cluster.min_workers // tp)
    micro_sizes = cluster.micro_batch_sizes
    if micro_sizes is None and micro:
        # The config's micro-batch is the largest the user wants; smaller ones that divide are acceptable.
        micro_sizes = list(range(1, micro + 1))
    if micro is not None or accumulation is not None:
        micro_sizes = MicroBatchSizes(micro_sizes, micro_batch=micro, accumulation=accumulation)
    plans = plan_range(global_batch, cluster.min_workers, cluster.max_workers, micro_sizes, tp, ep)
    return global_batch, micro_sizes, plans


def model_state_bytes_per_param(stage: int, world: int, mixed_precision: bool, optimizer_bytes: int = 8) -> float:
    """Model-state bytes one rank holds per trainable parameter it trains: docs/design.md "Memory per rank"
    (fp32 master, fp32 gradients, AdamW's two fp32 moments = ``optimizer_bytes``).  ``world`` is the number of
    ranks the parameter's ZeRO partition is split over; stage 3's persistent parameters come on top.

    ======  ===================  ===================
    stage   fp32 compute         bf16/fp16 compute
    ======  ===================  ===================
    0       16                   18
    1       8 + 16/W             6 + 16/W
    2       4 + 16/W             2 + 16/W
    3       16/W (+ persistent)  16/W (+ persistent)
    ======  ===================  ===================
    """
    weights = 2 if mixed_precision else 4  # the model's own (compute-dtype) parameters
    master, grad = 4, 4
    if stage == 0:  # nothing partitioned; in fp32 the model's parameters are views of the master
        return (weights if mixed_precision else 0) + master + grad + optimizer_bytes
    partition = (master + grad + optimizer_bytes) / world  # fp32 master, gradient and moments partitions
    if stage == 1:
        return weights + 4 + partition  # + the persistent fp32 local gradient buffer (the whole gradient)
    if stage == 2:
        return weights + partition
    return partition  # stage 3: parameters live only as shards between uses


def model_state_bytes_per_worker(
    num_params: int,
    stage: int,
    world: int,
    mixed_precision: bool,
    *,
    persistent_params: int = 0,
    frozen_params: int = 0,
    optimizer_bytes: int = 8,
) -> int:
    """ZeRO model-state memory of one worker: ``num_params`` trainable parameters partitioned over ``world``
    ranks (``model_state_bytes_per_param``), plus the compute-dtype copies every rank keeps whole: stage 3's
    persistent parameters (at most ``stage3_param_persistence_threshold`` elements) and frozen parameters.
    The plan's memory floor: activations and transient buffers come on top."""
    weights = 2 if mixed_precision else 4
    need = model_state_bytes_per_param(stage, world, mixed_precision, optimizer_bytes) * num_params
    if stage == 3:
        need += weights * persistent_params
    return int(round(need + weights * frozen_params))


def _expert_params(model: torch.nn.Module) -> set:
    """The parameters AutoEP splits over ep: rayzero MoE experts (marked) and transformers experts modules."""
    from rayzero.moe.experts import looks_like_experts

    out = {p for p in model.parameters() if getattr(p, "_rayzero_expert", False)}
    for module in model.modules():
        if looks_like_experts(module):
            out.update(module.parameters())
    return out


def model_state_bytes(model: torch.nn.Module, cfg: Config, world: int, offload: str | None = None) -> tuple[int, int]:
    """``(bytes, parameters)``: the model-state bytes of one of ``world`` workers and the model's parameter
    count.  With tensor parallelism every parameter counts 1/tp (AutoTP leaves embeddings and norms whole,
    so this can only under-count), partitioned over the ``world // tp`` data shards; with expert
    parallelism the experts count 1/ep more, partitioned over the ``dp // ep`` expert-data-parallel ranks.

    With the optimizer offloaded (``offload``, default the config's ``offload_optimizer.device``; ``auto``
    counts as ``none``) the bytes are those ``rayzero.offload.plan.ram_bytes_per_param`` keeps in memory:
    ``nvme`` moves the fp32 master and optimizer state to disk."""
    from rayzero.offload.plan import ram_bytes_per_param

    z = cfg.zero_optimization
    offload = offload or z.offload_optimizer.device
    offload = "none" if offload == "auto" else offload
    tp = cfg.tensor_parallel.autotp_size
    ep = cfg.expert_parallel.size
    dp = max(1, world // tp)
    edp = max(1, dp // ep)
    stage = cfg.zero_optimization.stage
    mixed = cfg.compute_dtype != torch.float32
    threshold = cfg.zero_optimization.stage3_param_persistence_threshold
    optimizer_bytes = optimizer_state_bytes(cfg)
    experts = _expert_params(model) if ep > 1 else set()
    params = list(dict.fromkeys(model.parameters()))  # tied weights once
    weights = 2 if mixed else 4
    need = 0.0
    partition = largest = 0  # elements of this rank's optimizer partition, and of its largest parameter
    for p in params:
        expert = p in experts
        held = p.numel() / (tp * ep if expert else tp)  # the elements this rank holds
        if not p.requires_grad:  # frozen: whole on every rank, in the compute dtype
            need += weights * held
            continue
        ranks = edp if expert else dp
        chunk = math.ceil(held / (ranks if stage else 1))
        partition, largest = partition + chunk, max(largest, chunk)
        if offload == "none" and z.offload_param.device == "none":
            need += model_state_bytes_per_param(stage, ranks, mixed, optimizer_bytes) * held
        else:
            need += ram_bytes_per_param(stage, ranks, mixed, optimizer_bytes, offload,
                                        offload_param=z.offload_param.device) * held
        if stage == 3 and p.numel() <= threshold:  # persistent: whole on every rank between steps too
            need += weights * held
    if offload == "nvme":  # the swap pool's buffers (offload/plan.py swap_pool_bytes)
        from rayzero.offload.optimizer import sub_group_size
        from rayzero.offload.plan import swap_pool_bytes

        sub = max(sub_group_size(cfg, partition, nvme=True), largest)
        need += swap_pool_bytes(partition, sub, z.offload_optimizer.buffer_count, optimizer_bytes)
    return int(round(need)), sum(p.numel() for p in params)


def _model_for_count(model: Any) -> torch.nn.Module | None:
    """The model itself, or a factory's model built on the meta device (shapes only, nothing allocated);
    None when a factory cannot be built there."""
    if isinstance(model, torch.nn.Module):
        return model
    try:
        with torch.device("meta"):
            built = model()
    except Exception as e:
        logger.info("memory check skipped: the model factory could not be built on the meta device (%s: %s)",
                    type(e).__name__, e)
        return None
    return built if isinstance(built, torch.nn.Module) else None


def _check_fits(model: Any, cfg: Config, cluster: ClusterConfig, nodes: list[dict]) -> None:
    """Reject a plan whose model states cannot fit in the memory the nodes' processes may really use, at the
    smallest world size of the range (the largest share per worker).  A factory is built on the meta device to
    count its parameters."""
    if not nodes:
        return
    counted = _model_for_count(model)
    if counted is None:
        return
    world = cluster.min_workers
    need, n = model_state_bytes(counted, cfg, world)
    # memory_total is per device: a node hosts as many workers as it has devices (one on a CPU node)
    biggest = max(r["memory_total"] for r in nodes)
    total = sum(r["memory_total"] * max(1, r.get("devices") or 1) for r in nodes)
    if need > biggest or need * world > total:
        gib = 1 << 30
        stage = cfg.zero_optimization.stage
        dtype = str(cfg.compute_dtype).replace("torch.", "")
        tp = cfg.tensor_parallel.autotp_size
        ep = cfg.expert_parallel.size
        layout = f" (tp {tp} x ep {ep})" if tp * ep > 1 else ""
        offload = cfg.zero_optimization.offload_optimizer.device
        layout += f" with the optimizer offloaded to {offload}" if offload not in ("none", "auto") else ""
        raise ConfigError(
            f"the plan cannot fit: {n:,} parameters at ZeRO stage {stage} with {dtype} compute on {world} "
            f"worker(s){layout} need {need / gib:.1f} GiB of model state per worker ({need:,} bytes, "
            f"{need / max(n, 1):.2f} bytes per parameter; docs/design.md, Memory per rank), {need * world / gib:.1f} "
            f"GiB for all {world}, and the nodes' usable memory is "
            f"{[round(r['memory_total'] / gib, 1) for r in nodes]} GiB (per device on a node with several); use a "
            "higher ZeRO stage, more workers, or bigger nodes"
            + ("" if offload == "nvme" else ", or offload the optimizer to NVMe (zero_optimization.offload_optimizer "
               "device 'nvme' or 'auto', with nvme_path)")
        )


def _checkpoint_location(storage: str, run_dir: str, checkpoint) -> str | None:
    """The latest checkpoint as the user addresses storage: a local path, or a URI like the storage's."""
    if checkpoint is None:
        return None
    if "://" not in storage:
        return checkpoint.path
    base, _, query = run_dir.partition("?")
    return f"{base}/{os.path.basename(checkpoint.path.rstrip('/'))}" + (f"?{query}" if query else "")


def _is_ray_dataset(data: Any) -> bool:
    try:
        import ray.data

        return isinstance(data, ray.data.Dataset)
    except ImportError:
        return False
