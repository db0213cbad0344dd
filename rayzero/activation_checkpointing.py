"""Activation checkpointing: a block's forward keeps only its inputs, and backward runs it again.

With an `activation_checkpointing` config section the engine wraps each of the model's repeated blocks (the
blocks stage 3 gathers as one unit: `zero/stage3.unit_modules`, so a block marked with
`rayzero.zero.stage3.mark_gather_unit`, HF's `_no_split_modules`, or the container class that repeats over most of the
model) in torch's non-reentrant `torch.utils.checkpoint.checkpoint`. The wrap sits inside the module's call,
so the module's own hooks still run once per forward: at stage 3 the unit's parameters are gathered before
the forward and released after it, and gathered again before the block's backward, which is when the
recompute runs. The RNG state is replayed, so dropout draws the same masks.

`checkpoint(function, *args, **kwargs)` checkpoints any function by hand (DeepSpeed's
`deepspeed.checkpointing.checkpoint`); `configure`, `is_configured` and `reset` are DeepSpeed's module
functions with the same keys refused.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch
import torch.utils.checkpoint

logger = logging.getLogger(__name__)

_WRAPPED_ATTR = "_rayzero_checkpointed_forward"

# DeepSpeed keys rayzero cannot honour at these values -> why
REFUSED = {
    "partition_activations": "rayzero does not split saved activations across model-parallel ranks; "
                             "set it to false (checkpointing the blocks still runs)",
    "cpu_checkpointing": "rayzero keeps a checkpointed block's inputs on the device, it does not copy them to "
                         "the host; set it to false",
    "contiguous_memory_optimization": "it packs partitioned activations, and rayzero does not partition them "
                                      "(DeepSpeed needs partition_activations for it too); set it to false",
}


def refusals(settings: dict[str, Any]) -> list[str]:
    """One sentence per key of ``settings`` that asks for what rayzero cannot do."""
    return [f"config key 'activation_checkpointing.{key}' = true is not supported yet by rayzero: {why}"
            for key, why in REFUSED.items() if settings.get(key)]


def checkpoint(function: Callable, *args, **kwargs):
    """Run ``function(*args, **kwargs)`` keeping only its inputs for backward, which runs it again."""
    if not torch.is_grad_enabled():
        return function(*args, **kwargs)
    return torch.utils.checkpoint.checkpoint(function, *args, use_reentrant=False, **kwargs)


non_reentrant_checkpoint = checkpoint

_configured: dict[str, Any] | None = None


def configure(mpu_=None, deepspeed_config=None, partition_activations=None, contiguous_checkpointing=None,
              num_checkpoints=None, checkpoint_in_cpu=None, synchronize=None, profile=None) -> None:
    """DeepSpeed's `checkpointing.configure`: the settings are checked (the refused ones raise) and kept;
    `mpu_`, `num_checkpoints` and `profile` change nothing in rayzero."""
    from rayzero.config import NotSupportedYetError

    settings: dict[str, Any] = {}
    if deepspeed_config is not None:
        from rayzero.config import Config

        section = Config.from_any(deepspeed_config).activation_checkpointing
        settings = section.to_dict() if section is not None else {}
    given = {"partition_activations": partition_activations, "contiguous_memory_optimization":
             contiguous_checkpointing, "cpu_checkpointing": checkpoint_in_cpu,
             "synchronize_checkpoint_boundary": synchronize, "number_checkpoints": num_checkpoints,
             "profile": profile}
    settings.update({k: v for k, v in given.items() if v is not None})
    problems = refusals(settings)
    if problems:
        raise NotSupportedYetError("; ".join(problems))
    global _configured
    _configured = settings


def is_configured() -> bool:
    return _configured is not None


def reset() -> None:
    """DeepSpeed frees its contiguous buffers here; rayzero keeps none, so there is nothing to free."""


def checkpoint_blocks(model: torch.nn.Module, rule: str, numel: Callable[[torch.nn.Parameter], int],
                      synchronize: Callable[[], None] | None = None) -> list[torch.nn.Module]:
    """Wrap the forward of each of ``model``'s blocks (``rule``: as ``stage3_gather_unit``, ``"module"``
    taken as ``"auto"``) in a checkpoint; return the wrapped blocks (none: a warning says how to name them).
    ``synchronize`` runs before and after each block's forward (synchronize_checkpoint_boundary)."""
    from rayzero.zero.stage3 import unit_modules

    blocks = unit_modules(model, "auto" if rule == "module" else rule, numel)
    if not blocks:
        logger.warning(
            "activation_checkpointing: no repeated block found in %s, so nothing is checkpointed; mark the "
            "blocks with rayzero.zero.stage3.mark_gather_unit(*blocks) or name their class in "
            "zero_optimization.stage3_gather_unit", type(model).__name__)
    for block in blocks:
        _wrap(block, synchronize)
    return blocks


def _wrap(block: torch.nn.Module, synchronize: Callable[[], None] | None) -> None:
    if hasattr(block, _WRAPPED_ATTR):
        return
    original = block.forward
    own = "forward" in block.__dict__  # a forward set on the instance, to put back on unwrap

    def forward(*args, **kwargs):
        if not torch.is_grad_enabled():
            return original(*args, **kwargs)
        if synchronize is not None:
            synchronize()
        out = torch.utils.checkpoint.checkpoint(original, *args, use_reentrant=False, **kwargs)
        if synchronize is not None:
            synchronize()
        return out

    setattr(block, _WRAPPED_ATTR, (original, own))
    block.forward = forward


def unwrap_blocks(blocks: list[torch.nn.Module]) -> None:
    """Put each block's own forward back (Engine.destroy: the model outlives the engine)."""
    for block in blocks:
        original, own = block.__dict__.pop(_WRAPPED_ATTR, (None, False))
        if original is None:
            continue
        if own:
            block.forward = original
        else:
            del block.forward
