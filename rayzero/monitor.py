"""DeepSpeed's training monitors: ``tensorboard``, ``wandb`` and ``csv_monitor`` in the config.

Rank 0 writes the events DeepSpeed's engine writes, under DeepSpeed's names, with the number of samples
trained as the x-axis:

- ``Train/Samples/train_loss``: at each accumulation boundary, the mean of the window's micro-step losses on
  rank 0 (each loss divided by ``gradient_accumulation_steps``, summed), at the samples trained before
  the step.  DeepSpeed wrote this event from its backward until 0.18; 0.19 writes no loss event.
- ``Train/Samples/lr``: after each optimizer step, the first param group's learning rate (the scheduler has
  stepped), at the samples trained after the step;
- ``Train/Samples/loss_scale``: the same with fp16, the loss scale after the step;
- with ``wall_clock_breakdown``, ``Train/Samples/elapsed_time_ms_forward`` / ``_backward`` / ``_step``: the
  milliseconds the step's accumulation window spent in each (DeepSpeed also splits the backward into
  ``_backward_inner`` and ``_backward_allreduce``; rayzero reduces inside the backward and does not).

Sinks: CSV files (no package needed) in DeepSpeed's layout, ``<output_path>/<job_name>/<event name with / and
spaces as _>.csv``, a ``step,<last part of the name>`` header once per process, then ``step,value`` rows,
appended; TensorBoard event files through ``torch.utils.tensorboard`` (needs the ``tensorboard`` package)
in ``<output_path>/<job_name>``; Weights & Biases (``wandb``) with ``project``, ``group`` and ``team`` as
its entity.  A sink whose package does not import is left out with one warning per process.

The engine calls :meth:`Monitor.record_loss` from ``backward`` and :meth:`Monitor.after_step` after each
optimizer step (``rayzero/engine.py``); ranks other than 0 have no monitor.
"""

from __future__ import annotations

import csv
import logging
import os
from typing import Any

import torch

logger = logging.getLogger("rayzero")

Event = tuple[str, float, int]

_SAID_MISSING: set[str] = set()  # sinks already reported as not installed in this process


def _say_missing(key: str, package: str) -> None:
    if key in _SAID_MISSING:
        return
    _SAID_MISSING.add(key)
    logger.warning(
        f"rayzero: config key '{key}.enabled' is true but the '{package}' package is not installed, so no "
        f"{key} events are written; pip install {package} to write them (or set {key}.enabled to false)"
    )


class CSVSink:
    """One CSV file per event, as DeepSpeed's csv_monitor writes them."""

    def __init__(self, output_path: str, job_name: str):
        self.log_dir = os.path.join(output_path, job_name)
        os.makedirs(self.log_dir, exist_ok=True)
        self._headed: set[str] = set()

    def write(self, events: list[Event]) -> None:
        for name, value, step in events:
            stem = name.replace("/", "_").replace(" ", "_")
            with open(os.path.join(self.log_dir, stem + ".csv"), "a", newline="") as f:
                writer = csv.writer(f)
                if stem not in self._headed:
                    self._headed.add(stem)
                    writer.writerow(["step", name.split("/")[-1]])
                writer.writerow([step, value])

    def close(self) -> None:
        pass


class TensorBoardSink:
    def __init__(self, writer_cls: Any, output_path: str, job_name: str):
        log_dir = os.path.join(output_path, job_name)
        os.makedirs(log_dir, exist_ok=True)
        self.writer = writer_cls(log_dir=log_dir)

    def write(self, events: list[Event]) -> None:
        for name, value, step in events:
            self.writer.add_scalar(name, value, step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class WandbSink:
    def __init__(self, wandb: Any, project: str, group: str | None, team: str | None):
        self.wandb = wandb
        wandb.init(project=project, group=group, entity=team)

    def write(self, events: list[Event]) -> None:
        for name, value, step in events:
            self.wandb.log({name: value}, step=step)

    def close(self) -> None:
        pass


class Monitor:
    """Rank 0's sinks and the loss of the accumulation window in progress."""

    def __init__(self, sinks: list[Any]):
        self.sinks = sinks
        self._loss: torch.Tensor | None = None
        self._window = -1  # the optimizer step whose window _loss belongs to
        self._timed: dict[str, float] = {}  # engine._timings when last read (seconds since its last report)

    def record_loss(self, loss: torch.Tensor, accumulation_steps: int, step: int) -> None:
        """One micro-step's loss (before any scaling) in the window of optimizer step ``step`` (a window
        that ended in an error is dropped); read on the host only at the boundary."""
        part = loss.detach().float().mean() / accumulation_steps
        if self._loss is None or step != self._window:
            self._loss, self._window = part, step
        else:
            self._loss = self._loss + part

    def after_step(self, engine: Any) -> None:
        """The events of the optimizer step just taken (or skipped) by ``engine``."""
        samples = engine.global_samples
        events: list[Event] = []
        if self._loss is not None:
            events.append(("Train/Samples/train_loss", self._loss.item(),
                           samples - engine.batch.train_batch_size))
            self._loss = None
        events.append(("Train/Samples/lr", engine.get_lr()[0], samples))
        if engine.config.fp16.enabled:
            events.append(("Train/Samples/loss_scale", float(engine.loss_scale), samples))
        if engine.config.wall_clock_breakdown:
            for phase, seconds in engine._timings.items():
                window = seconds - self._timed.get(phase, 0.0)
                events.append((f"Train/Samples/elapsed_time_ms_{phase}", 1000.0 * window, samples))
            every = engine.config.steps_per_print
            # the engine's report after this step starts its sums again
            self._timed = {} if every and engine.global_steps % every == 0 else dict(engine._timings)
        self.write(events)

    def write(self, events: list[Event]) -> None:
        for sink in self.sinks:
            sink.write(events)

    def close(self) -> None:
        for sink in self.sinks:
            sink.close()
        self.sinks = []


def build_monitor(config: Any, rank: int) -> Monitor | None:
    """Rank 0's monitor for the config's enabled sinks; None on other ranks or with none enabled."""
    if rank != 0:
        return None
    sinks: list[Any] = []
    if config.csv_monitor.enabled:
        sinks.append(CSVSink(config.csv_monitor.output_path, config.csv_monitor.job_name))
    if config.tensorboard.enabled:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            _say_missing("tensorboard", "tensorboard")
        else:
            sinks.append(TensorBoardSink(SummaryWriter, config.tensorboard.output_path, config.tensorboard.job_name))
    if config.wandb.enabled:
        try:
            import wandb
        except ImportError:
            _say_missing("wandb", "wandb")
        else:
            sinks.append(WandbSink(wandb, config.wandb.project, config.wandb.group, config.wandb.team))
    return Monitor(sinks) if sinks else None
