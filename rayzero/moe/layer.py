"""The mixture-of-experts layer users put in their own models.

:class:`MoE` is a drop-in replacement for a transformer block's MLP: ``(..., H) -> (..., H)``.  Each token
is routed to its ``top_k`` experts by a linear router (softmax over the experts in fp32); every expert is a
gated MLP (``down(act(gate(x)) * up(x))``) and the token's output is the router-weighted sum of its
experts' outputs, plus an optional dense "shared expert" MLP that every token goes through.

The experts' weights are stacked, one tensor per projection, in the submodule ``experts``::

    experts.gate_up_proj   (E, 2F, H)   rows [0, F) are the gate projection, rows [F, 2F) the up projection
    experts.down_proj      (E, H, F)

Expert parallelism (EP): rayzero's engine calls :meth:`MoE.shard_experts` once after the model is built.
The stacked tensors are then replaced by this rank's block of ``E / ep`` experts (same parameter names),
and the forward sends every token to the rank that holds its experts
(:func:`rayzero.moe.dispatch.expert_parallel_apply`).  With tensor parallelism (TP) on top, the experts'
intermediate dimension ``F`` is also cut over the TP group: each TP rank computes a partial output for
the same tokens and the partial outputs are summed over the TP group.

Losses: after every forward the layer keeps ``self.aux_loss``, the router's auxiliary loss (load balance
and, optionally, router z-loss) already multiplied by its coefficients.  :func:`moe_aux_loss` adds those
up over a whole model::

    out = model(x)
    loss = task_loss(out, y) + moe_aux_loss(model)

The auxiliary loss is computed from this rank's own tokens (local routing statistics).
"""

from __future__ import annotations

import math
from typing import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from rayzero.moe.dispatch import expert_counts, expert_parallel_apply
from rayzero.parallel.slicing import SplitSpec, mark_split, take_slice
from rayzero.tp.regions import copy_to_tp, reduce_from_tp

_ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu,
    "swish": F.silu,
    "gelu": F.gelu,
    "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "relu": F.relu,
}


def _activation(activation: str | Callable[[torch.Tensor], torch.Tensor]) -> Callable[[torch.Tensor], torch.Tensor]:
    if callable(activation):
        return activation
    try:
        return _ACTIVATIONS[activation]
    except KeyError:
        raise ValueError(
            f"unknown MoE activation {activation!r}; use one of {sorted(_ACTIVATIONS)} or pass a callable"
        ) from None


def drop_over_capacity(topk_index: torch.Tensor, num_experts: int, capacity: int) -> torch.Tensor:
    """Return ``topk_index`` ``(T, k)`` with every assignment beyond an expert's ``capacity`` set to -1.

    Assignments are taken in token order (token 0's, then token 1's, ...): each expert keeps the earliest
    ``capacity`` tokens routed to it and drops the rest.  A token never picks the same expert twice, so the
    order among one token's ``k`` choices does not matter.
    """
    flat = topk_index.reshape(-1)
    n = flat.numel()
    if n == 0:
        return topk_index.clone()
    order = torch.argsort(flat, stable=True)  # expert-major, token order inside each expert
    counts = expert_counts(flat, num_experts)[:num_experts]
    starts = torch.cumsum(counts, 0) - counts
    position = torch.empty_like(flat)
    position[order] = torch.arange(n, device=flat.device) - starts[flat[order]]
    return torch.where(position < capacity, flat, torch.full_like(flat, -1)).view_as(topk_index)


def _expert_init_(w: torch.Tensor, fan_in: int) -> None:
    # the same distribution nn.Linear gives a weight with this fan-in
    bound = 1.0 / math.sqrt(fan_in) if fan_in > 0 else 0.0
    with torch.no_grad():
        w.uniform_(-bound, bound)


