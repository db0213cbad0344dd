"""``rayzero.deepspeed``: DeepSpeed's user surface over the rayzero engine.

``import rayzero.deepspeed as deepspeed`` runs a DeepSpeed training script as written: ``initialize``
returns ``(engine, optimizer, dataloader, lr_scheduler)`` with an engine that answers to DeepSpeed's names
(``local_rank``, ``train_batch_size()``, ``save_checkpoint(dir, tag=1.0)``, ``load_checkpoint`` returning
``(path, client_state)``, ...), and the submodules ``comm``, ``accelerator``, ``zero``,
``checkpointing`` and ``utils.zero_to_fp32`` stand in for DeepSpeed's.  It is a thin layer: everything runs on
:class:`rayzero.Engine`, whose own API stays as it is.  docs/deepspeed.md says what maps to what.
"""

from __future__ import annotations

import argparse
import json
import os
from typing import Any

from rayzero.config import Config, NotSupportedYetError
from rayzero.deepspeed import accelerator, checkpointing, comm, zero
from rayzero.deepspeed.comm import init_distributed
from rayzero.deepspeed.engine import DeepSpeedEngine

__all__ = [
    "DeepSpeedEngine",
    "accelerator",
    "add_config_arguments",
    "checkpointing",
    "comm",
    "init_distributed",
    "initialize",
    "zero",
]

# DeepSpeed's default rendezvous port, for the ``distributed_port`` argument
TORCH_DISTRIBUTED_DEFAULT_PORT = 29500


def _refuse(what: str, fix: str) -> NotSupportedYetError:
    return NotSupportedYetError(f"rayzero.deepspeed.initialize: {what} is not supported yet; {fix}")


def _resolve_config(args: Any, config: Any, config_params: Any) -> Any:
    """The config the call names, by DeepSpeed's rules: ``config`` (else ``config_params``), or
    ``args.deepspeed_config`` (``args.deepscale_config``, its old name), never both."""
    if config is None and config_params is not None:
        config = config_params
    from_args = getattr(args, "deepspeed_config", None)
    if from_args is None:
        from_args = getattr(args, "deepscale_config", None)
    if from_args is not None:
        if config is not None:
            raise ValueError(
                "rayzero.deepspeed.initialize got a config twice: args.deepspeed_config "
                f"({from_args!r}) and config=; pass only one of them"
            )
        config = from_args
    if config is None:
        raise ValueError(
            "rayzero.deepspeed.initialize needs a config: pass --deepspeed_config FILE on the command line "
            "(with deepspeed.add_config_arguments(parser)) or config= (a dict or a JSON/YAML path)"
        )
    return config


def _raw_dict(config: Any) -> dict:
    """The config as the user wrote it (for keys the engine does not keep, such as
    ``dataloader_drop_last`` and ``stage3_gather_16bit_weights_on_model_save``)."""
    if isinstance(config, dict):
        return config
    if isinstance(config, Config):
        return {}
    path = os.fspath(config)
    with open(path) as f:
        if path.endswith((".yaml", ".yml")):
            import yaml

            return yaml.safe_load(f) or {}
        return json.load(f)


def initialize(
    args: Any = None,
    model: Any = None,
    optimizer: Any = None,
    model_parameters: Any = None,
    training_data: Any = None,
    lr_scheduler: Any = None,
    distributed_port: int = TORCH_DISTRIBUTED_DEFAULT_PORT,
    mpu: Any = None,
    dist_init_required: bool | None = None,
    collate_fn: Any = None,
    config: Any = None,
    mesh_param: Any = None,
    config_params: Any = None,
) -> tuple[DeepSpeedEngine, Any, Any, Any]:
    """DeepSpeed's ``initialize`` on the rayzero engine: returns ``(engine, optimizer, training_dataloader,
    lr_scheduler)``.  ``optimizer`` is the torch optimizer over the fp32 master partitions, the dataloader
    is ``None`` without ``training_data``, the scheduler ``None`` without a ``scheduler`` section."""
    if model is None:
        raise ValueError("rayzero.deepspeed.initialize requires a model (model=...)")
    if optimizer is not None:
        raise _refuse("a client optimizer (optimizer=)",
                      'describe it in the config\'s "optimizer" section (Adam, AdamW or SGD) instead')
    if lr_scheduler is not None:
        raise _refuse("a client lr scheduler (lr_scheduler=)",
                      'describe it in the config\'s "scheduler" section (docs/config.md) instead')
    if mpu is not None or mesh_param is not None:
        raise _refuse("a model-parallel unit (mpu=, mesh_param=)",
                      'use the config\'s "tensor_parallel" / "expert_parallel" sections (docs/parallelism.md)')
    config = _resolve_config(args, config, config_params)
    raw = _raw_dict(config)
    if dist_init_required is not False:
        init_distributed(distributed_port=distributed_port)
    from rayzero.engine import Engine

    engine = Engine(model, config, model_parameters)
    ds = DeepSpeedEngine(engine, raw, collate_fn=collate_fn)
    if args is not None and hasattr(args, "local_rank"):
        args.local_rank = ds.local_rank
    if training_data is not None:
        ds.training_dataloader = ds.deepspeed_io(training_data)
    return ds, ds.optimizer, ds.training_dataloader, ds.lr_scheduler


def add_config_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add DeepSpeed's command-line flags to ``parser``: ``--deepspeed``, ``--deepspeed_config FILE`` and
    their old spellings ``--deepscale`` / ``--deepscale_config``.  Returns the parser."""
    group = parser.add_argument_group("DeepSpeed", "DeepSpeed configurations (run by rayzero)")
    group.add_argument("--deepspeed", default=False, action="store_true",
                       help="flag for user code; rayzero.deepspeed does not read it")
    group.add_argument("--deepspeed_config", default=None, type=str, help="the training config (JSON or YAML)")
    group.add_argument("--deepscale", default=False, action="store_true", help="old name of --deepspeed")
    group.add_argument("--deepscale_config", default=None, type=str, help="old name of --deepspeed_config")
    return parser
