"""``rayzero tune``: short training trials on the real cluster, run by Ray Tune, that choose the ZeRO stage,
micro-batch, bucket sizes and offload for a model and a config; the fastest config is written as JSON.

Each trial is a ``rayzero.fit`` of ``warmup + steps`` steps with one candidate config, on the cluster's
workers; its score is the median step time of the steps after the warm-up (from the run's metrics).  Trials
run one at a time (they measure speed, so they must not share the machines), as Ray Tune trials whose
driver asks for no CPU of its own, so the workers get the whole cluster.

The global batch the user asked for never changes: a candidate micro-batch only trades with gradient
accumulation.  A candidate whose model states cannot fit in the memory the nodes' processes may use (the
same check ``fit`` makes, cgroup and rlimit aware) is skipped without a trial.  A trial that fails is
recorded with its error and the search goes on.  Every trial's run directory, and Ray Tune's own files, live
under one temporary directory removed when tuning ends, however it ends; a trial's workers end with its
``fit`` (and with the trial's actor, which owns them, if Ray Tune stops it).

The search (``CoordinateSearch``) starts from the user's config with derived buckets and walks one choice at
a time (stage, then micro-batch, then bucket size, then offload), keeping the best value of each before
moving to the next: 1 + sum(len(choice) - 1) trials instead of the grid's product; then the ``confirm``
fastest run once more and a config's time is the fastest of its runs.  ``search="grid"`` runs the whole grid
instead, each config once (to check the search against it: bench/README.md).
"""

from __future__ import annotations

import itertools
import json
import math
import os
import shutil
import statistics
import tempfile
import time
from dataclasses import dataclass
from typing import Any, Callable

import torch
from ray import tune as ray_tune
from ray.tune.search import Searcher

from rayzero.config import Config, ConfigError
from rayzero.train.cluster_config import ClusterConfig

CHOICES = ("stage", "micro_batch", "bucket", "offload")


@dataclass
class Trial:
    point: dict
    status: str  # "ok", "failed" or "skipped"
    step_s: float | None = None
    note: str = ""


@dataclass
class TuneResult:
    best_config: dict
    best: Trial
    trials: list[Trial]
    grid_size: int
    out: str | None = None

    def table(self) -> str:
        return format_table(self.trials, self.best)


@dataclass
class SearchSpace:
    choices: dict[str, list]
    start: dict
    base: dict  # the user's config, as a plain dict
    world: int
    global_batch: int
    derived_bucket: int

    def points(self) -> list[dict]:
        return [dict(zip(CHOICES, values)) for values in itertools.product(*(self.choices[c] for c in CHOICES))]


def point_key(point: dict) -> tuple:
    return tuple(point[c] for c in CHOICES)


def describe(point: dict) -> str:
    return (f"stage {point['stage']}, micro-batch {point['micro_batch']}, buckets {point['bucket']:,}, "
            f"offload {point['offload']}")


def config_for(space: SearchSpace, point: dict) -> dict:
    """The user's config with ``point`` applied; the global batch stays the user's."""
    cfg = json.loads(json.dumps(space.base))
    tp = cfg.get("tensor_parallel", {}).get("autotp_size", 1) or 1
    per_worker = space.global_batch // max(1, space.world // tp)
    cfg["train_batch_size"] = space.global_batch
    cfg["train_micro_batch_size_per_gpu"] = point["micro_batch"]
    cfg["gradient_accumulation_steps"] = per_worker // point["micro_batch"]
    z = cfg.setdefault("zero_optimization", {})
    z["stage"] = point["stage"]
    z["reduce_bucket_size"] = z["allgather_bucket_size"] = point["bucket"]
    if point["offload"] != "none" or "offload_optimizer" in z:
        z.setdefault("offload_optimizer", {})["device"] = point["offload"]
    return cfg


