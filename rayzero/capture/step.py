"""Captured optimizer step: the local part of the gradient norm, and the clip + optimizer update.

The engine's step has two halves that touch every element of the rank's partitions, separated by the one
thing that needs the host: the global norm (a collective, then Python decides skip / clip):

* ``sq_sum``: the rank's fp32 sum of squared gradient elements, into a static scalar;
* ``update``: gradients times a static multiplier (unscale x clip), the optimizer's step on the fp32
  masters, the copy into separate weight partitions.

Each half is recorded once into an accelerator graph (``rayzero.accelerator.graphs``) and replayed every
step after the warm-up steps (which run eagerly, so the optimizer state exists before it is captured).
A step that skips (fp16 overflow, ``nonfinite_grad: skip``) replays only the first half.

Guards: a graph is bound to the storage of every tensor it touches.  Before each replay the capture
compares their addresses and shapes with the ones it was recorded against; a load_checkpoint that
replaced the optimizer state, or anything else that swapped a tensor, makes it record again instead of
replaying into freed memory.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable

import torch

from rayzero.accelerator.graphs import GraphCaptureError

if TYPE_CHECKING:
    from rayzero.engine import Engine


class StepCapture:
    """Records and replays the two halves of one engine's step (see the module docstring)."""

    def __init__(self, engine: "Engine", warmup_steps: int) -> None:
        self.engine = engine
        self.acc = engine.accelerator
        self.warmup_steps = warmup_steps
        device = engine.partitions.device
        self.sq = torch.zeros((), dtype=torch.float32, device=device)  # static output of sq_sum
        self.multiplier = torch.ones((), dtype=torch.float32, device=device)  # static input of update
        self._graphs: dict[str, object] = {}
        self._guards: dict[str, tuple] = {}
        self.captures = 0  # how many times a half was recorded (a re-capture counts again)
        self.replays = 0
        self.cache = None  # rayzero.capture.cache.CompileCache, with graph_capture.cache_dir
        self._cache_saved = False
        self._tensor_lr()

    # ---- the two halves, as plain functions of static tensors ----------------------------------------
    def _sq_sum_fn(self, replicated: bool) -> Callable[[], None]:
        partitions, sq = self.engine.partitions, self.sq

        def sq_sum() -> None:
            sq.copy_(partitions.local_grad_sq_sum(replicated))

        return sq_sum

    def _update_fn(self) -> Callable[[], None]:
        groups, optimizer, partitions, multiplier = (
            self.engine.partitions.groups, self.engine.optimizer, self.engine.partitions, self.multiplier,
        )

        # the class's step, not the instance's: an lr scheduler wraps the instance's step in a counter
        # that dynamo will not trace (update() below sets the flag that counter would set)
        step = type(optimizer).step

        def update() -> None:
            for g in groups:
                g.grad.mul_(multiplier)
            step(optimizer)
            partitions.refresh_weights()

        return update

    def _tensor_lr(self) -> None:
        """A float lr in the optimizer is a constant of a compiled graph (a scheduler's change would
        recompile it each step); as a 0-dim tensor it is an input, and the schedulers fill it in place."""
        self._start_lrs = [float(group["lr"]) for group in self.engine.optimizer.param_groups]
        for group in self.engine.optimizer.param_groups:
            if not torch.is_tensor(group["lr"]):
                group["lr"] = torch.tensor(float(group["lr"]), dtype=torch.float32, device=self.sq.device)

    def host_lrs(self) -> list[float]:
        """Each optimizer group's lr, known on the host: reading the device tensor would make the host
        wait for the device, every step a loop logs it.  rayzero's schedulers are closed forms of the step
        count, and without one the lr stays what it was (a load keeps the config's)."""
        scheduler = self.engine.lr_scheduler
        if scheduler is None:
            return list(self._start_lrs)
        if hasattr(scheduler, "lr_at"):
            return [float(lr) for lr in scheduler.lr_at(scheduler.last_batch_iteration)]
        return [float(group["lr"]) for group in self.engine.optimizer.param_groups]

    # ---- guards ----------------------------------------------------------------------------------------
    def _bound_tensors(self, half: str) -> list[torch.Tensor]:
        e = self.engine
        out = [self.sq, self.multiplier]
        for g in e.partitions.groups:
            out += [g.grad, g.master]
            if g.weights is not None:
                out.append(g.weights)
        if half == "update":
            for group in e.optimizer.param_groups:
                out += [v for v in group.values() if torch.is_tensor(v)]
            for state in e.optimizer.state.values():
                out += [v for v in state.values() if torch.is_tensor(v)]
        return out

    def _signature(self, half: str) -> tuple:
        return tuple((t.data_ptr(), tuple(t.shape), t.dtype) for t in self._bound_tensors(half))

    def invalidate(self) -> None:
        """Forget every recorded graph (the next step records again)."""
        self._graphs.clear()
        self._guards.clear()

    # ---- record / replay -------------------------------------------------------------------------------
    def _run(self, half: str, make_fn: Callable[[], Callable[[], None]]) -> None:
        """Replay ``half``'s graph, recording ``make_fn()`` first when its guards say so."""
        signature = self._signature(half)
        if self._guards.get(half) != signature:
            graph = self.acc.create_graph()
            with self.acc.capture_to_graph(graph) as recorder:
                recorder.record(make_fn())
            self._graphs[half], self._guards[half] = graph, signature
            self.captures += 1
        self.acc.replay_graph(self._graphs[half])
        self.replays += 1

    def active(self) -> bool:
        """Capture starts after the warm-up steps (the optimizer's state exists by then)."""
        return self.engine.global_steps >= self.warmup_steps

    def local_sq_sum(self, replicated: bool) -> torch.Tensor:
        half = "sq_sum_replicated" if replicated else "sq_sum"
        self._run(half, lambda: self._sq_sum_fn(replicated))
        return self.sq

    def update(self, multiplier: float) -> None:
        e = self.engine
        if e.swap is not None:
            raise GraphCaptureError("graph capture of the step with the optimizer swapped to NVMe")
        self.multiplier.fill_(multiplier)
        e._host_copies_done()
        for g in e.partitions.groups:
            g.master.grad = g.grad
        try:
            self._run("update", self._update_fn)
            e.optimizer._opt_called = True  # what an lr scheduler's wrapper of optimizer.step records
            if self.cache is not None and not self._cache_saved:  # everything is compiled by now
                self._cache_saved = True
                self.cache.save()
        finally:
            for g in e.partitions.groups:
                g.master.grad = None
