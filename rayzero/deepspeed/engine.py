"""The engine ``rayzero.deepspeed.initialize`` returns: DeepSpeed's engine names over a :class:`rayzero.Engine`.

Each method keeps DeepSpeed's signature and return value and calls the rayzero engine; what rayzero cannot
do the DeepSpeed way (a weights-only load, a backward that keeps its graph) raises
``NotSupportedYetError`` naming the argument, rather than doing something else.  Any other attribute
is looked up on the rayzero engine, then on the model, as DeepSpeed's engine passes unknown names to its
module.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import torch
import torch.distributed as dist

from rayzero.config import NotSupportedYetError

logger = logging.getLogger("rayzero")


def _refuse(call: str, what: str, fix: str) -> NotSupportedYetError:
    return NotSupportedYetError(f"rayzero.deepspeed: {call} with {what} is not supported yet; {fix}")


class DeepSpeedEngine:
    """DeepSpeed's training engine, run by ``self.engine`` (the :class:`rayzero.Engine`)."""

    def __init__(self, engine, raw_config: dict | None = None, collate_fn=None):
        self.__dict__["engine"] = engine  # (set first: __getattr__ reads it)
        self.module = engine.module
        self._raw_config = raw_config or {}
        self.collate_fn = collate_fn
        self.training_dataloader = None
        self._skipped_before_step = 0

    # ---- where this rank runs ----------------------------------------------------------------------
    @property
    def local_rank(self) -> int:
        return int(os.environ.get("LOCAL_RANK", 0))

    @property
    def global_rank(self) -> int:
        return self.engine.rank

    @property
    def world_size(self) -> int:
        return self.engine.world_size

    @property
    def device(self) -> torch.device:
        return self.engine.accelerator.device()

    @property
    def optimizer(self):
        return self.engine.optimizer

    @property
    def lr_scheduler(self):
        return self.engine.lr_scheduler

    # ---- the config ---------------------------------------------------------------------------------
    def train_batch_size(self) -> int:
        return self.engine.batch.train_batch_size

    def train_micro_batch_size_per_gpu(self) -> int:
        return self.engine.batch.micro_batch_size

    def gradient_accumulation_steps(self) -> int:
        return self.engine.gradient_accumulation_steps

    def bfloat16_enabled(self) -> bool:
        return self.engine.config.bf16.enabled

    def fp16_enabled(self) -> bool:
        return self.engine.config.fp16.enabled

    def zero_optimization_stage(self) -> int:
        return self.engine.stage

    def zero_optimization(self) -> bool:
        return self.engine.stage > 0

    def zero_optimization_partition_weights(self) -> bool:
        return self.engine.stage == 3

    def gradient_clipping(self) -> float:
        return self.engine.config.gradient_clipping

    def steps_per_print(self) -> int:
        return self.engine.config.steps_per_print

    def wall_clock_breakdown(self) -> bool:
        return self.engine.config.wall_clock_breakdown

    def dataloader_drop_last(self) -> bool:
        return bool(self._raw_config.get("dataloader_drop_last", False))

    def zero_gather_16bit_weights_on_model_save(self) -> bool:
        """``zero_optimization.stage3_gather_16bit_weights_on_model_save`` (or one of its DeepSpeed aliases)."""
        return bool(self.engine.config.zero_optimization.stage3_gather_16bit_weights_on_model_save)

    # ---- counters and results ------------------------------------------------------------------------
    @property
    def global_steps(self) -> int:
        return self.engine.global_steps

    @property
    def global_samples(self) -> int:
        return self.engine.global_samples

    @property
    def micro_steps(self) -> int:
        return self.engine.micro_steps

    @property
    def skipped_steps(self) -> int:
        return self.engine.skipped_steps

    def get_global_grad_norm(self) -> float | None:
        return self.engine.global_grad_norm

    def get_lr(self) -> list[float]:
        return self.engine.get_lr()

    def was_step_applied(self) -> bool:
        """Whether the last ``step()`` updated the weights (false between boundaries and on a skipped step)."""
        return self._step_applied if hasattr(self, "_step_applied") else False

    # ---- training ----------------------------------------------------------------------------------
    def train(self, mode: bool = True) -> "DeepSpeedEngine":
        """The model's train mode; returns the engine, as DeepSpeed's engine (an nn.Module) does."""
        self.module.train(mode)
        return self

    def eval(self) -> "DeepSpeedEngine":
        self.module.train(False)
        return self

    def forward(self, *inputs, **kwargs):
        return self.engine.forward(*inputs, **kwargs)

    def __call__(self, *inputs, **kwargs):
        return self.engine.forward(*inputs, **kwargs)

    def backward(self, loss: torch.Tensor, retain_graph: bool = False, scale_wrt_gas: bool = True) -> torch.Tensor:
        """Backward of ``loss / gradient_accumulation_steps()``; returns that scaled loss, as DeepSpeed does."""
        if retain_graph:
            raise _refuse("backward", "retain_graph=True", "run one backward per forward")
        if not scale_wrt_gas:
            raise _refuse("backward", "scale_wrt_gas=False",
                          "rayzero always divides the loss by gradient_accumulation_steps")
        self.engine.backward(loss)
        return loss / self.engine.gradient_accumulation_steps

    def step(self, lr_kwargs: dict | None = None) -> None:
        if lr_kwargs:
            raise _refuse("step", "lr_kwargs", "the config's scheduler sets the learning rate")
        boundary = self.engine.is_gradient_accumulation_boundary()
        skipped = self.engine.skipped_steps
        self.engine.step()
        self._step_applied = boundary and self.engine.skipped_steps == skipped

    def is_gradient_accumulation_boundary(self) -> bool:
        return self.engine.is_gradient_accumulation_boundary()

    def set_gradient_accumulation_boundary(self, is_boundary: bool) -> None:
        self.engine.set_gradient_accumulation_boundary(is_boundary)

    def zero_grad(self) -> None:
        self.engine.zero_grad()

    def deepspeed_io(self, dataset, batch_size: int | None = None, route: str = "train", pin_memory: bool = True,
                     data_sampler=None, collate_fn=None, num_local_io_workers: int | None = None):
        """A ``DataLoader`` over this rank's share of ``dataset``, as DeepSpeed builds it: a
        ``DistributedSampler`` over the data-parallel ranks (shuffled for training, in order for
        ``route="eval"``/``"predict"``; its epoch is never advanced, so every pass has the same order),
        ``train_micro_batch_size_per_gpu`` samples per batch, ``dataloader_drop_last`` from the config.
        The batches are loaded in this process unless ``num_local_io_workers`` says otherwise."""
        if not isinstance(dataset, torch.utils.data.Dataset):
            raise ValueError(f"training_data must be a torch Dataset (map-style), not {type(dataset).__name__}")
        if isinstance(dataset, torch.utils.data.IterableDataset):
            raise _refuse("training_data", "an IterableDataset",
                          "pass a map-style dataset, or iterate your own loader and feed the engine")
        if batch_size is None:
            batch_size = self.train_micro_batch_size_per_gpu()
        if data_sampler is None:
            data_sampler = torch.utils.data.DistributedSampler(
                dataset, num_replicas=self.engine.dp_world_size, rank=self.engine.dp_rank,
                shuffle=route not in ("eval", "predict"))
        return torch.utils.data.DataLoader(
            dataset, batch_size=batch_size, sampler=data_sampler,
            collate_fn=collate_fn if collate_fn is not None else self.collate_fn,
            num_workers=num_local_io_workers or 0,
            pin_memory=pin_memory and self.device.type != "cpu",
            drop_last=self.dataloader_drop_last())

    # ---- checkpoints -------------------------------------------------------------------------------
    def save_checkpoint(self, save_dir, tag=None, client_state: Any = {}, save_latest: bool = True,  # noqa: B006
                        exclude_frozen_parameters: bool = False) -> bool:
        """Save a rayzero checkpoint under ``save_dir/str(tag)`` (default ``global_step<N>``); returns True.

        The tag may be of any type whose ``str`` is a plain name (DeepSpeed's scripts pass floats and
        ints).  ``client_state`` must be JSON-serializable (rayzero checkpoints hold no pickle).
        ``save_latest=False`` leaves ``save_dir/latest`` naming the checkpoint it named before."""
        if not save_dir:
            raise ValueError(f"save_dir must be a non-empty string, got {save_dir!r}")
        if exclude_frozen_parameters:
            raise _refuse("save_checkpoint", "exclude_frozen_parameters=True",
                          "save the whole model (frozen parameters are stored once, by rank 0)")
        from rayzero.checkpoint.format import LATEST
        from rayzero.checkpoint.storage import Storage

        storage = Storage.resolve(save_dir) if not save_latest else None
        latest = storage.join(LATEST) if storage is not None else None
        before = storage.read_bytes(latest) if storage is not None and storage.exists(latest) else None
        self.engine.save_checkpoint(save_dir, None if tag is None else str(tag), client_state)
        if storage is not None:
            if self.engine.rank == 0:
                if before is None:
                    storage.fs.delete_file(latest)
                else:
                    storage.write_bytes_atomic(latest, before)
            self.engine.comm.barrier()
        return True

    def load_checkpoint(self, load_dir, tag=None, load_module_strict: bool = True, load_optimizer_states: bool = True,
                        load_lr_scheduler_states: bool = True, load_module_only: bool = False,
                        custom_load_fn=None) -> tuple[str | None, Any]:
        """Load ``load_dir/tag`` (default: the tag ``load_dir/latest`` names): weights, optimizer state,
        scheduler position and counters.  Returns ``(path of the checkpoint, client_state)``, or, as
        DeepSpeed does, ``(None, None)`` with a warning when there is no ``latest`` file or no such tag."""
        for name, value, default, fix in (
            ("load_optimizer_states", load_optimizer_states, True, "rayzero restores the optimizer state with the weights"),
            ("load_lr_scheduler_states", load_lr_scheduler_states, True, "the scheduler position comes with the step"),
            ("load_module_only", load_module_only, False,
             "take the weights with rayzero.deepspeed.utils.zero_to_fp32 and load them into the model "
             "before initialize"),
            ("custom_load_fn", custom_load_fn, None, "load with the engine's own loader"),
        ):
            if value is not default and value != default:
                raise _refuse("load_checkpoint", f"{name}={value!r}", fix)
        from rayzero.checkpoint.format import LATEST, MANIFEST
        from rayzero.checkpoint.storage import Storage

        storage = Storage.resolve(load_dir)
        if tag is None:
            latest = storage.join(LATEST)
            if not storage.exists(latest):
                logger.warning("load_checkpoint: there is no 'latest' file at %s, so no checkpoint was loaded; "
                               "pass tag= to load a given one", latest)
                return None, None
            tag = storage.read_bytes(latest).decode().strip()
        tag = str(tag)
        if not storage.exists(storage.join(tag, MANIFEST)) and not storage.is_dir(storage.join(tag)):
            logger.warning("load_checkpoint: checkpoint %s does not exist, so no checkpoint was loaded",
                           storage.join(tag))
            return None, None
        client_state = self.engine.load_checkpoint(load_dir, tag, strict=load_module_strict)
        return storage.join(tag), client_state

    @torch.no_grad()
    def save_16bit_model(self, save_dir, save_filename: str = "pytorch_model.bin",
                         exclude_frozen_parameters: bool = False) -> bool:
        """Rank 0 writes the model's ``state_dict`` (parameters in the compute dtype, buffers as they are) to
        ``save_dir/save_filename`` with ``torch.save``.  At ZeRO stage 3 only where the config sets
        ``zero_optimization.stage3_gather_16bit_weights_on_model_save`` (else nothing is written and it
        returns False, as DeepSpeed does).  A collective: call it on every rank."""
        if exclude_frozen_parameters:
            raise _refuse("save_16bit_model", "exclude_frozen_parameters=True", "save the whole model")
        path = os.path.join(save_dir, save_filename)
        if self.engine.stage == 3 and not self.zero_gather_16bit_weights_on_model_save():
            logger.info("save_16bit_model: %s not written: at ZeRO stage 3 it needs zero_optimization."
                        "stage3_gather_16bit_weights_on_model_save true", path)
            return False
        state = self.engine.full_state_dict(rank0_only=True, cpu_offload=True)
        if self.engine.rank == 0:
            trained = {n for n, p in self.module.named_parameters(remove_duplicate=False) if p in self.engine.partitions.entry_of}
            out = {n: (t.to(self.engine.compute_dtype) if n in trained and t.is_floating_point() else t)
                   for n, t in state.items()}
            os.makedirs(save_dir, exist_ok=True)
            torch.save(out, path)
        self.engine.comm.barrier()
        return True

    # ---- everything else: the rayzero engine, then the model -----------------------------------------
    def destroy(self) -> None:
        self.engine.destroy()

    def __getattr__(self, name: str) -> Any:
        engine = self.__dict__.get("engine")
        if engine is not None:
            try:
                return getattr(engine, name)
            except AttributeError:
                pass
            module = self.__dict__.get("module")
            if module is not None and hasattr(module, name):
                return getattr(module, name)
        raise AttributeError(f"'{type(self).__name__}' object has no attribute '{name}'")
