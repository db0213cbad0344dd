"""DeepSpeed's warmup learning-rate schedules as torch `LRScheduler`s.

All three are closed-form in the step count `last_epoch` (the number of `step()` calls so far; the
optimizer step with index i runs at lr(i)), so a checkpoint only needs that count:

  WarmupLR        lr = min_lr + (max_lr - min_lr) * w(i)                 (w: 0 -> 1 over warmup, then 1)
  WarmupDecayLR   as WarmupLR during warmup, then min_lr + (max_lr - min_lr) * max(0, (T - i) / (T - W)):
                  linear decay to warmup_min_lr (0 by default) at step T = total_num_steps
  WarmupCosineLR  lr = base_lr * ratio; ratio rises warmup_min_ratio -> 1 over warmup, then follows a
                  half cosine from 1 down to cos_min_ratio at step T (base_lr: each group's own lr)

with warmup w(i) = log(i + 1) / log(W) ("log") or i / W ("linear") for i < W.

Differences from DeepSpeed, on purpose: `warmup_num_steps: 0` means no warmup (DeepSpeed silently
warms up over 2 steps); WarmupCosineLR holds cos_min_ratio after total_num_steps (DeepSpeed's cosine
rises again); total_num_steps below warmup_num_steps and unknown warmup_type are errors, not warnings.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from typing import Any

import torch
from torch.optim.lr_scheduler import LRScheduler

from rayzero.config import ConfigError, NotSupportedYetError, SchedulerConfig, did_you_mean

logger = logging.getLogger(__name__)

WARMUP_TYPES = ("log", "linear")


def _bad(path: str, value: Any, requirement: str) -> ConfigError:
    return ConfigError(f"config key '{path}' = {value!r} is invalid: {requirement}")


def _as_int(path: str, value: Any, minimum: int) -> int:
    if isinstance(value, float) and math.isfinite(value) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise _bad(path, value, f"must be an integer >= {minimum}")
    return value


def _as_float(path: str, value: Any, low: float, high: float = math.inf) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (low <= value <= high):
        bound = f"in [{low}, {high}]" if math.isfinite(high) else f">= {low}"
        raise _bad(path, value, f"must be a number {bound}")
    return float(value)


def _as_lrs(path: str, value: Any) -> float | list[float]:
    """One lr for every group, or a list with one lr per group (as DeepSpeed allows)."""
    if isinstance(value, (list, tuple)):
        return [_as_float(f"{path}[{i}]", v, 0.0) for i, v in enumerate(value)]
    return _as_float(path, value, 0.0)


def _as_warmup_type(path: str, value: Any) -> str:
    if value not in WARMUP_TYPES:
        raise _bad(path, value, f"must be one of {', '.join(repr(t) for t in WARMUP_TYPES)}")
    return value


def _per_group(name: str, value: float | Sequence[float], n_groups: int) -> list[float]:
    if isinstance(value, (list, tuple)):
        if len(value) != n_groups:
            raise ConfigError(
                f"scheduler param '{name}' has {len(value)} values but the optimizer has {n_groups} param "
                "groups; give one number or one per group"
            )
        return [float(v) for v in value]
    return [float(value)] * n_groups


def _warmup_fraction(step: int, warmup_num_steps: int, warmup_type: str) -> float:
    """0 at step 0, rising to 1 at step warmup_num_steps, then 1."""
    if step >= warmup_num_steps:
        return 1.0
    if warmup_type == "log":
        return math.log(step + 1) / math.log(max(2, warmup_num_steps))
    return step / warmup_num_steps


def _plain(value: Any) -> Any:
    """Tensors -> floats and tuples -> lists, so the state dict is JSON-serialisable."""
    if isinstance(value, torch.Tensor):
        return value.item()
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    return value


class _ClosedFormScheduler(LRScheduler):
    """Base: subclasses define lr_at(step); state is the step count plus plain-number settings."""

    # Settings that define the schedule (compared on load; the config is what counts).
    _settings: tuple[str, ...] = ()

    def lr_at(self, step: int) -> list[float]:
        raise NotImplementedError

    def get_lr(self) -> list[float]:
        return self.lr_at(max(self.last_epoch, 0))

    _get_closed_form_lr = get_lr

    def state_dict(self) -> dict[str, Any]:
        return _plain(super().state_dict())

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore the position in the schedule; the schedule itself comes from this scheduler's config."""
        changed = {k: (state_dict[k], getattr(self, k)) for k in self._settings
                   if k in state_dict and state_dict[k] != _plain(getattr(self, k))}
        if changed:
            logger.warning("%s: checkpoint schedule settings differ from the config, using the config: %s",
                           type(self).__name__,
                           ", ".join(f"{k} saved {old!r} now {new!r}" for k, (old, new) in changed.items()))
        self.last_epoch = int(state_dict["last_epoch"])
        self._step_count = int(state_dict.get("_step_count", self.last_epoch + 1))
        # Put the optimizer at the restored step's lr, whatever its param groups held before.
        for group, lr in zip(self.optimizer.param_groups, self.get_lr(), strict=True):
            if isinstance(group["lr"], torch.Tensor):
                group["lr"].fill_(lr)
            else:
                group["lr"] = lr
        self._last_lr = [float(group["lr"]) for group in self.optimizer.param_groups]


