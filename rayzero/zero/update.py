"""The eager optimizer update on a rank's fp32 master partitions (step 5 of the step in docs/design.md; the
captured twin is rayzero/capture/step.py), and the set-up question that decides whether stage 1-2 masters can
be the weights a host's ranks share."""

from __future__ import annotations

import weakref

import torch

from rayzero.zero.partition import Partitions


def folds_grad_scale(optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``optimizer.step()`` divides every gradient by ``optimizer.grad_scale`` (torch's fused
    kernels: what its GradScaler relies on)."""
    return bool(getattr(optimizer, "_step_supports_amp_scaling", False)) and all(
        group.get("fused") for group in optimizer.param_groups)


# each optimizer's grad_scale, one 0-dim tensor for good: filled in place every step, because building a
# device tensor from a Python number is a blocking host-to-device copy (the host waits for the device)
_grad_scales: "weakref.WeakKeyDictionary[torch.optim.Optimizer, torch.Tensor]" = weakref.WeakKeyDictionary()


def _grad_scale(optimizer: torch.optim.Optimizer, value: float, device: torch.device) -> torch.Tensor:
    scale = _grad_scales.get(optimizer)
    if scale is None or scale.device != device:
        scale = _grad_scales[optimizer] = torch.empty((), dtype=torch.float32, device=device)
    return scale.fill_(value)


def update(optimizer: torch.optim.Optimizer, partitions: Partitions, swap, multiplier: float) -> None:
    """Scale the gradient partitions by ``multiplier`` (unscale x clip) and step ``optimizer`` on the fp32
    masters; ``swap`` (NVMe offload) steps one sub-group in memory at a time instead.

    A fused optimizer (torch's fused AdamW, rayzero's default) divides the gradients by its ``grad_scale`` as
    it reads them: the multiplier rides along instead of costing a pass of its own."""
    fold = multiplier != 1.0 and folds_grad_scale(optimizer)
    scale_each = multiplier != 1.0 and not fold
    if scale_each and partitions.grad_swap is None:  # (swapped gradients are scaled as each is read back)
        for g in partitions.groups:
            g.grad.mul_(multiplier)
    if fold:
        optimizer.grad_scale = _grad_scale(optimizer, 1.0 / multiplier, partitions.state_device)
    try:
        if swap is not None:
            swap.step(partitions.groups, multiplier if scale_each and partitions.grad_swap is not None else None)
        else:
            for g in partitions.groups:
                g.master.grad = g.grad
            try:
                optimizer.step()
            finally:
                for g in partitions.groups:
                    g.master.grad = None
            partitions.refresh_weights()
    finally:
        if fold:
            del optimizer.grad_scale


def weights_can_be_shared(parallel, params: list[torch.nn.Parameter]) -> bool:
    """Whether some communicator that partitions ``params`` has all its ranks on one host (asked of every
    communicator, in parameter order, so that every rank takes part in each one's first check)."""
    comms = {}
    for p in params:
        comm = parallel.domain_of(p).comm
        if comm.world > 1:
            comms.setdefault(id(comm), comm)
    return any([c.shares_memory() for c in comms.values()])
