"""DeepSpeed's learning-rate schedules, stepped the way DeepSpeed steps them.

Semantics (the same as DeepSpeed's runtime): a schedule keeps `last_batch_iteration`, the index of the last
`step()` call, -1 before the first. Building it sets every param group's lr to `lr_at(-1)`; the engine calls
`step()` after each optimizer step actually taken (never between accumulation boundaries nor on skipped
fp16/non-finite steps), which sets the lr to `lr_at(last_batch_iteration)`. So the optimizer step with index
i (0, 1, 2, ...) runs at `lr_at(i - 1)`:

  WarmupLR        lr_at(n) = min_lr + (max_lr - min_lr) * w(n), w(-1) = 0    (w: 0 -> 1 over warmup, then 1)
  WarmupDecayLR   as WarmupLR during warmup, then min_lr + (max_lr - min_lr) * max(0, (T - n) / max(1, T - W))
  WarmupCosineLR  base_lr * ratio(n): 0 at n = -1, warmup_min_ratio -> 1 over warmup, then a half cosine from 1
                  to cos_min_ratio, reached at n = T - 1 and held after (base_lr: each group's lr at build time)
  OneCycle        a triangle from cycle_min_lr up to cycle_max_lr (cycle_first_step_size steps) and back
                  (cycle_second_step_size), optionally in stairs; after the cycle cycle_min_lr, or
                  cycle_min_lr / (1 + decay_lr_rate * k / decay_step_size) k steps after it; with
                  cycle_momentum the first Adam beta runs the other way (cycle_max_mom -> cycle_min_mom ->
                  cycle_max_mom) and the second is set to 0.99, as DeepSpeed does
  LRRangeTest     lr_range_test_min_lr * (1 + lr_range_test_step_rate * (n + 1) / lr_range_test_step_size)
                  (the fraction floored with lr_range_test_staircase); lr_at(-1) = lr_range_test_min_lr

with w(n) = log(n + 1) / log(W) ("log") or n / W ("linear") for n < W, where W = max(2, warmup_num_steps).

State is `{"last_batch_iteration": n}`, DeepSpeed's key (a checkpoint from before this module's DeepSpeed
stepping, `{"last_epoch": k, ...}`, loads as n = k - 1: k steps taken).

Differences from DeepSpeed, on purpose: an unknown warmup_type and a non-number parameter are config
errors (DeepSpeed warns and uses "log", or fails later); per-group lists are given per user param group.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from typing import Any

import torch

from rayzero.config import ConfigError, SchedulerConfig, did_you_mean

logger = logging.getLogger(__name__)

WARMUP_TYPES = ("log", "linear")


def _bad(path: str, value: Any, requirement: str) -> ConfigError:
    return ConfigError(f"config key '{path}' = {value!r} is invalid: {requirement}")


def _as_int(path: str, value: Any, minimum: int, why: str = "") -> int:
    if isinstance(value, float) and math.isfinite(value) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise _bad(path, value, f"must be an integer >= {minimum}{why}")
    return value


def _as_float(path: str, value: Any, low: float, high: float = math.inf) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (low <= value <= high):
        bound = f"in [{low}, {high}]" if math.isfinite(high) else f">= {low}"
        raise _bad(path, value, f"must be a number {bound}")
    return float(value)


def _as_floats(low: float, high: float = math.inf):
    """One number for every group, or a list with one per group (as DeepSpeed allows)."""

    def check(path: str, value: Any) -> float | list[float]:
        if isinstance(value, (list, tuple)):
            return [_as_float(f"{path}[{i}]", v, low, high) for i, v in enumerate(value)]
        return _as_float(path, value, low, high)

    return check


_as_lrs = _as_floats(0.0)


def _as_warmup_type(path: str, value: Any) -> str:
    if value not in WARMUP_TYPES:
        raise _bad(path, value, f"must be one of {', '.join(repr(t) for t in WARMUP_TYPES)}")
    return value


def _as_bool(path: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise _bad(path, value, "must be true or false")
    return value


def _as_warmup_steps(path: str, value: Any) -> int:
    return _as_int(path, value, 1, " (as in DeepSpeed); for a constant learning rate leave out the 'scheduler' "
                                   "section")


def _per_group(name: str, value: float | Sequence[float], n_groups: int) -> list[float]:
    if isinstance(value, (list, tuple)):
        if len(value) != n_groups:
            raise ConfigError(
                f"scheduler param '{name}' has {len(value)} values but the optimizer has {n_groups} param "
                "groups; give one number or one per group"
            )
        return [float(v) for v in value]
    return [float(value)] * n_groups


def _set_lrs(optimizer: torch.optim.Optimizer, lrs: Sequence[float]) -> list[float]:
    """Write each group's lr (in place where it is a tensor, as a captured step binds it)."""
    for group, lr in zip(optimizer.param_groups, lrs, strict=True):
        if isinstance(group["lr"], torch.Tensor):
            group["lr"].fill_(lr)
        else:
            group["lr"] = lr
    return [float(lr) for lr in lrs]


