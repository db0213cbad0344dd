"""``rayzero.fit``: the driver.  Plans, checks, launches Ray Train workers, follows progress, returns a Result."""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from rayzero.accelerator import ACCELERATOR_ENV_VAR
from rayzero.checkpoint.storage import Storage
from rayzero.config import Config, ConfigError
from rayzero.train.cluster_config import ClusterConfig
from rayzero.train.metrics import new_worker_group, read_metrics
from rayzero.train.offload_check import absolute_nvme_paths, check_swap_fits, node_slots, resolve_auto, swap_path
from rayzero.train.planning import MicroBatchSizes, StepPlan, plan_range, skipped_sizes
from rayzero.train.resume import prepare_resume
from rayzero.train.state_memory import _check_fits, _model_for_count
from rayzero.train.validation import check_fit_args, check_model
from rayzero.train.stop import RunStopped, StopSignals, clear_stop, resume_text, stopped_message
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
    resumed_from: int | None = None  # the checkpoint step this fit started from (None: a fresh run)


class ClusterTooSmallError(RuntimeError):
    """The Ray cluster cannot host the run's minimum number of workers: it cannot grow, or did not in time."""


def _say(cluster: ClusterConfig, text: str) -> None:
    """A start-up phase line on the driver (with ``progress``), and in the log."""
    logger.info("%s", text)
    if cluster.progress:
        print(f"[rayzero] {text}", flush=True)


def _cluster_summary() -> str:
    import ray

    nodes = [n for n in ray.nodes() if n.get("Alive")]
    total = ray.cluster_resources()
    parts = [f"{len(nodes)} node{'' if len(nodes) == 1 else 's'}"]
    parts += [f"{total[k]:g} {k}" for k in ("CPU", "GPU") if total.get(k)]
    return ", ".join(parts)


def _ensure_ray(cluster: ClusterConfig) -> bool:
    """Join or start Ray, saying which; returns whether this process started the cluster (a local one: it has
    no autoscaler).  Unless ``verbose``, Ray's INFO lines on the driver are off."""
    import ray

    from rayzero.train.agent import started_here

    if ray.is_initialized():
        _say(cluster, f"using the Ray cluster this process is connected to ({_cluster_summary()})")
        return started_here()
    address = cluster.address or os.environ.get("RAY_ADDRESS")
    try:
        from ray._private.services import canonicalize_bootstrap_address

        running = canonicalize_bootstrap_address(address)  # where ray.init() will connect, None: start one
    except Exception:
        running = address
    _say(cluster, f"connecting to the Ray cluster at {running}" if running else "starting a local Ray cluster")
    token_notice = logging.getLogger("ray._private.authentication.authentication_token_setup")
    level = token_notice.level
    if not cluster.verbose:
        token_notice.setLevel(logging.ERROR)  # "token authentication is enabled ...", on every local start
    try:
        kwargs = {} if cluster.verbose else {"logging_level": logging.WARNING}
        if address:
            context = ray.init(address=address, log_to_driver=True, **kwargs)
        else:
            # No address: join a cluster started on this machine with `ray start`, else start one sized to it.
            context = ray.init(log_to_driver=True, **kwargs)
    finally:
        token_notice.setLevel(level)
    here = started_here()
    dashboard = getattr(context, "dashboard_url", None)
    _say(cluster, f"{'started a local Ray cluster' if here else 'connected'}: {_cluster_summary()}"
         + (f", dashboard http://{dashboard}" if dashboard else ""))
    return here


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