def build_space(model_meta: torch.nn.Module | None, config: Any, world: int, use_gpu: bool, *,
                stages=None, micro_batches=None, bucket_factors=(0.25, 0.5, 1.0, 2.0),
                offload=None) -> SearchSpace:
    from rayzero.train.planning import _divisors
    from rayzero.zero.buckets import derive_bucket_sizes

    cfg = Config.from_any(config if config is not None else {})
    base = _raw(config)
    tp = cfg.tensor_parallel.autotp_size
    if cfg.train_batch_size is None and cfg.train_micro_batch_size_per_gpu is None:
        raise ConfigError("rayzero tune keeps the global batch the config asks for: set train_batch_size (or "
                          "train_micro_batch_size_per_gpu and gradient_accumulation_steps) in the config")
    batch = cfg.resolve_batch(max(1, world // tp))
    global_batch = batch.train_batch_size
    per_worker = global_batch // max(1, world // tp)
    divisors = _divisors(per_worker)
    user_micro = batch.micro_batch_size
    if micro_batches is None:  # within a factor of 4 of the user's micro-batch
        micro_batches = [d for d in divisors if user_micro / 4 <= d <= user_micro * 4]
    bad = [m for m in micro_batches if m not in divisors]
    if bad:
        raise ConfigError(f"micro-batch sizes {bad} do not divide the {per_worker} samples per worker of the global "
                          f"batch {global_batch} on {world} workers; choose from {divisors}")
    z = cfg.zero_optimization
    stages = sorted(set(stages if stages is not None else [1, 2, 3, z.stage]))
    if any(s not in (0, 1, 2, 3) for s in stages):
        raise ConfigError(f"stages must be among 0, 1, 2, 3; got {stages}")
    user_offload = z.offload_optimizer.device if z.offload_optimizer.device in ("cpu", "nvme") else "none"
    offload = list(dict.fromkeys(offload if offload is not None else [user_offload]))
    if any(o not in ("none", "cpu", "nvme") for o in offload):
        raise ConfigError(f"offload choices must be among none, cpu, nvme; got {offload}")
    if "nvme" in offload and not z.offload_optimizer.nvme_path:
        raise ConfigError("offload choice 'nvme' needs zero_optimization.offload_optimizer.nvme_path in the config")
    derived = 0
    if model_meta is not None:
        params = [p for p in model_meta.parameters() if p.requires_grad]
        plan = derive_bucket_sizes(model_meta, params, lambda p: p.numel(), "nccl" if use_gpu else "gloo",
                                   cfg.comm_dtype.itemsize, None, None)
        derived = plan.reduce_bucket_size
    if not derived:
        raise ConfigError("rayzero tune needs the model's shapes to size buckets: pass a model, or a factory that "
                          "builds on the meta device")
    buckets = sorted({max(1, int(derived * f)) for f in bucket_factors})
    choices = dict(stage=stages, micro_batch=sorted(set(micro_batches)), bucket=buckets, offload=offload)
    start = dict(stage=z.stage if z.stage in stages else stages[-1],
                 micro_batch=user_micro if user_micro in choices["micro_batch"] else choices["micro_batch"][-1],
                 bucket=derived if derived in buckets else buckets[len(buckets) // 2],
                 offload=user_offload if user_offload in offload else offload[0])
    return SearchSpace(choices, start, base, world, global_batch, derived)


def _raw(config: Any) -> dict:
    """The config as the user wrote it (a dict), so the tuned file differs from it only in the tuned keys."""
    import copy
    from pathlib import Path

    from rayzero.config import _load_file

    if config is None:
        return {}
    if isinstance(config, Config):
        return config.to_dict()
    if isinstance(config, (str, os.PathLike)):
        return _load_file(Path(config))
    return copy.deepcopy(dict(config))


def infeasible(space: SearchSpace, point: dict, model_meta, cluster: ClusterConfig, nodes: list[dict]) -> str | None:
    """Why ``point`` cannot run (without a trial), or None."""
    if point["offload"] != "none" and point["stage"] == 0:
        return "offload needs ZeRO stage 1 or more"
    if model_meta is None:
        return None
    from rayzero.train.state_memory import _check_fits

    try:
        _check_fits(model_meta, Config.from_any(config_for(space, point)), cluster, nodes)
    except ConfigError as e:
        return str(e).split(";")[0]
    return None


class CoordinateSearch(Searcher):
    """One choice at a time from the start point; the best value of each choice is kept for the next.  Then
    the ``confirm`` fastest configs run once more, and each config's time is the fastest of its runs: on a
    shared machine a run is only ever slowed down, so a second run of the close contenders keeps one unlucky
    measurement from deciding.

    A Ray Tune searcher: Ray Tune runs the trials it suggests, one at a time."""

    def __init__(self, space: SearchSpace, skip: Callable[[dict], str | None], on_skip: Callable[[dict, str], None],
                 confirm: int = 3):
        super().__init__(metric="step_s", mode="min")
        self.space, self.skip, self.on_skip, self.confirm = space, skip, on_skip, confirm
        self.best = dict(space.start)
        self.choice = 0
        self.seen: dict[tuple, float] = {}  # point -> fastest step time (inf: failed, skipped or running)
        self.confirmed: list[tuple] = []  # points already run a second time
        self.live: dict[str, dict] = {}

    def _measured(self) -> dict[tuple, float]:
        return {k: v for k, v in self.seen.items() if math.isfinite(v)}

    def _next(self) -> dict | None:
        while self.choice < len(CHOICES):
            name = CHOICES[self.choice]
            for value in self.space.choices[name]:
                p = {**self.best, name: value}
                if point_key(p) in self.seen:
                    continue
                why = self.skip(p)
                if why:
                    self.seen[point_key(p)] = math.inf
                    self.on_skip(p, why)
                    continue
                return p
            done = self._measured()
            if done:  # the best of everything measured so far: it is on this choice's line or better
                self.best = dict(zip(CHOICES, min(done, key=done.get)))
            self.choice += 1
        done = self._measured()
        for k in sorted(done, key=done.get)[: self.confirm]:
            if k not in self.confirmed:
                self.confirmed.append(k)
                return dict(zip(CHOICES, k))
        if done:
            self.best = dict(zip(CHOICES, min(done, key=done.get)))
        return None

    def suggest(self, trial_id: str):
        if self.live:
            return None  # one trial at a time: the next choice depends on this result
        p = self._next()
        if p is None:
            return self.FINISHED
        self.seen.setdefault(point_key(p), math.inf)  # until its first result arrives
        self.live[trial_id] = p
        return {"point": p}

    def on_trial_complete(self, trial_id: str, result: dict | None = None, error: bool = False) -> None:
        p = self.live.pop(trial_id, None)
        if p is not None and result and not error and result.get("status") == "ok":
            k = point_key(p)
            self.seen[k] = min(self.seen.get(k, math.inf), float(result["step_s"]))

    # Ray Tune saves a searcher with its experiment; the search is small state, kept as plain values
    def save(self, checkpoint_path: str) -> None:
        with open(checkpoint_path, "w") as f:
            json.dump({"best": self.best, "choice": self.choice, "confirmed": [list(k) for k in self.confirmed],
                       "seen": [[list(k), v] for k, v in self.seen.items()]}, f)

    def restore(self, checkpoint_path: str) -> None:
        with open(checkpoint_path) as f:
            state = json.load(f)
        self.best, self.choice = state["best"], state["choice"]
        self.confirmed = [tuple(k) for k in state["confirmed"]]
        self.seen = {tuple(k): v for k, v in state["seen"]}


class _Progress(ray_tune.Callback):
    """One line on the driver as each trial ends."""

    def __init__(self, say: Callable[[str], None], grid: int):
        self.say, self.grid, self.done = say, grid, 0

    def on_trial_complete(self, iteration, trials, trial, **info) -> None:
        self.done += 1
        point, m = (trial.config or {}).get("point"), trial.last_result or {}
        if point is None:
            return
        what = f"{m['step_s']:.3f} s/step" if m.get("status") == "ok" else f"failed: {m.get('error', 'no result')}"
        self.say(f"[rayzero tune] trial {self.done} (grid {self.grid}): {describe(point)}: {what}")


def step_times(history: list[dict], warmup: int) -> list[float]:
    """Seconds per step after the first ``warmup`` steps, from a run's metrics records (rank 0's clock)."""
    by_step = {}
    for r in history:
        if "time" in r:
            by_step[r["step"]] = r["time"]
    steps = sorted(by_step)
    return [by_step[b] - by_step[a] for a, b in zip(steps, steps[1:]) if a >= warmup]


def _run_trial(params: dict, job: dict) -> None:
    """One Ray Tune trial: a short ``fit`` with the candidate config; reports its median step time."""
    import contextlib
    import io

    from ray import tune

    from rayzero.train.fit import fit

    point = params["point"]
    space: SearchSpace = job["space"]
    name = "trial-" + "-".join(str(v) for v in point_key(point))
    cluster = ClusterConfig(workers=space.world, use_gpu=job["use_gpu"], resources_per_worker=job["resources"],
                            storage=job["storage"], name=name, max_failures=0,
                            checkpoint_every=job["steps"] + job["warmup"] + 1, keep_checkpoints=1, progress=False)
    report: dict = {"status": "failed", "step_s": math.inf}
    try:
        with contextlib.redirect_stdout(io.StringIO()):  # fit's node table and notes, once per trial
            result = fit(job["model"], cluster, config=config_for(space, point), data=job["data"],
                         loss_fn=job["loss_fn"], train_step=job["train_step"], collate=job["collate"],
                         max_steps=job["warmup"] + job["steps"], seed=job["seed"])
        times = step_times(result.history, job["warmup"])
        if times:
            report = {"status": "ok", "step_s": statistics.median(times)}
        else:
            report["error"] = "the run recorded no timed steps"
    except Exception as e:
        # a worker's error arrives as a traceback inside Ray's; its last line is the error itself
        lines = [line.strip() for line in str(e).splitlines() if line.strip()]
        report["error"] = f"{type(e).__name__}: {lines[-1] if lines else ''}"[:500]
    finally:
        shutil.rmtree(os.path.join(job["storage"], name), ignore_errors=True)
    tune.report(report)


def tune(
    model: torch.nn.Module | Callable[[], torch.nn.Module],
    cluster_cfg: ClusterConfig | dict | int | None = None,
    config: Any = None,
    data: Any = None,
    loss_fn: Callable | None = None,
    *,
    train_step: Callable | None = None,
    collate: Callable | None = None,
    steps: int = 6,
    warmup: int = 2,
    stages: list[int] | None = None,
    micro_batches: list[int] | None = None,
    bucket_factors: tuple[float, ...] = (0.25, 0.5, 1.0, 2.0),
    offload: list[str] | None = None,
    search: str = "coordinate",
    confirm: int = 3,
    out: str | None = None,
    seed: int = 0,
    progress: Callable[[str], None] | None = lambda line: print(line, flush=True),
) -> TuneResult:
    """Find the fastest config for ``model`` on the cluster; ``fit``'s arguments, plus what to search.

    Returns the trials and the best config (also written to ``out`` as JSON, which ``rayzero.fit`` and
    ``rayzero.initialize`` take as is)."""
    import ray

    from rayzero.train.agent import node_table
    from rayzero.train.fit import _ensure_ray
    from rayzero.train.metrics import set_worker_output
    from rayzero.train.state_memory import _model_for_count

    if search not in ("coordinate", "grid"):
        raise ConfigError(f"search must be 'coordinate' or 'grid', got {search!r}")
    if steps < 2 or warmup < 1:
        raise ConfigError(f"tune needs steps >= 2 and warmup >= 1 (got steps {steps}, warmup {warmup})")
    cluster = ClusterConfig.from_any(cluster_cfg)
    if cluster.elastic:
        raise ConfigError("rayzero tune measures one world size: give a fixed number of workers, not a range")
    say = progress or (lambda s: None)
    meta = _model_for_count(model)
    space = build_space(meta, config, cluster.min_workers, cluster.use_gpu, stages=stages,
                        micro_batches=micro_batches, bucket_factors=bucket_factors, offload=offload)
    connected = ray.is_initialized()
    _ensure_ray(cluster)
    set_worker_output(quiet=not cluster.verbose)  # Ray core lines of the trials' processes stay in Ray's logs
    nodes = node_table()
    trials: list[Trial] = []
    skipped: dict[tuple, str] = {}

    def skip(p: dict) -> str | None:
        if point_key(p) not in skipped:
            why = infeasible(space, p, meta, cluster, nodes)
            if why is None:
                return None
            skipped[point_key(p)] = why
        return skipped[point_key(p)]

    def on_skip(p: dict, why: str) -> None:
        trials.append(Trial(p, "skipped", note=why))
        say(f"[rayzero tune] skipped {describe(p)}: {why}")

    grid = space.points()
    root = tempfile.mkdtemp(prefix="rayzero-tune-")
    job = dict(space=space, model=model, data=data, loss_fn=loss_fn, train_step=train_step, collate=collate,
               steps=steps, warmup=warmup, seed=seed, use_gpu=cluster.use_gpu,
               resources=cluster.resources_per_worker, storage=os.path.join(root, "runs"))
    say(f"[rayzero tune] {len(grid)} configs in the grid ({', '.join(f'{c} {space.choices[c]}' for c in CHOICES)}); "
        f"global batch {space.global_batch} on {space.world} workers; {warmup} + {steps} steps a trial; "
        f"search: {search}")
    t0 = time.perf_counter()
    try:
        if search == "grid":
            runnable = [p for p in grid if skip(p) is None]
            for p in grid:
                if point_key(p) in skipped:
                    on_skip(p, skipped[point_key(p)])
            tune_config = ray_tune.TuneConfig(max_concurrent_trials=1, num_samples=1)
            param_space = {"point": ray_tune.grid_search(runnable)}
        else:
            searcher = CoordinateSearch(space, skip, on_skip, confirm=confirm)
            tune_config = ray_tune.TuneConfig(search_alg=searcher, max_concurrent_trials=1,
                                              num_samples=len(grid) + confirm,
                                              metric="step_s", mode="min")
            param_space = {}
        trainable = ray_tune.with_resources(ray_tune.with_parameters(_run_trial, job=job),
                                             {"cpu": 0, "memory": 1})
        os.environ.setdefault("RAY_AIR_NEW_OUTPUT", "0")  # Ray Tune's own tables off: trials print as they end
        tuner = ray_tune.Tuner(
            trainable, param_space=param_space, tune_config=tune_config,
            run_config=ray_tune.RunConfig(name="tune", storage_path=os.path.join(root, "tune"), verbose=0,
                                          callbacks=[_Progress(say, len(grid))]),
        )
        results = tuner.fit()
        for r in results:
            m = r.metrics or {}
            p = (r.config or {}).get("point")
            if p is None:
                continue
            if m.get("status") == "ok":
                t = Trial(p, "ok", step_s=float(m["step_s"]))
            else:
                t = Trial(p, "failed", note=str(m.get("error") or r.error or "no result"))
            trials.append(t)
    finally:
        shutil.rmtree(root, ignore_errors=True)
        if not connected and ray.is_initialized():
            ray.shutdown()  # the connection (and a local cluster) tune itself made
    ok = [t for t in trials if t.status == "ok"]
    if not ok:
        raise RuntimeError("rayzero tune: no trial finished; the table says why:\n" + format_table(trials, None))
    best = min(ok, key=lambda t: t.step_s)
    best_config = config_for(space, best.point)
    Config.from_any(best_config)  # what fit and initialize will read
    result = TuneResult(best_config, best, trials, len(grid), out)
    if out:
        with open(out, "w") as f:
            json.dump(best_config, f, indent=2)
    say(result.table())
    say(f"[rayzero tune] {len([t for t in trials if t.status != 'skipped'])} trials of a {len(grid)}-config grid "
        f"in {time.perf_counter() - t0:.0f} s; best: {describe(best.point)}, {best.step_s:.3f} s/step"
        + (f"; config written to {out}" if out else ""))
    return result


def format_table(trials: list[Trial], best: Trial | None) -> str:
    lines = ["| stage | micro-batch | buckets (elements) | offload | s/step | |", "|---:|---:|---:|---|---:|---|"]
    for t in sorted(trials, key=lambda t: (t.status != "ok", t.step_s or math.inf)):
        p = t.point
        s = f"{t.step_s:.3f}" if t.status == "ok" else t.status
        mark = "best" if t is best else (t.note[:120] if t.status != "ok" else "")
        lines.append(f"| {p['stage']} | {p['micro_batch']} | {p['bucket']:,} | {p['offload']} | {s} | {mark} |")
    return "\n".join(lines)


__all__ = ["CoordinateSearch", "SearchSpace", "Trial", "TuneResult", "build_space", "config_for", "tune"]