class DeepSpeedSchedule:
    """Base: subclasses define lr_at(n), the lr after the step with index n (n = -1: as built)."""

    def __init__(self, optimizer: torch.optim.Optimizer, last_batch_iteration: int = -1) -> None:
        self.optimizer = optimizer
        self.last_batch_iteration = int(last_batch_iteration)
        self._last_lr: list[float] | None = None
        if self.last_batch_iteration == -1:
            self._apply()

    def lr_at(self, n: int) -> list[float]:
        raise NotImplementedError

    def betas_at(self, n: int) -> list[tuple[float, float]] | None:
        """The Adam betas the schedule sets at n, or None when it leaves them alone."""
        return None

    def _apply(self) -> None:
        self._last_lr = _set_lrs(self.optimizer, self.lr_at(self.last_batch_iteration))
        betas = self.betas_at(self.last_batch_iteration)
        if betas is not None:
            for group, b in zip(self.optimizer.param_groups, betas, strict=True):
                group["betas"] = b

    def get_lr(self) -> list[float]:
        return self.lr_at(self.last_batch_iteration)

    def get_last_lr(self) -> list[float]:
        if self._last_lr is None:
            raise RuntimeError(f"{type(self).__name__}.get_last_lr(): call step() first")
        return self._last_lr

    def step(self, last_batch_iteration: int | None = None) -> None:
        """Advance to `last_batch_iteration` (default: the next one) and set the optimizer's lr for it."""
        if last_batch_iteration is None:
            last_batch_iteration = self.last_batch_iteration + 1
        self.last_batch_iteration = int(last_batch_iteration)
        self._apply()

    def state_dict(self) -> dict[str, Any]:
        return {"last_batch_iteration": self.last_batch_iteration}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore the position in the schedule and put the optimizer at its lr (the schedule itself comes
        from the config)."""
        if "last_batch_iteration" in state_dict:
            self.last_batch_iteration = int(state_dict["last_batch_iteration"])
        elif "last_epoch" in state_dict:  # rayzero's earlier scheduler state: last_epoch steps taken
            self.last_batch_iteration = int(state_dict["last_epoch"]) - 1
        else:
            raise ConfigError(f"scheduler state has neither 'last_batch_iteration' nor 'last_epoch': "
                              f"{sorted(state_dict)}")
        self._apply()


def _warmup_fraction(n: int, warmup_num_steps: int, warmup_type: str) -> float:
    """DeepSpeed's warmup gamma at n < warmup_num_steps (warmup_num_steps already at least 2)."""
    if warmup_type == "log":
        return math.log(n + 1) / math.log(warmup_num_steps)
    return n / warmup_num_steps


def _warn_total(total: int, warmup: int) -> None:
    if total < warmup:
        logger.warning("scheduler total_num_steps %d is less than warmup_num_steps %d: the schedule ends "
                       "during warmup (DeepSpeed warns the same)", total, warmup)