def _wait_for_resources(cluster: ClusterConfig, started: bool) -> None:
    """Make sure the cluster has worker slots for ``min`` workers before anything starts on it.

    A slot is one worker's resources on one node (a worker never spans nodes).  Too few slots: a cluster that
    cannot grow (this process started it, or no autoscaler runs on it) is refused at once with the numbers; with
    an autoscaler the driver asks it for the workers (``ray.autoscaler.sdk.request_resources``) and waits up to
    ``start_timeout_s``, saying what is missing.  Enough slots but not enough free now: Ray Train waits for them."""
    from rayzero.train.agent import autoscaler_status, cluster_nodes, describe_slots, slots, worker_bundle

    bundle = worker_bundle(cluster.resources_per_worker, cluster.use_gpu)
    want, most = cluster.min_workers, cluster.max_workers
    nodes = cluster_nodes()
    have = sum(slots(total, bundle) for _, total, _ in nodes)
    plural = "s" if want != 1 else ""
    why = ""
    if have < want:  # probing the autoscaler can take seconds: only when the answer decides something
        if started:
            grows, why = False, "this process started it as a local cluster, which has no autoscaler"
        else:
            grows, why = autoscaler_status()
        if not grows:
            raise ClusterTooSmallError(
                f"the Ray cluster is too small for {want} worker{plural} and cannot grow: "
                f"{describe_slots(bundle, nodes, want)} ({len(nodes)} node{'' if len(nodes) == 1 else 's'}); "
                f"{why}. " + (f"Ask for at most {have} worker(s) (an elastic range like workers=(1, {have}) grows "
                              "when nodes join), lower resources_per_worker, or add nodes" if have else
                              "No node can host one worker: lower resources_per_worker, or add nodes that have them")
            )
    elif cluster.elastic and have < most:
        _say(cluster, f"the elastic range goes up to {most} workers, and the cluster has {have} worker slots now"
                      + (" (a local cluster: it cannot grow)" if started else " (more join as nodes are added)"))
    if have < want:
        _grow(cluster, bundle, want, why)
        nodes = cluster_nodes()
    else:
        _say(cluster, f"{want} worker{plural} wanted, the cluster has {describe_slots(bundle, nodes, want)}")
    free = sum(slots(avail, bundle) for _, _, avail in nodes)
    if free < want:
        _say(cluster, f"waiting for {want} worker{plural}: {describe_slots(bundle, nodes, want, free=True)}; "
                      "Ray Train starts them when the resources are free")


def _grow(cluster: ClusterConfig, bundle: dict, want: int, why: str) -> None:
    """Ask the autoscaler for ``want`` workers' slots and wait for them (up to ``start_timeout_s``)."""
    from ray.autoscaler.sdk import request_resources

    from rayzero.train.agent import cluster_nodes, describe_slots, slots

    plural = "s" if want != 1 else ""
    request_resources(bundles=[dict(bundle) for _ in range(want)])
    started = time.monotonic()
    deadline = started + cluster.start_timeout_s
    said, said_at = None, 0.0
    try:
        while True:
            nodes = cluster_nodes()
            have = sum(slots(total, bundle) for _, total, _ in nodes)
            if have >= want:
                _say(cluster, f"the cluster has grown to {have} worker slots "
                              f"(after {time.monotonic() - started:.0f} s)")
                return
            now = time.monotonic()
            detail = describe_slots(bundle, nodes, want)
            if now > deadline:
                raise ClusterTooSmallError(
                    f"the Ray cluster is still too small for {want} worker{plural} after waiting "
                    f"{cluster.start_timeout_s:g} s for its autoscaler ({why}): {detail}. `ray status` shows what "
                    "the autoscaler is doing; raise start_timeout_s, lower workers or resources_per_worker, or add "
                    "nodes"
                )
            if detail != said or now - said_at >= 30:
                _say(cluster, f"waiting for {want} worker{plural}: {detail}; the autoscaler was asked for them "
                              f"({why}); {deadline - now:.0f} s left of start_timeout_s")
                said, said_at = detail, now
            time.sleep(1.0)
    finally:
        request_resources(bundles=[])  # Ray Train asks for its workers itself once it runs


def _train_loop(spec: WorkerSpec) -> dict:
    """What Ray Train runs on each worker: rank 0 tells the driver that the worker group is up and what it builds
    and loads (``publish_phase``), then every rank runs ``worker.train_loop_per_worker``."""
    import ray.train

    from rayzero.train.metrics import publish_phase

    if not spec.extra.get("verbose", True):
        _quiet_train_reports()
    if spec.extra.get("accelerator"):
        # the accelerator the driver names reaches every worker (a node's own setting stays)
        os.environ.setdefault(ACCELERATOR_ENV_VAR, spec.extra["accelerator"])
    ctx = ray.train.get_context()
    if ctx.get_world_rank() == 0:
        world = ctx.get_world_size()
        text = f"{world} worker{'' if world == 1 else 's'} up: building the model and engine"
        publish_phase(ctx.get_experiment_name(), text, start=True)  # the worker loop publishes the next phases
    return train_loop_per_worker(spec)