class MoEExperts(nn.Module):
    """``E`` gated MLP experts stored as two stacked tensors (see the module docstring for the layout).

    Calling it as ``experts(x, counts)`` runs the experts this rank holds on ``x``, whose rows are grouped
    by local expert (``counts[j]`` rows for local expert ``j``): one matmul per projection and local
    expert, over all of that expert's rows.
    """

    def __init__(self, num_experts: int, hidden_size: int, ffn_hidden_size: int, activation="silu"):
        super().__init__()
        self.num_experts = num_experts
        self.hidden_size = hidden_size
        self.ffn_hidden_size = ffn_hidden_size
        self.act = _activation(activation)
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * ffn_hidden_size, hidden_size))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden_size, ffn_hidden_size))
        # expert parameters are reduced over the expert-data-parallel group, not the data-parallel one,
        # whether or not they are sharded
        self.gate_up_proj._rayzero_expert = True
        self.down_proj._rayzero_expert = True
        self.tp_group = None
        self.tp_size = 1
        self.remember_marks()
        self.reset_parameters()

    _MARKS = ("_rayzero_expert", "_rayzero_tp", "_rayzero_splits")

    def remember_marks(self) -> None:
        """Record the parameters' rayzero marks, so that copies of this module carry them too.

        ``copy.deepcopy`` (and pickling) of an ``nn.Parameter`` drops its Python attributes; this module's
        ``__setstate__`` puts the recorded marks back on the copies.
        """
        self._param_marks = {
            name: {k: getattr(p, k) for k in self._MARKS if hasattr(p, k)}
            for name, p in self.named_parameters(recurse=False)
        }

    def __setstate__(self, state) -> None:
        super().__setstate__(state)
        for name, marks in self.__dict__.get("_param_marks", {}).items():
            p = self._parameters.get(name)
            if p is not None:
                for key, value in marks.items():
                    setattr(p, key, value)

    def reset_parameters(self) -> None:
        _expert_init_(self.gate_up_proj, self.hidden_size)
        _expert_init_(self.down_proj, self.gate_up_proj.shape[1] // 2)

    @property
    def num_local_experts(self) -> int:
        return self.gate_up_proj.shape[0]

    def forward(self, x: torch.Tensor, counts: list[int]) -> torch.Tensor:
        x = copy_to_tp(x, self.tp_group, self.tp_size)
        gate_up = self.gate_up_proj.unbind(0)
        down = self.down_proj.unbind(0)
        x = x.to(self.gate_up_proj.dtype)
        outs = []
        # every local expert runs, even on zero rows, so its weights always get a (zero) gradient
        for j, xj in enumerate(torch.split(x, counts)):
            gate, up = F.linear(xj, gate_up[j]).chunk(2, dim=-1)
            outs.append(F.linear(self.act(gate) * up, down[j]))
        out = torch.cat(outs) if outs else x.new_zeros((0, self.hidden_size))
        return reduce_from_tp(out, self.tp_group, self.tp_size)

    def extra_repr(self) -> str:
        return (
            f"num_local_experts={self.num_local_experts}, num_experts={self.num_experts}, "
            f"hidden_size={self.hidden_size}, ffn_hidden_size={self.ffn_hidden_size}"
        )


class SharedExperts(nn.Module):
    """A dense gated MLP applied to every token (``num_shared_experts`` experts fused into one)."""

    def __init__(self, hidden_size: int, ffn_hidden_size: int, activation="silu"):
        super().__init__()
        self.act = _activation(activation)
        self.gate_up_proj = nn.Linear(hidden_size, 2 * ffn_hidden_size, bias=False)
        self.down_proj = nn.Linear(ffn_hidden_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(self.act(gate) * up)


def _check_group(group, size: int, rank: int, what: str) -> None:
    if size == 1 or not dist.is_initialized():
        return
    actual_size, actual_rank = dist.get_world_size(group), dist.get_rank(group)
    if actual_size != size or actual_rank != rank:
        raise ValueError(
            f"{what} group has {actual_size} ranks and this rank is {actual_rank} in it, but "
            f"{what}_size={size} and {what}_rank={rank} were passed"
        )


class Router(nn.Linear):
    """The router's linear layer, computing its logits in fp32.  Called as a module (not through its
    weight) so that ZeRO-3 gathers the weight for its forward like any other module's."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x.float(), self.weight.float())


class MoE(nn.Module):
    """Token-choice top-k mixture of experts: ``(..., hidden_size) -> (..., hidden_size)``.

    Args:
        hidden_size: ``H``, the size of each token's input and output.
        ffn_hidden_size: ``F``, each routed expert's intermediate size.
        num_experts: ``E``, the number of routed experts.
        top_k: experts per token (``k >= 1``).
        normalize_topk: divide each token's top-k router probabilities by their sum (the weights then add
            up to 1).  With ``top_k=1`` this makes the weight exactly 1 and the router learns only from the
            auxiliary loss; Switch-style top-1 routing uses ``normalize_topk=False``.
        capacity_factor: ``None`` (default) is dropless.  A number caps every expert at
            ``ceil(capacity_factor * T * top_k / E)`` of this rank's ``T * top_k`` assignments per forward;
            each expert keeps its earliest tokens (in the flattened input order) and drops the rest, whose
            router weight is lost (the token's output gets only its kept experts, or nothing).  The token
            exchange then has fixed sizes (every expert computes ``ep * capacity`` rows, padded with zeros)
            and reads nothing back to the host; dropless routing reads the counts once per forward.
        aux_loss_coef: weight of the load-balancing loss ``E * sum_e f_e * P_e`` (``f_e``: fraction of the
            ``T * top_k`` assignments the router gave expert ``e``, before any capacity drop; ``P_e``: mean
            router probability of ``e``).  It is 1 when the load is perfectly balanced.
        z_loss_coef: weight of the router z-loss, the mean over tokens of ``logsumexp(logits) ** 2``.
        num_shared_experts: dense experts every token goes through, fused into one MLP of intermediate
            size ``num_shared_experts * shared_ffn_hidden_size``; its output is added to the routed output.
        shared_ffn_hidden_size: each shared expert's intermediate size (default ``ffn_hidden_size``).
        activation: the gate activation: ``"silu"`` (SwiGLU, default), ``"gelu"``, ``"gelu_tanh"``,
            ``"relu"``, or a callable.
        router_jitter: in training mode, multiply the router's input by noise uniform in
            ``[1 - router_jitter, 1 + router_jitter]`` (0 disables it).  Under tensor parallelism the noise
            is broadcast from the TP group's first rank, so all TP ranks route alike.

    Attributes after a forward: ``aux_loss`` (scalar tensor with grad: the coefficient-weighted sum of the
    two router losses), ``tokens_per_expert`` (detached ``(E,)`` counts of the assignments kept).
    """

    def __init__(
        self,
        hidden_size: int,
        ffn_hidden_size: int,
        num_experts: int,
        top_k: int = 2,
        *,
        normalize_topk: bool = True,
        capacity_factor: float | None = None,
        aux_loss_coef: float = 0.01,
        z_loss_coef: float = 0.0,
        num_shared_experts: int = 0,
        shared_ffn_hidden_size: int | None = None,
        activation: str | Callable[[torch.Tensor], torch.Tensor] = "silu",
        router_jitter: float = 0.0,
    ):
        super().__init__()
        if num_experts < 1:
            raise ValueError(f"num_experts must be at least 1, got {num_experts}")
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"top_k must be between 1 and num_experts={num_experts}, got {top_k}")
        if capacity_factor is not None and capacity_factor <= 0:
            raise ValueError(f"capacity_factor must be positive (or None for dropless), got {capacity_factor}")
        if num_shared_experts < 0:
            raise ValueError(f"num_shared_experts must be non-negative, got {num_shared_experts}")
        if not 0.0 <= router_jitter < 1.0:
            raise ValueError(f"router_jitter must be in [0, 1), got {router_jitter}")
        self.hidden_size = hidden_size
        self.ffn_hidden_size = ffn_hidden_size
        self.num_experts = num_experts
        self.top_k = top_k
        self.normalize_topk = normalize_topk
        self.capacity_factor = capacity_factor
        self.aux_loss_coef = aux_loss_coef
        self.z_loss_coef = z_loss_coef
        self.router_jitter = router_jitter

        self.router = Router(hidden_size, num_experts, bias=False)
        self.experts = MoEExperts(num_experts, hidden_size, ffn_hidden_size, activation)
        self.num_shared_experts = num_shared_experts
        self.shared_experts = (
            SharedExperts(hidden_size, num_shared_experts * (shared_ffn_hidden_size or ffn_hidden_size), activation)
            if num_shared_experts
            else None
        )

        self.ep_group = None
        self.ep_size = 1
        self.ep_rank = 0
        self.tp_group = None
        self.tp_size = 1
        self.tp_rank = 0
        self._sharded = False
        self.aux_loss: torch.Tensor | None = None
        self.tokens_per_expert: torch.Tensor | None = None

    # ---- parallelism -----------------------------------------------------------------------------

    @property
    def num_local_experts(self) -> int:
        return self.experts.num_local_experts

    @property
    def is_sharded(self) -> bool:
        """Whether :meth:`shard_experts` has been called (even with ``ep_size == tp_size == 1``)."""
        return self._sharded

    def shard_experts(self, ep_group, ep_size: int, ep_rank: int, tp_group=None, tp_size: int = 1, tp_rank: int = 0):
        """Keep only this rank's experts (and, with ``tp_size > 1``, its slice of their intermediate dim).

        ``ep_rank`` must be this rank's index in ``ep_group`` (``None`` means the default group); it holds
        experts ``[ep_rank * L, (ep_rank + 1) * L)`` with ``L = num_experts / ep_size``.  With TP, each rank
        keeps ``F / tp_size`` of every expert's gate and up rows and of its down columns.  The parameters
        are replaced by new ones under the same names, marked ``_rayzero_expert = True`` and with their
        splits (:func:`~rayzero.parallel.slicing.mark_split`): ``SplitSpec("ep", 0, ep_size, ep_rank)`` when
        ``ep_size > 1``, then, when ``tp_size > 1``, ``SplitSpec("tp", 1, tp_size, tp_rank, packed=2)`` on
        ``gate_up_proj`` and ``SplitSpec("tp", 2, tp_size, tp_rank)`` on ``down_proj``, both also marked
        ``_rayzero_tp = "shard"``.  (A split into one part would not change the canonical order, so none is
        recorded, as for transformers experts under AutoEP.)  Build the optimizer after this call, and call
        it at most once.
        """
        if ep_size < 1 or self.num_experts % ep_size:
            raise ValueError(
                f"MoE has {self.num_experts} experts, which an expert-parallel group of {ep_size} ranks cannot "
                f"split evenly; choose an ep_size that divides {self.num_experts}"
            )
        if not 0 <= ep_rank < ep_size:
            raise ValueError(f"ep_rank={ep_rank} is not a rank of an expert-parallel group of {ep_size}")
        if tp_size < 1 or not 0 <= tp_rank < tp_size:
            raise ValueError(f"tp_rank={tp_rank} is not a rank of a tensor-parallel group of {tp_size}")
        if self.ffn_hidden_size % tp_size:
            raise ValueError(
                f"MoE experts' ffn_hidden_size={self.ffn_hidden_size} cannot be split over a tensor-parallel "
                f"group of {tp_size} ranks; choose a tp_size that divides {self.ffn_hidden_size}"
            )
        if self.is_sharded:
            raise RuntimeError("shard_experts was already called on this MoE layer")
        _check_group(ep_group, ep_size, ep_rank, "ep")
        _check_group(tp_group, tp_size, tp_rank, "tp")

        specs: dict[str, list[SplitSpec]] = {"gate_up_proj": [], "down_proj": []}
        if ep_size > 1:
            for name_specs in specs.values():
                name_specs.append(SplitSpec("ep", 0, ep_size, ep_rank))
        if tp_size > 1:
            specs["gate_up_proj"].append(SplitSpec("tp", 1, tp_size, tp_rank, packed=2))
            specs["down_proj"].append(SplitSpec("tp", 2, tp_size, tp_rank))
        for name, name_specs in specs.items():
            if not name_specs:
                continue  # nothing to cut: keep the parameter (already marked as an expert)
            old = getattr(self.experts, name)
            data = old.detach()
            for spec in name_specs:
                data = take_slice(data, spec)
            # a copy of this rank's block only (a dim-0 slice may be a view that keeps every expert alive)
            new = nn.Parameter(data.clone(), requires_grad=old.requires_grad)
            new._rayzero_expert = True
            if tp_size > 1:
                new._rayzero_tp = "shard"
            for spec in name_specs:
                mark_split(new, spec)
            setattr(self.experts, name, new)

        self.ep_group, self.ep_size, self.ep_rank = ep_group, ep_size, ep_rank
        self.tp_group, self.tp_size, self.tp_rank = tp_group, tp_size, tp_rank
        self.experts.tp_group, self.experts.tp_size = tp_group, tp_size
        self.experts.remember_marks()
        self._sharded = True
        return self

    # ---- routing ---------------------------------------------------------------------------------

    def _router_input(self, x: torch.Tensor) -> torch.Tensor:
        x = x.float()
        if not (self.training and self.router_jitter > 0):
            return x
        noise = torch.empty_like(x).uniform_(1.0 - self.router_jitter, 1.0 + self.router_jitter)
        if self.tp_size > 1:  # every TP rank must make the same routing decision
            group = dist.group.WORLD if self.tp_group is None else self.tp_group
            dist.broadcast(noise, src=dist.get_global_rank(group, 0), group=group)
        return x * noise

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Route ``x`` ``(T, H)``: return ``(topk_index, topk_weight, probs, logits)``.

        ``topk_index`` ``(T, k)`` holds expert ids (after the capacity rule, -1 for a dropped assignment),
        ``topk_weight`` ``(T, k)`` their fp32 weights; ``probs`` and ``logits`` are ``(T, E)`` fp32.
        This also sets ``self.aux_loss`` and ``self.tokens_per_expert``.
        """
        logits = self.router(self._router_input(x))
        probs = torch.softmax(logits, dim=-1)
        topk_weight, topk_index = torch.topk(probs, self.top_k, dim=-1)
        if self.normalize_topk:
            topk_weight = topk_weight / topk_weight.sum(dim=-1, keepdim=True)

        tokens = x.shape[0]
        chosen = expert_counts(topk_index, self.num_experts)[: self.num_experts]
        if tokens:
            fraction = chosen.to(probs.dtype) / (tokens * self.top_k)
            balance = self.num_experts * torch.sum(fraction * probs.mean(dim=0))
            z_loss = torch.logsumexp(logits, dim=-1).square().mean()
        else:  # keep the graph connected so the router still gets a (zero) gradient
            balance = z_loss = logits.sum() * 0.0
        self.aux_loss = self.aux_loss_coef * balance + self.z_loss_coef * z_loss

        capacity = self.capacity(tokens)
        if capacity is not None:
            topk_index = drop_over_capacity(topk_index, self.num_experts, capacity)
            self.tokens_per_expert = expert_counts(topk_index, self.num_experts)[: self.num_experts].detach()
        else:
            self.tokens_per_expert = chosen.detach()
        return topk_index, topk_weight, probs, logits

    def capacity(self, tokens: int) -> int | None:
        """Assignments each expert takes from this rank's ``tokens`` (None: dropless)."""
        if self.capacity_factor is None:
            return None
        return math.ceil(self.capacity_factor * tokens * self.top_k / self.num_experts)

    # ---- forward ---------------------------------------------------------------------------------

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        shape = hidden.shape
        x = hidden.reshape(-1, shape[-1])
        topk_index, topk_weight, _, _ = self.route(x)
        # with a capacity the exchange has fixed sizes: no read of the routing back to the host
        out = expert_parallel_apply(
            x, topk_index, topk_weight, self.num_experts, self.experts, ep_group=self.ep_group, ep_size=self.ep_size,
            capacity=self.capacity(x.shape[0]),
        )
        if self.shared_experts is not None:
            out = out + self.shared_experts(x).to(out.dtype)
        return out.reshape(shape)

    def extra_repr(self) -> str:
        parts = [f"top_k={self.top_k}", f"normalize_topk={self.normalize_topk}"]
        if self.capacity_factor is not None:
            parts.append(f"capacity_factor={self.capacity_factor}")
        if self.ep_size > 1 or self.tp_size > 1:
            parts.append(f"ep={self.ep_size}, tp={self.tp_size}")
        return ", ".join(parts)


def moe_aux_loss(model: nn.Module) -> torch.Tensor:
    """Sum of ``aux_loss`` over every :class:`MoE` layer of ``model`` that has run a forward.

    A zero tensor when the model has no MoE layer (or none has run), so
    ``loss = task_loss + moe_aux_loss(model)`` works for any model.
    """
    losses = [m.aux_loss for m in model.modules() if isinstance(m, MoE) and m.aux_loss is not None]
    if not losses:
        param = next(model.parameters(), None)
        return torch.zeros((), device=param.device if param is not None else None)
    total = losses[0]
    for loss in losses[1:]:
        total = total + loss.to(total.device)
    return total