class WarmupLR(DeepSpeedSchedule):
    """Warm up from warmup_min_lr to warmup_max_lr (default: each group's lr) over warmup_num_steps."""

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        warmup_min_lr: float | Sequence[float] = 0.0,
        warmup_max_lr: float | Sequence[float] | None = None,
        warmup_num_steps: int = 1000,
        warmup_type: str = "log",
        last_batch_iteration: int = -1,
    ) -> None:
        n = len(optimizer.param_groups)
        if warmup_max_lr is None:
            warmup_max_lr = [float(g["lr"]) for g in optimizer.param_groups]
        self.min_lrs = _per_group("warmup_min_lr", _as_lrs("warmup_min_lr", warmup_min_lr), n)
        self.max_lrs = _per_group("warmup_max_lr", _as_lrs("warmup_max_lr", warmup_max_lr), n)
        self.warmup_num_steps = max(2, _as_warmup_steps("warmup_num_steps", warmup_num_steps))
        self.warmup_type = _as_warmup_type("warmup_type", warmup_type)
        super().__init__(optimizer, last_batch_iteration)

    def _gamma(self, n: int) -> float:
        return _warmup_fraction(n, self.warmup_num_steps, self.warmup_type) if n < self.warmup_num_steps else 1.0

    def lr_at(self, n: int) -> list[float]:
        if n < 0:
            return list(self.min_lrs)
        gamma = self._gamma(n)
        return [lo + (hi - lo) * gamma for lo, hi in zip(self.min_lrs, self.max_lrs)]


class WarmupDecayLR(WarmupLR):
    """WarmupLR, then linear decay from warmup_max_lr to warmup_min_lr at total_num_steps."""

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        total_num_steps: int,
        warmup_min_lr: float | Sequence[float] = 0.0,
        warmup_max_lr: float | Sequence[float] = 0.001,
        warmup_num_steps: int = 1000,
        warmup_type: str = "log",
        last_batch_iteration: int = -1,
    ) -> None:
        self.total_num_steps = _as_int("total_num_steps", total_num_steps, 1)
        super().__init__(optimizer, warmup_min_lr, warmup_max_lr, warmup_num_steps, warmup_type,
                         last_batch_iteration)
        _warn_total(self.total_num_steps, self.warmup_num_steps)

    def _gamma(self, n: int) -> float:
        if n < self.warmup_num_steps:
            return _warmup_fraction(n, self.warmup_num_steps, self.warmup_type)
        return max(0.0, (self.total_num_steps - n) / max(1.0, self.total_num_steps - self.warmup_num_steps))


class WarmupCosineLR(DeepSpeedSchedule):
    """Ratio of each group's lr: warmup_min_ratio -> 1 over warmup, then cosine to cos_min_ratio."""

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        total_num_steps: int,
        warmup_min_ratio: float = 0.0,
        warmup_num_steps: int = 1000,
        cos_min_ratio: float = 0.0001,
        warmup_type: str = "log",
        last_batch_iteration: int = -1,
    ) -> None:
        self.total_num_steps = _as_int("total_num_steps", total_num_steps, 1)
        self.warmup_min_ratio = _as_float("warmup_min_ratio", warmup_min_ratio, 0.0, 1.0)
        self.warmup_num_steps = max(2, _as_warmup_steps("warmup_num_steps", warmup_num_steps))
        self.cos_min_ratio = _as_float("cos_min_ratio", cos_min_ratio, 0.0, 1.0)
        self.warmup_type = _as_warmup_type("warmup_type", warmup_type)
        _warn_total(self.total_num_steps, self.warmup_num_steps)
        self.org_lrs = [float(g["lr"]) for g in optimizer.param_groups]
        super().__init__(optimizer, last_batch_iteration)

    def ratio_at(self, n: int) -> float:
        if n < 0:
            return 0.0
        if n < self.warmup_num_steps:
            frac = _warmup_fraction(n, self.warmup_num_steps, self.warmup_type)
            return self.warmup_min_ratio + (1.0 - self.warmup_min_ratio) * frac
        progress = min(1.0, (n - self.warmup_num_steps + 1) / max(1, self.total_num_steps - self.warmup_num_steps))
        return max(0.0, self.cos_min_ratio + (1.0 - self.cos_min_ratio) * (1 + math.cos(math.pi * progress)) / 2)

    def lr_at(self, n: int) -> list[float]:
        ratio = self.ratio_at(n)
        return [base * ratio for base in self.org_lrs]


