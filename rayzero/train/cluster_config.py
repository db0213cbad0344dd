"""``rayzero.ClusterConfig``: where and how wide a ``rayzero.fit`` run goes."""

from __future__ import annotations

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
        w = self.workers
        if isinstance(w, list):
            self.workers = w = tuple(w)
        if isinstance(w, tuple):
            if len(w) != 2 or not all(isinstance(x, int) for x in w) or not 1 <= w[0] <= w[1]:
                raise ConfigError(f"workers={w!r}: an elastic range is (min, max) with 1 <= min <= max")
        elif not isinstance(w, int) or w < 1:
            raise ConfigError(f"workers={w!r}: give a positive int, or (min, max) for an elastic run")
        if self.checkpoint_every < 0 or self.keep_checkpoints < 1 or self.max_failures < 0:
            raise ConfigError(
                "checkpoint_every must be >= 0, keep_checkpoints >= 1 and max_failures >= 0 "
                f"(got {self.checkpoint_every}, {self.keep_checkpoints}, {self.max_failures})"
            )
        gpus = self.resources_per_worker.get("GPU", 0) if isinstance(self.resources_per_worker, Mapping) else 0
        if gpus and (not isinstance(gpus, (int, float)) or gpus < 0 or gpus != int(gpus)):
            # Ray would place two such workers on one GPU, and a device backend (NCCL) refuses two ranks on
            # one device at its first collective
            raise ConfigError(
                f"resources_per_worker={{'GPU': {gpus!r}}}: each worker trains on whole GPUs of its own (two ranks "
                "cannot share one device); give every worker whole GPUs ({'GPU': 1}), and as many workers per "
                "node as it has GPUs"
            )
        if not isinstance(self.save_on_stop, bool):
            raise ConfigError(f"save_on_stop={self.save_on_stop!r}: give True (save a checkpoint when SIGINT/SIGTERM "
                              "stops the run) or False")
        if "://" not in self.storage:
            self.storage = os.path.abspath(self.storage)

    def to_dict(self) -> dict:
        return asdict(self)