class WarmupLR(_ClosedFormScheduler):
    """Warm up from warmup_min_lr to warmup_max_lr over warmup_num_steps, then hold warmup_max_lr."""

    _settings = ("min_lrs", "max_lrs", "warmup_num_steps", "warmup_type")

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        warmup_min_lr: float | Sequence[float] = 0.0,
        warmup_max_lr: float | Sequence[float] = 0.001,
        warmup_num_steps: int = 1000,
        warmup_type: str = "log",
        last_epoch: int = -1,
    ) -> None:
        n = len(optimizer.param_groups)
        self.min_lrs = _per_group("warmup_min_lr", _as_lrs("warmup_min_lr", warmup_min_lr), n)
        self.max_lrs = _per_group("warmup_max_lr", _as_lrs("warmup_max_lr", warmup_max_lr), n)
        self.warmup_num_steps = _as_int("warmup_num_steps", warmup_num_steps, 0)
        self.warmup_type = _as_warmup_type("warmup_type", warmup_type)
        super().__init__(optimizer, last_epoch)

    def _gamma(self, step: int) -> float:
        return _warmup_fraction(step, self.warmup_num_steps, self.warmup_type)

    def lr_at(self, step: int) -> list[float]:
        gamma = self._gamma(step)
        return [lo + (hi - lo) * gamma for lo, hi in zip(self.min_lrs, self.max_lrs)]


class WarmupDecayLR(WarmupLR):
    """WarmupLR, then linear decay from warmup_max_lr to warmup_min_lr at total_num_steps."""

    _settings = WarmupLR._settings + ("total_num_steps",)

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        total_num_steps: int,
        warmup_min_lr: float | Sequence[float] = 0.0,
        warmup_max_lr: float | Sequence[float] = 0.001,
        warmup_num_steps: int = 1000,
        warmup_type: str = "log",
        last_epoch: int = -1,
    ) -> None:
        self.total_num_steps = _check_total(total_num_steps, warmup_num_steps)
        super().__init__(optimizer, warmup_min_lr, warmup_max_lr, warmup_num_steps, warmup_type, last_epoch)

    def _gamma(self, step: int) -> float:
        if step < self.warmup_num_steps:
            return super()._gamma(step)
        span = max(1, self.total_num_steps - self.warmup_num_steps)
        return max(0.0, (self.total_num_steps - step) / span)


class WarmupCosineLR(_ClosedFormScheduler):
    """Ratio of each group's own lr: warmup_min_ratio -> 1 over warmup, cosine to cos_min_ratio at the end."""

    _settings = ("total_num_steps", "warmup_min_ratio", "warmup_num_steps", "cos_min_ratio", "warmup_type")

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        total_num_steps: int,
        warmup_min_ratio: float = 0.0,
        warmup_num_steps: int = 1000,
        cos_min_ratio: float = 0.0001,
        warmup_type: str = "log",
        last_epoch: int = -1,
    ) -> None:
        self.total_num_steps = _check_total(total_num_steps, warmup_num_steps)
        self.warmup_min_ratio = _as_float("warmup_min_ratio", warmup_min_ratio, 0.0, 1.0)
        self.warmup_num_steps = _as_int("warmup_num_steps", warmup_num_steps, 0)
        self.cos_min_ratio = _as_float("cos_min_ratio", cos_min_ratio, 0.0, 1.0)
        self.warmup_type = _as_warmup_type("warmup_type", warmup_type)
        super().__init__(optimizer, last_epoch)

    def ratio_at(self, step: int) -> float:
        if step < self.warmup_num_steps:
            frac = _warmup_fraction(step, self.warmup_num_steps, self.warmup_type)
            return self.warmup_min_ratio + (1.0 - self.warmup_min_ratio) * frac
        # As DeepSpeed: the first step after warmup is already one step into the decay.
        decay_steps = max(1, self.total_num_steps - self.warmup_num_steps)
        progress = min(1.0, (step - self.warmup_num_steps + 1) / decay_steps)
        return self.cos_min_ratio + (1.0 - self.cos_min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))

    def lr_at(self, step: int) -> list[float]:
        ratio = self.ratio_at(step)
        return [float(base) * ratio for base in self.base_lrs]