class OneCycle(DeepSpeedSchedule):
    """DeepSpeed's 1Cycle: lr up cycle_min_lr -> cycle_max_lr and back, then optional decay; with
    cycle_momentum (and an optimizer with betas) the first beta cycles the other way."""

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        cycle_min_lr: float | Sequence[float],
        cycle_max_lr: float | Sequence[float],
        decay_lr_rate: float = 0.0,
        cycle_first_step_size: float = 2000,
        cycle_second_step_size: float | None = None,
        cycle_first_stair_count: int = 0,
        cycle_second_stair_count: int | None = None,
        decay_step_size: float = 0,
        cycle_momentum: bool = True,
        cycle_min_mom: float | Sequence[float] = 0.8,
        cycle_max_mom: float | Sequence[float] = 0.9,
        decay_mom_rate: float = 0.0,
        last_batch_iteration: int = -1,
    ) -> None:
        n = len(optimizer.param_groups)
        first = _as_float("cycle_first_step_size", cycle_first_step_size, 0.0)
        if first <= 0:
            raise _bad("cycle_first_step_size", cycle_first_step_size, "must be a number > 0")
        second = first if cycle_second_step_size is None else _as_float(
            "cycle_second_step_size", cycle_second_step_size, 0.0)
        self.first_step_size, self.second_step_size = first, second
        self.total_size = first + second
        self.step_ratio = first / self.total_size
        self.first_stair_count = _as_int("cycle_first_stair_count", cycle_first_stair_count, 0)
        self.second_stair_count = (self.first_stair_count if cycle_second_stair_count is None
                                   else _as_int("cycle_second_stair_count", cycle_second_stair_count, 0))
        self.decay_step_size = _as_float("decay_step_size", decay_step_size, 0.0)
        self.min_lrs = _per_group("cycle_min_lr", _as_lrs("cycle_min_lr", cycle_min_lr), n)
        self.max_lrs = _per_group("cycle_max_lr", _as_lrs("cycle_max_lr", cycle_max_lr), n)
        self.decay_lr_rate = _as_float("decay_lr_rate", decay_lr_rate, -math.inf)
        no_decay = math.isclose(self.decay_step_size, 0)
        self.skip_lr_decay = no_decay or math.isclose(self.decay_lr_rate, 0)
        self.cycle_momentum = _as_bool("cycle_momentum", cycle_momentum)
        if self.cycle_momentum and "betas" not in optimizer.defaults:
            logger.warning("OneCycle: cycle_momentum is off: optimizer %s has no betas (DeepSpeed does the same)",
                           type(optimizer).__name__)
            self.cycle_momentum = False
        self.decay_mom_rate = _as_float("decay_mom_rate", decay_mom_rate, -math.inf)
        self.skip_mom_decay = no_decay or math.isclose(self.decay_mom_rate, 0)
        self.min_moms = [(m, 0.99) for m in _per_group("cycle_min_mom", _as_floats(0.0, 1.0)(
            "cycle_min_mom", cycle_min_mom), n)]
        self.max_moms = [(m, 0.99) for m in _per_group("cycle_max_mom", _as_floats(0.0, 1.0)(
            "cycle_max_mom", cycle_max_mom), n)]
        super().__init__(optimizer, last_batch_iteration)

    def scale_at(self, n: int) -> float:
        """Where in the cycle the step after index n is: 0 at the bottom, 1 at the top."""
        it = n + 1
        x = 1.0 + it / self.total_size - math.floor(1 + it / self.total_size)
        if x <= self.step_ratio:
            scale, stairs = x / self.step_ratio, self.first_stair_count
        else:
            scale, stairs = (x - 1) / (self.step_ratio - 1), self.second_stair_count
        if stairs > 0:  # flat for whole stairs, counted from the integer position in the cycle
            pos = it % self.total_size
            if pos <= self.first_step_size:
                where = pos * stairs / self.first_step_size
            else:
                where = (self.total_size - pos) * stairs / self.second_step_size
            scale = math.floor(where) / stairs
        return scale

    def lr_at(self, n: int) -> list[float]:
        if n < 0:
            return list(self.min_lrs)
        if n < self.total_size:
            scale = self.scale_at(n)
            return [lo + (hi - lo) * scale for lo, hi in zip(self.min_lrs, self.max_lrs)]
        if self.skip_lr_decay:
            return list(self.min_lrs)
        factor = 1 + self.decay_lr_rate * (n - self.total_size + 1) / self.decay_step_size
        return [lo / factor for lo in self.min_lrs]

    def betas_at(self, n: int) -> list[tuple[float, float]] | None:
        if not self.cycle_momentum:
            return None
        if n < 0:
            return list(self.min_moms)
        if n < self.total_size:
            scale = self.scale_at(n)
            return [(hi[0] - (hi[0] - lo[0]) * scale, lo[1]) for lo, hi in zip(self.min_moms, self.max_moms)]
        if self.skip_mom_decay:
            return list(self.max_moms)
        factor = 1 + self.decay_mom_rate * (n - self.total_size + 1) / self.decay_step_size
        return [(b0 * factor, b1) for b0, b1 in self.max_moms]

    def get_mom(self) -> list[tuple[float, float]] | None:
        return self.betas_at(self.last_batch_iteration)