def _torch_backend(cluster: ClusterConfig) -> str | None:
    """The backend of the default group Ray Train starts: the GPUs' own where workers get GPUs, else Ray's
    choice (gloo).  Where that group cannot carry the workers' accelerator tensors, rayzero makes a group of
    the accelerator's backend over the same ranks (``rayzero.comm.world_group``)."""
    gpus = cluster.use_gpu or (cluster.resources_per_worker or {}).get("GPU", 0) > 0
    return "nccl" if gpus else None


def _quiet_train_reports() -> None:
    """Ray Train 2.60 logs every ``ray.train.report`` at INFO ("Reporting training result N: TrainingReport(...)")
    on a logger named by its file's path, outside ``ray.train``, so ``RunConfig(logging_config=...)`` does not
    reach it; on a worker of a quiet run it is set to WARNING."""
    try:
        from ray.train.v2._internal.execution import context

        logging.getLogger(context.__file__).setLevel(logging.WARNING)
    except Exception:
        pass


class _Progress(threading.Thread):
    """Prints the workers' start-up phases as they come, and step, loss, lr, samples/s and an ETA from the run's
    metrics file: one line per update, readable in `ray job logs` (rewritten in place only on a terminal).
    Only this fit's records count (a resumed run's file holds the earlier ones too)."""

    def __init__(self, run_dir: str, max_steps: int, run: str, every_s: float = 2.0, tick_s: float = 0.5):
        super().__init__(daemon=True, name="rayzero-progress")
        self.run_dir, self.max_steps, self.run_name = run_dir, max_steps, run
        self.every_s, self.tick_s = every_s, tick_s
        self.stop = threading.Event()
        self.tty = sys.stdout.isatty()
        self.inline = False  # a progress line is on the terminal's current line
        self.last_step: int | None = None
        self.seen: set = set()
        self.groups = 0
        try:
            self.skip = len(read_metrics(run_dir))
        except (FileNotFoundError, OSError):
            self.skip = 0

    def run(self) -> None:
        next_show = 0.0
        while True:
            stopping = self.stop.wait(self.tick_s)
            self.phases()
            if stopping or time.monotonic() >= next_show:
                self.show()
                next_show = time.monotonic() + self.every_s
            if stopping:
                break
        if self.inline:
            print(flush=True)

    def emit(self, line: str, inline: bool = False) -> None:
        if self.tty and inline:
            print("\r" + line + "\x1b[K", end="", flush=True)
            self.inline = True
            return
        if self.inline:
            print(flush=True)
            self.inline = False
        print(line, flush=True)

    def phases(self) -> None:
        from rayzero.train.metrics import read_phases

        try:
            new = read_phases(self.run_name, self.seen)
        except Exception:
            return
        for phase in new:
            text = phase.get("text", "")
            if phase.get("start"):
                self.groups += 1
                if self.groups > 1:
                    text = f"worker group restarted: {text}"
                    new_worker_group()
            self.emit(f"[rayzero] {text}")

    def show(self) -> None:
        from rayzero.train.metrics import eta_seconds, progress_line

        try:
            records = read_metrics(self.run_dir)[self.skip:]
        except (FileNotFoundError, OSError):
            return
        if not records or records[-1]["step"] == self.last_step:
            return
        self.last_step = records[-1]["step"]
        self.emit(progress_line(records[-1], self.max_steps, eta_seconds(records, self.max_steps)), inline=True)


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
    from ray.train import CheckpointConfig, FailureConfig, LoggingConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchConfig

    from rayzero.train.failure_policy import RayzeroTrainer
    from rayzero.train.metrics import clear_phases, set_worker_output

    cluster = ClusterConfig.from_any(cluster_cfg)
    cfg = Config.from_any(config if config is not None else {})
    check_fit_args(model=model, data=data, loss_fn=loss_fn, max_steps=max_steps, train_step=train_step,
                   collate=collate, seed=seed, shuffle=shuffle, record_samples=record_samples, zero_init=zero_init)
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
    _check_picklable(model)
    counted = _model_for_count(model)  # the model itself, or the factory's built on the meta device
    check_model(counted, model, cfg)  # it has parameters to train, and EP/TP sizes divide it
    name = cluster.name or f"rayzero-{time.strftime('%Y%m%d-%H%M%S')}"
    _check_storage(cluster.storage)
    # a URI keeps its scheme (and query) so the driver reads the run where the workers write it
    run_dir = _in_run(cluster.storage, name)
    # the checkpoint to resume from (the newest that verifies, or resume_from), and Ray Train's record of the
    # run made to agree with what is on storage, before anything starts
    resume = prepare_resume(run_dir, cluster.resume_from, warn=lambda text: print(f"[rayzero] {text}", flush=True))

    started = _ensure_ray(cluster)
    _wait_for_resources(cluster, started)
    from rayzero.train.agent import check_probes, format_node_table, node_table

    nodes = node_table()
    logger.info("nodes:\n%s", format_node_table(nodes))
    print(format_node_table(nodes), flush=True)
    check_probes(cfg, nodes)
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
        compile_cache=_in_run(run_dir, "compile_cache"),
        extra={"verbose": cluster.verbose, "accelerator": os.environ.get(ACCELERATOR_ENV_VAR, "").strip() or None,
               "save_on_stop": cluster.save_on_stop},
    )
    for what in ("data", "loss_fn", "train_step", "collate"):
        try:
            import ray.cloudpickle as cloudpickle

            cloudpickle.dumps(getattr(spec, what))
        except Exception as e:
            raise TypeError(f"{what} cannot be sent to the workers ({type(e).__name__}: {e}); make it picklable "
                            "(a module-level function or class, or a factory)") from None
    workers = (cluster.min_workers, cluster.max_workers) if cluster.elastic else cluster.min_workers
    trainer = RayzeroTrainer(  # a TorchTrainer that ends the run at a fatal worker error (train/failures.py)
        _train_loop,
        train_loop_config=spec,
        torch_config=TorchConfig(backend=_torch_backend(cluster)),
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
            # Ray Train's INFO lines (resource requests, worker group starts, every report's TrainingReport)
            logging_config=LoggingConfig(log_level="INFO" if cluster.verbose else "WARNING"),
        ),
        datasets={"train": data} if _is_ray_dataset(data) else None,
    )
    if resume is not None:
        _say(cluster, f"resuming run {name} from step {resume[0]} (checkpoint {resume[1]})")
    _say(cluster, f"launching {cluster.min_workers}" + (f"-{cluster.max_workers}" if cluster.elastic else "")
         + f" worker{'s' if cluster.max_workers > 1 else ''} with Ray Train (run {name})")
    progress = _Progress(run_dir, max_steps, name) if cluster.progress else None
    swap_root = swap_path(cfg)  # with NVMe offload: one NodeSwapStore per node owns the run's swap files
    swap_stores: dict = {}  # their handles: a store lives while its creator holds one
    # with graph capture: one NodeCompileCache per node owns the node's compile cache and keeps it in step
    # with the run's compile_cache/ (unless the config names its own cache_dir)
    compile_owned = cfg.graph_capture.enabled and not cfg.graph_capture.cache_dir
    compile_caches: dict = {}
    try:
        if swap_root:
            _start_swap(counted, cfg, cluster, sorted(plans), name, swap_root, swap_stores)
        if compile_owned:
            from rayzero.train.compile_actor import start_compile_caches

            start_compile_caches(spec.compile_cache, name, [r["node_id"] for r in nodes], compile_caches)
        if progress is not None:
            progress.start()
        set_worker_output(quiet=not cluster.verbose)
        clear_stop(name)  # a request left by an earlier stop of this run on this cluster
        with StopSignals(name, _shout, cluster.save_on_stop) as signals:
            _own_stop_signals(trainer, signals)
            try:
                result = trainer.fit()
            except Exception as failure:  # Ray's wrapper around a worker's error
                _raise_fatal(failure)  # an error no retry gets past: raised itself, once
                ours = _user_error(failure)  # a worker's CheckpointError (a save that failed) as rayzero raised it
                if ours is failure:
                    raise
                raise ours from None
    finally:
        if progress is not None and progress.is_alive():
            progress.stop.set()
            progress.join(timeout=10)
        try:
            clear_phases(name)
            clear_stop(name)
        except Exception:
            pass
        if swap_root:
            from rayzero.train.swap_actor import shutdown_stores

            shutdown_stores(name, swap_stores)  # removes the run's swap files on every node, however the run ended
        if compile_owned:
            from rayzero.train.compile_actor import shutdown_compile_caches

            shutdown_compile_caches(name, compile_caches)  # uploads what the nodes compiled, then cleans them
    if result.error is not None:
        raise _user_error(result.error)
    history = read_metrics(run_dir)
    if signals.signal_name is not None:
        _check_stopped(signals.signal_name, cluster, name, run_dir, max_steps, history, result.checkpoint)
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
        resumed_from=resume[0] if resume is not None else None,
    )


