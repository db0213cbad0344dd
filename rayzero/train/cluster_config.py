"""``rayzero.ClusterConfig``: where and how wide a ``rayzero.fit`` run goes."""

from __future__ import annotations

import math
import os
from dataclasses import asdict, dataclass, field, fields
from typing import Any, Mapping

from rayzero.config import ConfigError, did_you_mean

STORAGE_ENV = "RAYZERO_STORAGE"


def default_storage() -> str:
    """``$RAYZERO_STORAGE`` if set, else ``~/rayzero_runs``: an absolute path that outlives the process.

    A relative default would land in the current directory, which for ``ray job submit --working-dir .`` is
    Ray's temporary copy of the working directory, deleted after the job.
    """
    env = os.environ.get(STORAGE_ENV, "").strip()
    if env:
        return env if "://" in env else os.path.abspath(os.path.expanduser(env))
    return os.path.join(os.path.expanduser("~"), "rayzero_runs")


@dataclass
class ClusterConfig:
    """``workers``: an int, or ``(min, max)`` for an elastic run that grows and shrinks with the cluster.

    ``storage``: a local path or pyarrow.fs URI for checkpoints and metrics (default
    ``$RAYZERO_STORAGE``, else ``~/rayzero_runs``: see :func:`default_storage`).
    ``checkpoint_every``: steps between checkpoints (0: only at the end).  ``address``: a Ray cluster to
    join; without it rayzero joins ``RAY_ADDRESS`` or a running cluster, else starts a local one.
    ``resume_from``: resume the run (same ``name``) from this checkpoint, a tag like
    ``"checkpoint_step00000040"`` or its step, instead of the newest one that verifies; newer ones are set aside.
    ``progress``: print the start-up phases and progress lines.  ``verbose``: leave Ray's own console output as
    Ray prints it (off: Ray Train's INFO lines, Ray's core log lines and the ranks' repeated lines are kept off
    the console; they stay in Ray's log files).  ``save_on_stop``: when SIGINT/SIGTERM on the driver stops the
    run, the workers save a checkpoint at the step they stop at (``rayzero.train.stop``).
    """

    workers: int | tuple[int, int] = 1
    use_gpu: bool = False
    resources_per_worker: dict = field(default_factory=lambda: {"CPU": 1})
    storage: str = field(default_factory=default_storage)
    name: str | None = None
    max_failures: int = 3
    checkpoint_every: int = 50
    keep_checkpoints: int = 2
    address: str | None = None
    micro_batch_sizes: list[int] | None = None  # acceptable micro-batch sizes for elastic re-planning
    elastic_check_interval_s: float = 10.0  # how often an elastic run looks for a bigger or smaller cluster
    start_timeout_s: float = 120.0  # how long to wait for an autoscaler to bring `min` workers' resources
    progress: bool = True  # the start-up phase lines and one progress line per update on the driver
    verbose: bool = False  # also Ray's own console output (Ray Train's INFO logs, Ray core lines, repeats)
    resume_from: str | int | None = None  # a checkpoint of this run (tag or step) to resume from, by hand
    save_on_stop: bool = True  # SIGINT/SIGTERM on the driver: save a checkpoint at the step the workers stop at

    @staticmethod
    def from_any(obj: "ClusterConfig | Mapping[str, Any] | int | None") -> "ClusterConfig":
        if isinstance(obj, ClusterConfig):
            cfg = obj
        elif obj is None:
            cfg = ClusterConfig()
        elif isinstance(obj, int):
            cfg = ClusterConfig(workers=obj)
        elif isinstance(obj, Mapping):
            known = {f.name for f in fields(ClusterConfig)}
            for key in obj:
                if key not in known:
                    raise ConfigError(f"unknown cluster config key {key!r}{did_you_mean(key, known)}")
            cfg = ClusterConfig(**dict(obj))
        else:
            raise ConfigError(f"cluster_cfg must be a rayzero.ClusterConfig, a dict or an int, got {type(obj).__name__}")
        cfg.validate()
        return cfg

    @property
    def min_workers(self) -> int:
        return self.workers[0] if isinstance(self.workers, (tuple, list)) else self.workers

    @property
    def max_workers(self) -> int:
        return self.workers[1] if isinstance(self.workers, (tuple, list)) else self.workers

    @property
    def elastic(self) -> bool:
        return self.min_workers != self.max_workers

    def validate(self) -> None:
        """Type and range of every field, each error naming the field (``check_fields``), then the GPU share."""
        check_fields(self)
        if isinstance(self.workers, list):
            self.workers = tuple(self.workers)
        gpus = self.resources_per_worker.get("GPU", 0) if isinstance(self.resources_per_worker, Mapping) else 0
        if gpus and (not isinstance(gpus, (int, float)) or gpus < 0 or gpus != int(gpus)):
            # Ray would place two such workers on one GPU, and a device backend (NCCL) refuses two ranks on
            # one device at its first collective
            raise ConfigError(
                f"resources_per_worker={{'GPU': {gpus!r}}}: each worker trains on whole GPUs of its own (two ranks "
                "cannot share one device); give every worker whole GPUs ({'GPU': 1}), and as many workers per "
                "node as it has GPUs"
            )
        if isinstance(self.storage, os.PathLike):
            self.storage = os.fspath(self.storage)
        r = self.resume_from  # (its type and range: check_fields)
        if r is not None and not self.name:
            raise ConfigError(f"resume_from={r!r} needs the run's name (ClusterConfig(name=...)): a run without one "
                              "gets a new name, so it has no checkpoint to resume from")
        if "://" not in self.storage:
            self.storage = os.path.abspath(self.storage)

    def to_dict(self) -> dict:
        return asdict(self)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _workers_ok(v: Any) -> bool:
    if isinstance(v, (tuple, list)):
        return len(v) == 2 and all(_is_int(x) and x >= 1 for x in v) and v[0] <= v[1]
    return _is_int(v) and v >= 1