class LRRangeTest(DeepSpeedSchedule):
    """DeepSpeed's LR range test: the lr grows linearly (or in stairs) from lr_range_test_min_lr."""

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        lr_range_test_min_lr: float | Sequence[float] = 1e-3,
        lr_range_test_step_size: int = 2000,
        lr_range_test_step_rate: float = 1.0,
        lr_range_test_staircase: bool = False,
        last_batch_iteration: int = -1,
    ) -> None:
        n = len(optimizer.param_groups)
        self.min_lrs = _per_group("lr_range_test_min_lr", _as_lrs("lr_range_test_min_lr", lr_range_test_min_lr), n)
        self.step_size = _as_int("lr_range_test_step_size", lr_range_test_step_size, 1)
        self.step_rate = _as_float("lr_range_test_step_rate", lr_range_test_step_rate, -math.inf)
        self.staircase = _as_bool("lr_range_test_staircase", lr_range_test_staircase)
        super().__init__(optimizer, last_batch_iteration)

    def lr_at(self, n: int) -> list[float]:
        if n < 0:
            return list(self.min_lrs)
        interval = (n + 1) / self.step_size
        if self.staircase:
            interval = math.floor(interval)
        return [lo * (1 + self.step_rate * interval) for lo in self.min_lrs]


_SCHEDULERS: dict[str, type[DeepSpeedSchedule]] = {
    "warmuplr": WarmupLR,
    "warmupdecaylr": WarmupDecayLR,
    "warmupcosinelr": WarmupCosineLR,
    "onecycle": OneCycle,
    "lrrangetest": LRRangeTest,
}
SUPPORTED_SCHEDULERS = ("WarmupLR", "WarmupDecayLR", "WarmupCosineLR", "OneCycle", "LRRangeTest")

_int0 = lambda p, v: _as_int(p, v, 0)  # noqa: E731
_steps = lambda p, v: _as_int(p, v, 1)  # noqa: E731
_ratio = lambda p, v: _as_float(p, v, 0.0, 1.0)  # noqa: E731
_number = lambda p, v: _as_float(p, v, -math.inf)  # noqa: E731
_size = lambda p, v: _as_float(p, v, 0.0)  # noqa: E731

