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
from rayzero.config import ConfigError, OptimizerConfig

if TYPE_CHECKING:
    from rayzero.engine import Engine

__all__ = ["GraphCaptureError", "StepCapture", "capture_optimizer_config", "check_capture", "setup_capture"]


def capture_optimizer_config(opt: OptimizerConfig, accelerator: str) -> OptimizerConfig:
    """The optimizer settings a captured step needs on device kind ``accelerator``.

    A CUDA graph replays the step's kernels, so nothing in the step may read the device back to the host
    (the lr is a device tensor under capture, ``rayzero/capture/step.py``): Adam and AdamW keep their step
    counter on the device (``capturable``); SGD runs its fused kernel, the one that takes a tensor lr on
    the device (torch's foreach and per-tensor SGD read it with ``.item()``).  A setting that cannot be
    captured is a ConfigError naming the fix.  Other device kinds (CPU: inductor) take the config as it is.
    """
    if accelerator != "cuda":
        return opt
    kind, params = opt.type.lower(), dict(opt.params)
    where = f"config key 'graph_capture.enabled' = true on cuda with optimizer.type {opt.type!r}"
    if kind in ("adam", "adamw"):
        if params.get("capturable", True) is not True:
            raise ConfigError(
                f"{where} and optimizer.params.capturable = {params['capturable']!r}: a CUDA graph replays "
                "the step, whose step counter must then live on the device; remove 'capturable' (rayzero sets "
                "it) or disable graph_capture")
        params["capturable"] = True
    elif kind == "sgd":
        blocking = {k: params[k] for k, ok in (("foreach", False), ("fused", True), ("differentiable", False))
                    if k in params and params[k] not in (ok, None)}
        if blocking:
            chosen = ", ".join(f"optimizer.params.{k} = {v!r}" for k, v in blocking.items())
            raise ConfigError(
                f"{where} and {chosen}: only torch's fused SGD kernel takes the learning rate as a device "
                "tensor; its foreach and per-tensor kernels read it back with .item(), which a CUDA graph "
                "cannot replay. Remove those keys (rayzero then uses fused SGD) or disable graph_capture")
        params["fused"] = True
    return OptimizerConfig(type=opt.type, params=params)


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
    capture_optimizer_config(cfg.optimizer or OptimizerConfig(), acc.name)  # refused before the model is touched
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