def _resources_ok(v: Any) -> bool:
    return isinstance(v, Mapping) and all(
        isinstance(k, str) and k and _is_number(n) and n >= 0 for k, n in v.items()
    )


def _micro_ok(v: Any) -> bool:
    return v is None or (isinstance(v, (list, tuple)) and len(v) > 0 and all(_is_int(x) and x >= 1 for x in v))


def _name_ok(v: Any) -> bool:
    return v is None or (isinstance(v, str) and v.strip() != "" and "/" not in v and "\\" not in v
                         and v not in (".", ".."))


# every field: (the check, what it must be).  tests/test_fit_validation.py walks this table and fails when a
# field of ClusterConfig has no entry.
FIELD_CHECKS: dict[str, tuple[Any, str]] = {
    "workers": (_workers_ok, "an int >= 1, or (min, max) with 1 <= min <= max for an elastic run"),
    "use_gpu": (lambda v: isinstance(v, bool), "True or False"),
    "resources_per_worker": (_resources_ok, "a dict of Ray resource name -> amount >= 0, e.g. {'CPU': 1}"),
    "storage": (lambda v: isinstance(v, (str, os.PathLike)) and os.fspath(v).strip() != "",
                "a local path or a pyarrow.fs URI (a non-empty str)"),
    "name": (_name_ok, "None (a name from the start time) or a non-empty str without '/'"),
    "max_failures": (lambda v: _is_int(v) and v >= 0, "an int >= 0 (worker-group restarts allowed)"),
    "checkpoint_every": (lambda v: _is_int(v) and v >= 0, "an int >= 0 (steps between checkpoints; 0: only at the end)"),
    "keep_checkpoints": (lambda v: _is_int(v) and v >= 1, "an int >= 1 (checkpoints kept in storage)"),
    "address": (lambda v: v is None or (isinstance(v, str) and v.strip() != ""),
                "None or a Ray address such as 'ray://head:10001' or 'auto'"),
    "micro_batch_sizes": (_micro_ok, "None or a non-empty list of ints >= 1 (acceptable micro-batch sizes)"),
    "elastic_check_interval_s": (lambda v: _is_number(v) and v > 0, "a number of seconds > 0"),
    "start_timeout_s": (lambda v: _is_number(v) and v >= 0, "a number of seconds >= 0"),
    "progress": (lambda v: isinstance(v, bool), "True or False"),
    "verbose": (lambda v: isinstance(v, bool), "True or False"),
    "resume_from": (lambda v: v is None or (isinstance(v, str) and v.strip("/") != "") or (_is_int(v) and v >= 0),
                    "None (the newest checkpoint that verifies), a checkpoint tag of the run "
                    "('checkpoint_step00000040') or its step (an int >= 0)"),
    "save_on_stop": (lambda v: isinstance(v, bool),
                     "True (save a checkpoint when SIGINT/SIGTERM stops the run) or False"),
}


def check_fields(cfg: ClusterConfig) -> None:
    """A ConfigError naming the first field of ``cfg`` whose value has the wrong type or range."""
    for f in fields(cfg):
        check = FIELD_CHECKS.get(f.name)
        if check is None:
            continue
        ok, what = check
        value = getattr(cfg, f.name)
        if not ok(value):
            raise ConfigError(f"ClusterConfig.{f.name}={value!r} ({type(value).__name__}): must be {what}")
