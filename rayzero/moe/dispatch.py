"""Token dispatch for expert parallelism: route each (token, expert) pair to the rank that holds the expert.

With ``ep`` ranks in an expert-parallel group and ``E`` experts, rank ``r`` holds the ``L = E / ep``
experts ``[r * L, (r + 1) * L)`` (a block of dim 0 of the stacked expert tensors).  One MoE layer's
forward is:

1. sort the ``T * k`` (token, expert) assignments by expert (stable, so ties keep token order);
2. exchange the per-expert counts, then the tokens, with ``all_to_all_single`` over the EP group (uneven
   splits: each rank sends exactly what each peer's experts receive);
3. regroup what arrived by local expert and run the experts (``compute``: one matmul per local expert
   over all of its tokens, never a loop over tokens);
4. send the results back the same way and add them, weighted, into each token's output.

Both exchanges are autograd functions whose backward is the reverse exchange, so gradients of the expert
weights on their owner sum the contributions of every rank's tokens.  With ``ep == 1`` no collective runs
and the result is the same computation.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.distributed as dist


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, output_splits: list[int], input_splits: list[int], group) -> torch.Tensor:
        ctx.splits = (output_splits, input_splits)
        ctx.group = group
        out = x.new_empty((sum(output_splits),) + tuple(x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), output_splits, input_splits, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        output_splits, input_splits = ctx.splits
        out = grad.new_empty((sum(input_splits),) + tuple(grad.shape[1:]))
        dist.all_to_all_single(out, grad.contiguous(), input_splits, output_splits, group=ctx.group)
        return out, None, None, None


def all_to_all(x: torch.Tensor, output_splits: list[int], input_splits: list[int], group) -> torch.Tensor:
    """Differentiable ``all_to_all_single`` along dim 0 with uneven splits."""
    return _AllToAll.apply(x, output_splits, input_splits, group)


ExpertCompute = Callable[[torch.Tensor, list[int]], torch.Tensor]


def expert_parallel_apply(
    hidden: torch.Tensor,
    topk_index: torch.Tensor,
    topk_weight: torch.Tensor,
    num_experts: int,
    compute: ExpertCompute,
    ep_group=None,
    ep_size: int = 1,
) -> torch.Tensor:
    """Route ``hidden`` ``(T, H)`` to its top-k experts and combine their weighted outputs into ``(T, H)``.

    ``topk_index`` ``(T, k)`` holds global expert ids (an id outside ``[0, num_experts)`` is a dropped
    assignment and contributes nothing), ``topk_weight`` ``(T, k)`` their weights.  ``compute(x, counts)``
    gets this rank's tokens grouped by local expert (``counts[j]`` rows for local expert ``j``) and returns
    one output row per input row.
    """
    if num_experts % ep_size:
        raise ValueError(f"{num_experts} experts cannot be split over an expert-parallel group of {ep_size}")
    local = num_experts // ep_size
    tokens, k = topk_index.shape
    flat_expert = topk_index.reshape(-1)
    keep = (flat_expert >= 0) & (flat_expert < num_experts)
    token_of = torch.arange(tokens, device=hidden.device).repeat_interleave(k)
    weight_of = topk_weight.reshape(-1)
    if not bool(keep.all()):
        flat_expert, token_of, weight_of = flat_expert[keep], token_of[keep], weight_of[keep]
    order = torch.argsort(flat_expert, stable=True)
    sorted_token = token_of[order]
    counts = torch.bincount(flat_expert, minlength=num_experts)
    routed = hidden.index_select(0, sorted_token)  # (assignments, H), expert-major

    if ep_size == 1:
        out = compute(routed, counts.tolist())
    else:
        # counts_from[src, j]: assignments rank src sends to this rank's local expert j
        counts_from = torch.empty(ep_size * local, dtype=counts.dtype, device=counts.device)
        dist.all_to_all_single(counts_from, counts, group=ep_group)
        # one device-to-host copy of the counts; the index arithmetic below runs on the host
        send_counts = counts.view(ep_size, local).tolist()
        recv_counts = counts_from.view(ep_size, local).tolist()  # [src][j]
        send_splits = [sum(row) for row in send_counts]
        recv_splits = [sum(row) for row in recv_counts]
        received = all_to_all(routed, recv_splits, send_splits, ep_group)  # source-major, then local expert
        # regroup source-major -> local-expert-major for compute, and back afterwards
        start_of, at = {}, 0
        for src in range(ep_size):
            for j in range(local):
                start_of[src, j] = at
                at += recv_counts[src][j]
        pieces = [
            torch.arange(start_of[src, j], start_of[src, j] + recv_counts[src][j])
            for j in range(local)
            for src in range(ep_size)
        ]
        regroup = torch.cat(pieces).to(hidden.device)
        expert_major = received.index_select(0, regroup)
        tokens_per_local = [sum(recv_counts[src][j] for src in range(ep_size)) for j in range(local)]
        computed = compute(expert_major, tokens_per_local)
        back = torch.empty_like(computed).index_copy(0, regroup, computed) if computed.shape[0] else computed
        out = all_to_all(back, send_splits, recv_splits, ep_group)

    weighted = out * weight_of[order].unsqueeze(-1).to(out.dtype)
    combined = torch.zeros_like(hidden)
    return combined.index_add(0, sorted_token, weighted.to(hidden.dtype))