# name -> (required, validator(path, value))
_PARAMS: dict[type[DeepSpeedSchedule], dict[str, tuple[bool, Any]]] = {
    WarmupLR: {
        "warmup_min_lr": (False, _as_lrs),
        "warmup_max_lr": (False, _as_lrs),
        "warmup_num_steps": (False, _as_warmup_steps),
        "warmup_type": (False, _as_warmup_type),
    },
    WarmupCosineLR: {
        "total_num_steps": (True, _steps),
        "warmup_min_ratio": (False, _ratio),
        "warmup_num_steps": (False, _as_warmup_steps),
        "cos_min_ratio": (False, _ratio),
        "warmup_type": (False, _as_warmup_type),
    },
    OneCycle: {
        "cycle_min_lr": (True, _as_lrs),
        "cycle_max_lr": (True, _as_lrs),
        "decay_lr_rate": (False, _number),
        "cycle_first_step_size": (False, _size),
        "cycle_second_step_size": (False, _size),
        "cycle_first_stair_count": (False, _int0),
        "cycle_second_stair_count": (False, _int0),
        "decay_step_size": (False, _size),
        "cycle_momentum": (False, _as_bool),
        "cycle_min_mom": (False, _as_floats(0.0, 1.0)),
        "cycle_max_mom": (False, _as_floats(0.0, 1.0)),
        "decay_mom_rate": (False, _number),
    },
    LRRangeTest: {
        "lr_range_test_min_lr": (False, _as_lrs),
        "lr_range_test_step_size": (False, _steps),
        "lr_range_test_step_rate": (False, _number),
        "lr_range_test_staircase": (False, _as_bool),
    },
}
_PARAMS[WarmupDecayLR] = {"total_num_steps": (True, _steps), **_PARAMS[WarmupLR]}
for _spec in _PARAMS.values():  # DeepSpeed passes the params to the constructor: a resumed position too
    _spec["last_batch_iteration"] = (False, lambda p, v: _as_int(p, v, -1))


def resolve_scheduler(cfg: SchedulerConfig) -> tuple[type[DeepSpeedSchedule], dict[str, Any]]:
    """The scheduler class and checked constructor kwargs for `cfg`; raises ConfigError on bad input."""
    key = cfg.type.lower()
    if key not in _SCHEDULERS:
        raise ConfigError(f"config key 'scheduler.type' = {cfg.type!r} is unknown; supported types: "
                          f"{', '.join(SUPPORTED_SCHEDULERS)}")
    cls = _SCHEDULERS[key]
    spec = _PARAMS[cls]
    kwargs: dict[str, Any] = {}
    problems = []
    for name, value in cfg.params.items():
        if name not in spec:
            problems.append(f"unknown config key 'scheduler.params.{name}'{did_you_mean(name, spec)} "
                            f"({cls.__name__} accepts: {', '.join(spec)})")
            continue
        try:
            kwargs[name] = spec[name][1](f"scheduler.params.{name}", value)
        except ConfigError as e:
            problems.append(str(e))
    for name, (required, _) in spec.items():
        if required and name not in cfg.params:
            problems.append(f"config key 'scheduler.params.{name}' is required for {cls.__name__}")
    if cls is OneCycle and "cycle_first_step_size" in kwargs and kwargs["cycle_first_step_size"] <= 0:
        problems.append("config key 'scheduler.params.cycle_first_step_size' = "
                        f"{cfg.params['cycle_first_step_size']!r} is invalid: must be a number > 0")
    if problems:
        raise ConfigError(problems[0] if len(problems) == 1 else
                          f"{len(problems)} problems in 'scheduler':\n  " + "\n  ".join(problems))
    return cls, kwargs


def build_scheduler(
    cfg: SchedulerConfig | None,
    optimizer: torch.optim.Optimizer,
    user_group_of: list[int] | None = None,
    user_groups: int | None = None,
) -> DeepSpeedSchedule | None:
    """The configured scheduler over `optimizer` (which it sets to its starting lr), or None.

    ``user_group_of[i]`` is the user's param group that optimizer group ``i`` belongs to (rayzero splits a
    user's group by reduction domain, e.g. dense parameters and experts): per-group lists in the config
    are per user group (``user_groups`` of them, all-frozen ones included) and are spread over the
    optimizer groups here.
    """
    if cfg is None:
        return None
    cls, kwargs = resolve_scheduler(cfg)
    if user_group_of is not None:
        users = user_groups if user_groups is not None else len(set(user_group_of))
        for name, value in kwargs.items():
            if isinstance(value, (list, tuple)):
                if len(value) != users:
                    raise ConfigError(
                        f"scheduler param '{name}' has {len(value)} values but there are {users} param "
                        "groups; give one number or one per group"
                    )
                kwargs[name] = [value[u] for u in user_group_of]
    return cls(optimizer, **kwargs)
