"""Build a torch optimizer from the `optimizer` config section.

rayzero runs torch's own optimizers (with `fused` / `foreach` as the user asks) over each rank's fp32
master partition. DeepSpeed names are accepted: its `Adam` means decoupled weight decay unless
`adam_w_mode` is false, and `torch_adam` is a no-op because torch's implementation is always used.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Mapping
from typing import Any

import torch

from rayzero.config import ConfigError, NotSupportedYetError, OptimizerConfig, did_you_mean

_TORCH_OPTIMIZERS: dict[str, type[torch.optim.Optimizer]] = {
    "adam": torch.optim.Adam,
    "adamw": torch.optim.AdamW,
    "sgd": torch.optim.SGD,
}
SUPPORTED_OPTIMIZERS = ("Adam", "AdamW", "SGD")

# DeepSpeed optimizer types rayzero has not built yet.
_NOT_SUPPORTED = ("lamb", "onebitadam", "zerooneadam", "onebitlamb", "lion", "adagrad", "muon", "adam8bit")

# DeepSpeed-only Adam params: name -> the one value rayzero can honour (None: any value, no effect).
_ADAM_COMPAT = {"adam_w_mode": None, "torch_adam": None, "bias_correction": True}

_NUMBER_PARAMS = ("lr", "eps", "weight_decay", "momentum", "dampening")
_BOOL_PARAMS = ("amsgrad", "nesterov", "maximize", "capturable", "differentiable", "fused",
                "decoupled_weight_decay", "adam_w_mode", "torch_adam", "bias_correction")
_OPTIONAL_BOOL_PARAMS = ("foreach", "fused")


def _accepted_params(cls: type[torch.optim.Optimizer]) -> list[str]:
    names = list(inspect.signature(cls.__init__).parameters)
    return [n for n in names if n not in ("self", "params")]


def _check_value(path: str, name: str, value: Any) -> Any:
    """Type-check the common hyper-parameters so mistakes read as config errors, not torch tracebacks."""
    def bad(expected: str) -> ConfigError:
        return ConfigError(
            f"config key '{path}.{name}' has value {value!r} of type {type(value).__name__}; expected {expected}"
        )

    if name in _NUMBER_PARAMS:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise bad("a finite number")
        return float(value)
    if name == "betas":
        if (not isinstance(value, (list, tuple)) or len(value) != 2
                or any(isinstance(b, bool) or not isinstance(b, (int, float)) for b in value)):
            raise bad("a list of two numbers, e.g. [0.9, 0.999]")
        return tuple(float(b) for b in value)  # torch wants a tuple
    if name in _OPTIONAL_BOOL_PARAMS and value is None:
        return None
    if name in _BOOL_PARAMS or name in _OPTIONAL_BOOL_PARAMS:
        if not isinstance(value, bool):
            raise bad("a boolean")
    return value


def resolve_optimizer(cfg: OptimizerConfig | None) -> tuple[type[torch.optim.Optimizer], dict[str, Any]]:
    """The torch optimizer class and constructor kwargs for `cfg`; raises ConfigError on bad input."""
    if cfg is None:
        return torch.optim.AdamW, {}
    key = cfg.type.lower()
    if key not in _TORCH_OPTIMIZERS:
        supported = ", ".join(SUPPORTED_OPTIMIZERS)
        if key in _NOT_SUPPORTED:
            raise NotSupportedYetError(
                f"config key 'optimizer.type' = {cfg.type!r} is not supported yet by rayzero; "
                f"supported types: {supported}"
            )
        raise ConfigError(f"config key 'optimizer.type' = {cfg.type!r} is unknown; supported types: {supported}")

    params = dict(cfg.params)
    kwargs: dict[str, Any] = {}
    is_adam = key in ("adam", "adamw")
    if is_adam:
        adam_w_mode = params.get("adam_w_mode", True)
        _check_value("optimizer.params", "adam_w_mode", adam_w_mode)
        if key == "adamw" and not adam_w_mode:
            raise ConfigError(
                "config key 'optimizer.params.adam_w_mode' = False contradicts optimizer.type 'AdamW'; "
                "use type 'Adam' for L2-coupled weight decay"
            )
        if key == "adam":
            cls = torch.optim.AdamW if adam_w_mode else torch.optim.Adam
            if adam_w_mode:
                # DeepSpeed's and torch's Adam both default weight_decay to 0; keep that instead of
                # AdamW's 0.01 so a DeepSpeed `Adam` config trains the same.
                kwargs["weight_decay"] = 0.0
        else:
            cls = torch.optim.AdamW
        for name, honoured in _ADAM_COMPAT.items():
            if name in params:
                value = _check_value("optimizer.params", name, params.pop(name))
                if honoured is not None and value != honoured:
                    raise NotSupportedYetError(
                        f"config key 'optimizer.params.{name}' = {value!r} is not supported yet by rayzero; "
                        f"torch's {cls.__name__} always behaves as {name}={honoured!r}"
                    )
    else:
        cls = _TORCH_OPTIMIZERS[key]

    accepted = _accepted_params(cls)
    for name, value in params.items():
        if name not in accepted:
            known = accepted + (list(_ADAM_COMPAT) if is_adam else [])
            raise ConfigError(
                f"unknown config key 'optimizer.params.{name}'{did_you_mean(name, known)} "
                f"(torch.optim.{cls.__name__} accepts: {', '.join(known)})"
            )
        kwargs[name] = _check_value("optimizer.params", name, value)
    return cls, kwargs


def build_optimizer(cfg: OptimizerConfig | None, param_groups: list[dict]) -> torch.optim.Optimizer:
    """Torch optimizer over `param_groups`; a group's own hyper-parameters win over the config's.

    `param_groups` is a list of dicts with "params" (as torch takes) or a plain list of tensors.
    """
    cls, kwargs = resolve_optimizer(cfg)
    groups: list[Any] = []
    for group in param_groups:
        if isinstance(group, Mapping):
            group = dict(group)
            if "betas" in group and isinstance(group["betas"], list):
                group["betas"] = tuple(group["betas"])
        groups.append(group)
    try:
        return cls(groups, **kwargs)
    except (ValueError, RuntimeError) as exc:
        raise ConfigError(f"torch.optim.{cls.__name__} rejected optimizer params {kwargs}: {exc}") from exc
