"""What ``rayzero.fit`` checks on the driver before Ray starts a worker: every argument's type and range, the
data's kind, and the model (it has parameters to train; the config's expert / tensor parallel sizes divide its
experts, heads and sharded dimensions).  Each problem is a ConfigError that names the argument and the fix, so
a run that could never train stops here in a second, not 30 s into every retry on the workers."""

from __future__ import annotations

import copy
import logging
from typing import Any

import torch

from rayzero.config import Config, ConfigError

logger = logging.getLogger("rayzero")

SEED_LIMIT = 2**44  # the sampler seeds epoch e with seed * 1_000_003 + e, which torch takes below 2**64


def is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _got(value: Any) -> str:
    return f"{value!r} ({type(value).__name__})"


def check_fit_args(
    *, model: Any, data: Any, loss_fn: Any, max_steps: Any, train_step: Any, collate: Any, seed: Any,
    shuffle: Any, record_samples: Any, zero_init: Any,
) -> None:
    """Type and range of every ``fit`` argument but ``cluster_cfg`` and ``config`` (which their own
    ``from_any`` check), and the kind of ``data``."""
    if not isinstance(model, torch.nn.Module) and not callable(model):
        raise TypeError(
            f"fit(model=...) got {_got(model)}: pass an nn.Module or a zero-argument factory that returns one"
        )
    if not is_int(max_steps) or max_steps < 1:
        raise ConfigError(f"fit(max_steps=...) must be an int >= 1 (the optimizer steps to train), got {_got(max_steps)}")
    if not is_int(seed) or not 0 <= seed < SEED_LIMIT:
        raise ConfigError(
            f"fit(seed=...) must be an int in [0, 2**44) (it seeds the model's factory and the data order), "
            f"got {_got(seed)}"
        )
    for key, value in (("shuffle", shuffle), ("record_samples", record_samples)):
        if not isinstance(value, bool):
            raise ConfigError(f"fit({key}=...) must be True or False, got {_got(value)}")
    if zero_init is not None and not isinstance(zero_init, bool):
        raise ConfigError(f"fit(zero_init=...) must be None (rayzero decides), True or False, got {_got(zero_init)}")
    callables = {
        "loss_fn": (loss_fn, "loss_fn(model_output, batch) -> loss tensor"),
        "train_step": (train_step, "train_step(engine, batch) -> loss, running forward, backward and step"),
        "collate": (collate, "collate(list of samples) -> batch"),
    }
    for key, (value, shape) in callables.items():
        if value is not None and not callable(value):
            raise ConfigError(f"fit({key}=...) must be None or a function {shape}, got {_got(value)}")
    check_data(data)


def check_data(data: Any) -> None:
    """``data`` is a kind the workers can read: a map-style dataset (``__getitem__`` and ``__len__``, not empty),
    a ``ray.data.Dataset``, or a factory ``(rank, world, micro_batch) -> iterable of batches``."""
    kinds = ("a torch map-style Dataset (with __getitem__ and __len__), a ray.data.Dataset, or a factory "
             "(rank, world, micro_batch) -> iterable of batches")
    if data is None:
        raise ConfigError(
            f"fit(data=...) is missing: pass {kinds}. A train_step that reads its own batches still takes one "
            "per micro-step: give it a factory such as lambda rank, world, micro: itertools.repeat(None)"
        )
    try:
        import ray.data

        if isinstance(data, ray.data.Dataset):
            return
    except ImportError:
        pass
    if hasattr(data, "__getitem__") and hasattr(data, "__len__"):
        try:
            n = len(data)
        except TypeError as e:
            raise ConfigError(f"fit(data=...): len() of the {type(data).__name__} fails ({e}); pass {kinds}") from None
        if n < 1:
            raise ConfigError(f"fit(data=...) is an empty {type(data).__name__} (len 0): give it samples")
        return
    if callable(data):
        return
    hint = ""
    if isinstance(data, torch.utils.data.IterableDataset) or hasattr(data, "__iter__") or hasattr(data, "__next__"):
        hint = (" An iterable is read once and cannot be cut per rank or resumed: wrap it in a factory that "
                "makes this rank's stream, e.g. lambda rank, world, micro: my_stream(rank, world, micro)")
    raise ConfigError(f"fit(data=...) got {type(data).__name__}, which fit cannot read: pass {kinds}.{hint}")


def check_model(counted: torch.nn.Module | None, model: Any, cfg: Config) -> None:
    """The model (``counted``: itself, or a factory's model built on the meta device; None when the factory
    cannot be built there, then only the workers check) has trainable parameters, and the config's expert /
    tensor parallel sizes divide it: AutoEP and AutoTP run on a meta-device copy with their own checks."""
    if counted is None:
        return
    what = type(counted).__name__ + ("" if isinstance(model, torch.nn.Module) else " (built by the model factory)")
    params = list(counted.parameters())
    if not params:
        raise ConfigError(
            f"the model {what} has no parameters, so there is nothing to train; pass the model whose weights "
            "fit should train (layers registered as attributes or in nn.ModuleList, not in a plain list)"
        )
    if not any(p.requires_grad for p in params):
        raise ConfigError(
            f"every parameter of the model {what} has requires_grad=False, so there is nothing to train; unfreeze "
            "the parameters to train (p.requires_grad_(True))"
        )
    ep_on, tp = cfg.expert_parallel.enabled, cfg.tensor_parallel.autotp_size
    if not ep_on and tp == 1:
        return
    probe = meta_copy(counted)
    if probe is None:
        return
    from rayzero.moe.auto_ep import apply_auto_ep
    from rayzero.tp.auto_tp import apply_auto_tp

    quiet = logging.getLogger("rayzero.tp.auto_tp")  # its "sharded N modules" line is the workers' to say
    level = quiet.level
    quiet.setLevel(logging.WARNING)
    try:
        if ep_on:
            apply_auto_ep(probe, None, cfg.expert_parallel.size, 0, tp_group=None, tp_size=tp, tp_rank=0,
                          preset_model=cfg.expert_parallel.preset_model)
        if tp > 1:
            apply_auto_tp(probe, None, tp, 0, plan=cfg.tensor_parallel.tp_plan)
    except ConfigError as e:
        raise ConfigError(f"the model cannot be laid out as the config asks: {e}") from None
    except Exception as e:  # noqa: BLE001 - slicing on the meta device is a check only: the workers run it for real
        logger.info("the driver's expert/tensor parallel check was skipped (%s: %s)", type(e).__name__, e)
    finally:
        quiet.setLevel(level)


def meta_copy(model: torch.nn.Module) -> torch.nn.Module | None:
    """A copy of ``model`` whose parameters and buffers are on the meta device (shapes only, no memory);
    None when the model cannot be copied."""
    memo: dict = {}
    for p in model.parameters():
        memo[id(p)] = torch.nn.Parameter(torch.empty_like(p, device="meta"), requires_grad=p.requires_grad)
    for b in model.buffers():
        memo[id(b)] = torch.empty_like(b, device="meta")
    try:
        return copy.deepcopy(model, memo)
    except Exception as e:  # noqa: BLE001 - e.g. a module holding a lock
        logger.info("the driver's expert/tensor parallel check was skipped: the model cannot be copied (%s)", e)
        return None
