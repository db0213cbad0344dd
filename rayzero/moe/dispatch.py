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

Host syncs.  Everything runs on the device except what sizes the exchange: dropless routing (no
capacity) reads the counts to the host once per layer and forward (this rank's counts and, with EP, what
the peers send it, in one copy), since uneven splits and the experts' group sizes are host numbers; the
backward reuses them.  With a ``capacity`` every (source rank, expert) slot holds exactly ``capacity``
rows, padded with zeros, so the splits are fixed and nothing is read.  No boolean masks, ``bincount`` or
host-built indices (each would wait for the device).
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


def expert_counts(topk_index: torch.Tensor, num_experts: int) -> torch.Tensor:
    """``(num_experts + 1,)`` int64: how many assignments of ``topk_index`` go to each expert; ids outside
    ``[0, num_experts)`` (dropped) count in the last entry.  Sized by ``num_experts``, not by the values
    (``bincount`` on an accelerator reads the maximum to the host)."""
    return _counts(_slot(topk_index.reshape(-1), num_experts), num_experts)


def _counts(slot: torch.Tensor, num_experts: int) -> torch.Tensor:
    counts = torch.zeros(num_experts + 1, dtype=torch.long, device=slot.device)
    return counts.scatter_add_(0, slot, torch.ones_like(slot))


def _slot(flat_expert: torch.Tensor, num_experts: int) -> torch.Tensor:
    """Expert id per assignment, with every dropped one (outside ``[0, num_experts)``) at ``num_experts``."""
    valid = (flat_expert >= 0) & (flat_expert < num_experts)
    return torch.where(valid, flat_expert, torch.full_like(flat_expert, num_experts))


def expert_parallel_apply(
    hidden: torch.Tensor,
    topk_index: torch.Tensor,
    topk_weight: torch.Tensor,
    num_experts: int,
    compute: ExpertCompute,
    ep_group=None,
    ep_size: int = 1,
    capacity: int | None = None,
) -> torch.Tensor:
    """Route ``hidden`` ``(T, H)`` to its top-k experts and combine their weighted outputs into ``(T, H)``.

    ``topk_index`` ``(T, k)`` holds global expert ids (an id outside ``[0, num_experts)`` is a dropped
    assignment and contributes nothing), ``topk_weight`` ``(T, k)`` their weights.  ``compute(x, counts)``
    gets this rank's tokens grouped by local expert (``counts[j]`` rows for local expert ``j``) and returns
    one output row per input row.  ``capacity``: at most this many assignments per expert from this rank
    (later ones, in token order, are dropped); the exchange then has fixed sizes and reads nothing back to
    the host, and every expert computes ``ep_size * capacity`` rows, the unused ones zeros.
    """
    if num_experts % ep_size:
        raise ValueError(f"{num_experts} experts cannot be split over an expert-parallel group of {ep_size}")
    tokens, k = topk_index.shape
    slot = _slot(topk_index.reshape(-1), num_experts)
    token_of = torch.arange(tokens, device=hidden.device).repeat_interleave(k)
    weight_of = topk_weight.reshape(-1)
    order = torch.argsort(slot, stable=True)  # expert-major, token order inside; dropped ones last
    counts = _counts(slot, num_experts)
    if capacity is not None:
        return _apply_with_capacity(hidden, slot, order, counts, token_of, weight_of, num_experts, compute,
                                    ep_group, ep_size, capacity)
    return _apply_dropless(hidden, order, counts, token_of, weight_of, num_experts, compute, ep_group, ep_size)


def _apply_dropless(hidden, order, counts, token_of, weight_of, num_experts, compute, ep_group, ep_size):
    local = num_experts // ep_size
    if ep_size == 1:
        host = counts.tolist()  # the one read: the experts' group sizes
        counts_from = None
    else:
        # counts_from[src * local + j]: assignments rank src sends to this rank's local expert j
        counts_from = torch.empty(num_experts, dtype=counts.dtype, device=counts.device)
        dist.all_to_all_single(counts_from, counts[:num_experts].contiguous(), group=ep_group)
        host = torch.cat([counts, counts_from]).tolist()  # the one read: both sides' sizes in one copy
    kept = sum(host[:num_experts])
    order = order[:kept]  # dropped assignments sort last
    sorted_token = token_of[order]
    routed = hidden.index_select(0, sorted_token)  # (kept, H), expert-major

    if ep_size == 1:
        out = compute(routed, host[:num_experts])
    else:
        send = host[:num_experts]
        recv = host[num_experts + 1:]  # [src * local + j]
        send_splits = [sum(send[r * local:(r + 1) * local]) for r in range(ep_size)]
        recv_splits = [sum(recv[r * local:(r + 1) * local]) for r in range(ep_size)]
        received = all_to_all(routed, recv_splits, send_splits, ep_group)  # source-major, then local expert
        # regroup source-major -> local-expert-major for compute (and back afterwards), on the device: each
        # received row's local expert, then a stable sort keeps the sources in order within an expert
        total = sum(recv_splits)
        local_of = torch.arange(num_experts, device=hidden.device).remainder(local).repeat_interleave(
            counts_from, output_size=total)
        regroup = torch.argsort(local_of, stable=True)
        expert_major = received.index_select(0, regroup)
        tokens_per_local = [sum(recv[src * local + j] for src in range(ep_size)) for j in range(local)]
        computed = compute(expert_major, tokens_per_local)
        back = torch.empty_like(computed).index_copy(0, regroup, computed) if total else computed
        out = all_to_all(back, send_splits, recv_splits, ep_group)

    weighted = out * weight_of[order].unsqueeze(-1).to(out.dtype)
    combined = torch.zeros_like(hidden)
    return combined.index_add(0, sorted_token, weighted.to(hidden.dtype))


def _apply_with_capacity(hidden, slot, order, counts, token_of, weight_of, num_experts, compute, ep_group,
                         ep_size, capacity):
    local = num_experts // ep_size
    n, width = slot.numel(), hidden.shape[-1]
    # each assignment's place among its expert's (token order), then its row in the (E * capacity) send
    # buffer; past capacity or dropped: the spare last row, which is never sent
    starts = torch.cumsum(counts, 0) - counts
    position = torch.empty_like(slot)
    position[order] = torch.arange(n, device=slot.device) - starts[slot[order]]
    spare = num_experts * capacity
    keep = (slot < num_experts) & (position < capacity)
    row = torch.where(keep, slot * capacity + position, torch.full_like(slot, spare))
    send = hidden.new_zeros((spare + 1, width)).index_add(0, row, hidden.index_select(0, token_of))[:spare]
    fixed = [local * capacity] * ep_size
    received = all_to_all(send, fixed, fixed, ep_group) if ep_size > 1 else send  # (src, j, slot)
    expert_major = received.view(ep_size, local, capacity, width).transpose(0, 1).reshape(-1, width)
    computed = compute(expert_major, [ep_size * capacity] * local)
    back = computed.view(local, ep_size, capacity, width).transpose(0, 1).reshape(-1, width)
    out = all_to_all(back, fixed, fixed, ep_group) if ep_size > 1 else back  # (E * capacity, H), ours
    out = torch.cat([out, out.new_zeros((1, width))]).index_select(0, row)  # dropped: the zero row
    weighted = out * weight_of.unsqueeze(-1).to(out.dtype)
    combined = torch.zeros_like(hidden)
    return combined.index_add(0, token_of, weighted.to(hidden.dtype))