def _raise_fatal(failure: BaseException) -> None:
    """Raise the worker error behind ``failure`` itself when it is fatal (``rayzero.train.failures``): its type
    and message once, with a note of the rank and why the run was not retried.  Returns when it is not."""
    from rayzero.train.failures import fatal_error

    found = fatal_error(failure)
    if found is None:
        return
    rank, error = found
    error.add_note(f"[rayzero] raised on rank {rank}; the run stopped at once without a retry (max_failures is "
                   "for lost workers and nodes: a retry would meet this error again)")
    raise error from None


def _user_error(error: BaseException) -> BaseException:
    """The error ``fit`` raises for a failed run: a worker's CheckpointError (a full disk, a save that failed)
    as rayzero raised it, with Ray's own error as its cause, rather than Ray's wrapper around it."""
    from rayzero.checkpoint.format import CheckpointError
    from rayzero.train.failures import cause_of

    failures = getattr(error, "worker_failures", None) or {}
    for rank in sorted(failures):
        cause = cause_of(failures[rank], CheckpointError)
        if cause is not None:
            ours = CheckpointError(f"{cause} (rank {rank})")
            ours.__cause__ = error  # Ray's error, with every worker's traceback
            return ours
    return error


def _shout(text: str) -> None:
    """A line the user must see (a stop), whatever ``progress`` says; never raises (it runs in signal handlers)."""
    logger.info("%s", text)
    try:
        print(f"[rayzero] {text}", file=sys.stderr, flush=True)
    except Exception:  # noqa: BLE001 - a reentrant write from a signal handler
        pass


