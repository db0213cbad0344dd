"""The two autograd functions tensor parallelism is built from (Megatron's f and g).

* :func:`copy_to_tp` marks where a replicated activation enters a TP-sharded computation: identity in
  forward; in backward the ranks' partial input gradients are summed over the TP group.
* :func:`reduce_from_tp` closes it: the ranks' partial outputs are summed over the TP group in forward;
  identity in backward (every rank's output gradient is already the whole gradient).

Between a ``copy_to_tp`` and its ``reduce_from_tp`` every rank computes on its own slice of the weights;
outside, activations and their gradients are identical on every rank of the TP group.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


class _CopyToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class _ReduceFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:
        out = x.contiguous().clone()
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None


def copy_to_tp(x: torch.Tensor, group, size: int) -> torch.Tensor:
    return x if size == 1 else _CopyToTP.apply(x, group)


def reduce_from_tp(x: torch.Tensor, group, size: int) -> torch.Tensor:
    return x if size == 1 else _ReduceFromTP.apply(x, group)
