"""The global gradient norm, in fp32, with every element counted exactly once across ranks."""

from __future__ import annotations

import torch

from rayzero.comm import Communicator


def global_grad_norm(local_sq_sum: torch.Tensor, comm: Communicator | None) -> float:
    """``sqrt`` of the sum of squares over all ranks' disjoint gradient partitions.

    ``local_sq_sum`` must cover only what this rank owns (its partition; padding is zero), and ``comm``
    is None when every rank holds the same whole gradient (stage 0), where the local sum is the global one.
    Summing squares, not per-rank norms, is what makes the result the norm of the whole gradient.
    """
    total = local_sq_sum.to(torch.float32).reshape(1).clone()
    if comm is not None and comm.world > 1:
        comm.sum_scalar(total)
    return float(total.sqrt().item())


def clip_coefficient(norm: float, max_norm: float) -> float:
    """The factor torch's ``clip_grad_norm_`` applies: ``max_norm / (norm + 1e-6)``, capped at 1."""
    if max_norm <= 0:
        return 1.0
    return min(1.0, max_norm / (norm + 1e-6))