def _own_stop_signals(trainer, signals: StopSignals) -> None:
    """Ray Train 2.60's ``trainer.fit()`` installs its own SIGINT handler (it aborts the run, saving nothing) just
    before it waits; rayzero keeps its own (``StopSignals``) and takes only the controller handle, which a second
    signal aborts."""
    if hasattr(trainer, "_register_sigint_handler"):
        trainer._register_sigint_handler = lambda controller: setattr(signals, "controller", controller)


def _check_stopped(why: str, cluster: ClusterConfig, name: str, run_dir: str, max_steps: int, history: list[dict],
                   checkpoint) -> None:
    """After a run asked to stop returned: raise ``RunStopped`` saying what was saved and how to resume, unless
    the run had reached ``max_steps`` (it finished: a note, and ``fit`` returns)."""
    from rayzero.train.worker import TAG_FORMAT

    step = history[-1]["step"] if history else None
    if step is not None and step >= max_steps:
        _shout(f"{why} came as run {name} finished its last step: nothing to stop")
        return
    location = _checkpoint_location(cluster.storage, run_dir, checkpoint)
    saved = bool(location) and step is not None and os.path.basename(location.rstrip("/")) == TAG_FORMAT.format(step)
    how = resume_text(name, cluster.name is not None, cluster.storage)
    message = stopped_message(name, why, step, location, saved, how)
    _shout(message)
    raise RunStopped(message, name, step, location, saved)


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


def _in_run(run_dir: str, name: str) -> str:
    """``name`` inside the run directory, a path or a URI (whose query stays at the end)."""
    if "://" not in run_dir:
        return os.path.join(run_dir, name)
    base, _, query = run_dir.partition("?")
    return f"{base.rstrip('/')}/{name}" + (f"?{query}" if query else "")


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
