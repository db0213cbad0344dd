"""Graph capture policy: what the engine captures, when, and on which accelerators.

``"graph_capture": {"enabled": true}`` records the step's norm and update into accelerator graphs
(``rayzero.capture.step``); ``"targets": ["model"]`` also compiles the model's forward and backward.  The
accelerator decides how (``rayzero.accelerator.graphs``): inductor on CPU, CUDA graphs on NVIDIA GPUs.
Settings that capture cannot serve are refused at ``initialize`` with the reason, never run eagerly.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from rayzero.accelerator.graphs import GraphCaptureError, capture_off_error
from rayzero.capture.step import StepCapture
from rayzero.config import ConfigError

if TYPE_CHECKING:
    from rayzero.engine import Engine

__all__ = ["GraphCaptureError", "StepCapture", "check_capture", "setup_capture"]


def check_capture(engine: "Engine") -> None:
    """Refuse, before the model is touched, a capture the accelerator or the config cannot serve."""
    cfg = engine.config
    acc = engine.accelerator
    if not acc.supports_graph_capture():
        raise ConfigError(f"config key 'graph_capture.enabled' = true: {capture_off_error(acc.name)}")
    z = cfg.zero_optimization
    offloaded = [k for k, dev in (("offload_optimizer", z.offload_optimizer.device),
                                  ("offload_param", z.offload_param.device)) if dev != "none"]
    if offloaded:
        raise ConfigError(
            f"config key 'graph_capture.enabled' = true with zero_optimization.{offloaded[0]}.device = "
            f"{getattr(z, offloaded[0]).device!r}: a captured step cannot read states that move between the "
            "host, the device and NVMe each step; disable one of the two"
        )
    if "model" in cfg.graph_capture.targets and engine.stage == 3:
        raise ConfigError(
            "config key 'graph_capture.targets' includes 'model' at ZeRO stage 3: stage 3 gathers each "
            "module's parameters in hooks that swap the tensors a compiled forward would have baked in; "
            "capture only the step at stage 3 (\"targets\": [\"step\"]) or use stage 0-2"
        )


def setup_capture(engine: "Engine") -> StepCapture:
    """The engine's step capture (after :func:`check_capture`); compiles the model if asked."""
    cfg = engine.config
    capture = StepCapture(engine, cfg.graph_capture.warmup_steps)
    if cfg.graph_capture.cache_dir:
        from rayzero.capture.cache import CompileCache

        capture.cache = CompileCache(cfg.graph_capture.cache_dir, engine.accelerator.name, engine.rank)
        capture.cache.use_kernel_directory()
        capture.cache.load()  # before anything compiles
    if "model" in cfg.graph_capture.targets:
        # CUDA: CUDA graphs through inductor's reduce-overhead mode; CPU: inductor's kernels.  The bound
        # forward is replaced on the instance (not wrapped in another module), so the model keeps its
        # names, state_dict and hooks; AOT autograd compiles the matching backward.
        mode = "reduce-overhead" if engine.accelerator.name == "cuda" else None
        module = engine.module
        module.forward = torch.compile(module.forward, mode=mode, dynamic=False)
    return capture