def _check_total(total_num_steps: Any, warmup_num_steps: Any) -> int:
    total = _as_int("total_num_steps", total_num_steps, 1)
    warmup = _as_int("warmup_num_steps", warmup_num_steps, 0)
    if total < warmup:
        raise ConfigError(
            f"scheduler total_num_steps {total} < warmup_num_steps {warmup}: the schedule would end during "
            "warmup; raise total_num_steps or lower warmup_num_steps"
        )
    return total


_SCHEDULERS: dict[str, type[_ClosedFormScheduler]] = {
    "warmuplr": WarmupLR,
    "warmupdecaylr": WarmupDecayLR,
    "warmupcosinelr": WarmupCosineLR,
}
SUPPORTED_SCHEDULERS = ("WarmupLR", "WarmupDecayLR", "WarmupCosineLR")
_NOT_SUPPORTED = ("onecycle", "lrrangetest")

# name -> (required, validator(path, value))
_PARAMS = {
    WarmupLR: {
        "warmup_min_lr": (False, _as_lrs),
        "warmup_max_lr": (False, _as_lrs),
        "warmup_num_steps": (False, lambda p, v: _as_int(p, v, 0)),
        "warmup_type": (False, _as_warmup_type),
    },
    WarmupCosineLR: {
        "total_num_steps": (True, lambda p, v: _as_int(p, v, 1)),
        "warmup_min_ratio": (False, lambda p, v: _as_float(p, v, 0.0, 1.0)),
        "warmup_num_steps": (False, lambda p, v: _as_int(p, v, 0)),
        "cos_min_ratio": (False, lambda p, v: _as_float(p, v, 0.0, 1.0)),
        "warmup_type": (False, _as_warmup_type),
    },
}
_PARAMS[WarmupDecayLR] = {"total_num_steps": (True, lambda p, v: _as_int(p, v, 1)), **_PARAMS[WarmupLR]}


def resolve_scheduler(cfg: SchedulerConfig) -> tuple[type[_ClosedFormScheduler], dict[str, Any]]:
    """The scheduler class and checked constructor kwargs for `cfg`; raises ConfigError on bad input."""
    key = cfg.type.lower()
    supported = ", ".join(SUPPORTED_SCHEDULERS)
    if key not in _SCHEDULERS:
        if key in _NOT_SUPPORTED:
            raise NotSupportedYetError(
                f"config key 'scheduler.type' = {cfg.type!r} is not supported yet by rayzero; "
                f"supported types: {supported}"
            )
        raise ConfigError(f"config key 'scheduler.type' = {cfg.type!r} is unknown; supported types: {supported}")
    cls = _SCHEDULERS[key]
    spec = _PARAMS[cls]
    kwargs: dict[str, Any] = {}
    for name, value in cfg.params.items():
        if name not in spec:
            raise ConfigError(
                f"unknown config key 'scheduler.params.{name}'{did_you_mean(name, spec)} "
                f"({cls.__name__} accepts: {', '.join(spec)})"
            )
        kwargs[name] = spec[name][1](f"scheduler.params.{name}", value)
    for name, (required, _) in spec.items():
        if required and name not in kwargs:
            raise ConfigError(f"config key 'scheduler.params.{name}' is required for {cls.__name__}")
    if "total_num_steps" in kwargs:
        _check_total(kwargs["total_num_steps"], kwargs.get("warmup_num_steps", 1000))
    return cls, kwargs


def build_scheduler(
    cfg: SchedulerConfig | None,
    optimizer: torch.optim.Optimizer,
    user_group_of: list[int] | None = None,
    user_groups: int | None = None,
) -> LRScheduler | None:
    """The configured scheduler over `optimizer` (which it sets to the step-0 lr), or None.

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
