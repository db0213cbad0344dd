"""Expert parallelism for a Hugging Face experts module: keep this rank's experts, route tokens to the others.

In transformers 5 an MoE block is a router (``gate``) plus an *experts module* that stores every expert's
weights as stacked 3-D tensors and is called as ``experts(hidden_states (T, H), top_k_index (T, k),
top_k_weights (T, k)) -> (T, H)``.  Every such class is declared through transformers'
``use_experts_implementation`` decorator, which records its layout on the instance, and every kernel the
decorator can dispatch to computes the same thing, per (token, expert) pair::

    h   = x @ gate_up_proj[e].T (+ gate_up_proj_bias[e])      # (2I,); gate_up_proj (E, 2I, H)
    g   = module._apply_gate(h)                                # default: act_fn(h[:I]) * h[I:]
    out = g @ down_proj[e].T (+ down_proj_bias[e])             # (H,);  down_proj (E, H, I)
    y  += top_k_weight * out

With ``is_transposed`` the weights are stored as ``(E, H, 2I)`` / ``(E, I, H)`` and multiplied without the
transpose; with ``is_concatenated=False`` gate and up are interleaved along the ``2I`` dimension (the
class's own ``_apply_gate`` splits them).  :class:`ExpertParallelExperts` reproduces exactly this math for
the experts it holds, through :func:`rayzero.moe.dispatch.expert_parallel_apply`.

Sharding.  With ``ep`` ranks in the expert-parallel group, EP rank ``r`` keeps experts
``[r * L, (r + 1) * L)`` (``L = E / ep``) of every expert tensor (dim 0).  With ``tp`` > 1 each expert's
intermediate dimension is further cut over the TP group: the gate/up rows (both halves of a concatenated
``gate_up_proj``, contiguous pairs of an interleaved one) and the matching columns of ``down_proj``, so each
TP rank computes a partial output that ``reduce_from_tp`` sums.  A ``down_proj_bias`` is not cut; the TP
rank 0 adds it (the others add a zero that still carries its gradient, so its gradient is whole and equal
on every TP rank).

Every kept tensor keeps its attribute name (so parameter names such as
``model.layers.0.mlp.experts.gate_up_proj`` are unchanged), is marked ``_rayzero_expert = True``, and carries
its splits (:func:`rayzero.parallel.slicing.mark_split`): ``SplitSpec("ep", 0, ep, r)`` when ``ep`` > 1,
then the TP split when ``tp`` > 1 (also marked ``_rayzero_tp = "shard"``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from rayzero.config import ConfigError
from rayzero.moe.dispatch import expert_parallel_apply
from rayzero.parallel.slicing import SplitSpec, mark_split, take_slice
from rayzero.tp.regions import copy_to_tp, reduce_from_tp

# The parameters an experts module may hold; anything else makes it unsupported (its math is unknown).
_WEIGHTS = ("gate_up_proj", "down_proj")
_BIASES = ("gate_up_proj_bias", "down_proj_bias")


@dataclass(frozen=True)
class ExpertsLayout:
    """How one experts module stores its weights (read from the module, checked against the shapes)."""

    num_experts: int
    hidden: int
    intermediate: int  # I: per-expert intermediate size (gate_up has 2I rows/columns)
    transposed: bool  # (E, H, 2I) / (E, I, H) instead of (E, 2I, H) / (E, H, I)
    concatenated: bool  # [gate; up] halves, else interleaved gate/up pairs
    has_bias: bool

    @property
    def gate_up_dim(self) -> int:
        """Dimension of ``gate_up_proj`` that holds the ``2I`` gate/up outputs (after the expert dim)."""
        return 2 if self.transposed else 1

    @property
    def down_dim(self) -> int:
        """Dimension of ``down_proj`` that holds the ``I`` intermediate inputs."""
        return 1 if self.transposed else 2


def looks_like_experts(module: nn.Module) -> bool:
    """Structural test: the module directly holds 3-D ``gate_up_proj`` and ``down_proj`` with one leading
    expert dimension.  (Whether rayzero can run it is :func:`experts_layout`'s question.)"""
    params = dict(module.named_parameters(recurse=False))
    gu, dp = params.get("gate_up_proj"), params.get("down_proj")
    return gu is not None and dp is not None and gu.dim() == 3 and dp.dim() == 3 and gu.shape[0] == dp.shape[0]


def _uses_experts_interface(module: nn.Module) -> bool:
    # transformers' use_experts_implementation decorator sets these on every instance and gives the class
    # an _apply_gate; it is the contract that the module's forward is the math in this file's docstring.
    return all(hasattr(module, a) for a in ("has_gate", "is_transposed", "is_concatenated", "has_bias")) and hasattr(
        type(module), "_apply_gate"
    )


def experts_layout(module: nn.Module, name: str = "experts") -> ExpertsLayout:
    """The layout of an experts module that :func:`looks_like_experts`; ConfigError when rayzero cannot run it."""
    cls = type(module).__name__
    if not _uses_experts_interface(module):
        raise ConfigError(
            f"{name} ({cls}) holds stacked expert tensors gate_up_proj/down_proj but is not a transformers "
            "experts module (no use_experts_implementation layout attributes has_gate/is_transposed/"
            "is_concatenated/has_bias), so AutoEP cannot know its math; use rayzero's MoE layer (a module "
            "with shard_experts) for custom experts, or disable expert_parallel"
        )
    if getattr(module, "has_post_expert_norm", False):
        raise ConfigError(
            f"{name} ({cls}) applies a norm after each expert (has_post_expert_norm=True), which AutoEP does "
            "not support yet; disable expert_parallel for this model"
        )
    if not module.has_gate:
        raise ConfigError(f"{name} ({cls}) has no gate projection (has_gate=False), which AutoEP does not support")
    params = dict(module.named_parameters(recurse=False))
    unknown = sorted(set(params) - set(_WEIGHTS) - set(_BIASES))
    if unknown:
        raise ConfigError(
            f"{name} ({cls}) has parameters AutoEP does not know how to shard: {', '.join(unknown)}; "
            f"supported are {', '.join(_WEIGHTS + _BIASES)}"
        )
    gu, dp = params["gate_up_proj"], params["down_proj"]
    transposed = bool(module.is_transposed)
    num_experts = gu.shape[0]
    if transposed:
        hidden, two_i = gu.shape[1], gu.shape[2]
        ok = dp.shape[1] * 2 == two_i and dp.shape[2] == hidden
        expect = "gate_up_proj (E, H, 2I) and down_proj (E, I, H)"
    else:
        two_i, hidden = gu.shape[1], gu.shape[2]
        ok = dp.shape[2] * 2 == two_i and dp.shape[1] == hidden
        expect = "gate_up_proj (E, 2I, H) and down_proj (E, H, I)"
    if not ok:
        raise ConfigError(
            f"{name} ({cls}): gate_up_proj {tuple(gu.shape)} and down_proj {tuple(dp.shape)} do not match "
            f"the layout its is_transposed={transposed} declares ({expect})"
        )
    declared = getattr(module, "num_experts", num_experts)
    if isinstance(declared, int) and declared != num_experts:
        raise ConfigError(
            f"{name} ({cls}) declares num_experts={declared} but its tensors hold {num_experts} experts; "
            "AutoEP needs the unsharded module"
        )
    has_bias = bool(module.has_bias)
    present = set(params) & set(_BIASES)
    if present != (set(_BIASES) if has_bias else set()):
        raise ConfigError(
            f"{name} ({cls}) declares has_bias={has_bias} but holds {sorted(present) or 'no'} bias tensors; "
            f"AutoEP supports both {' and '.join(_BIASES)} or neither"
        )
    if has_bias:
        gb, db = params["gate_up_proj_bias"], params["down_proj_bias"]
        if tuple(gb.shape) != (num_experts, two_i) or tuple(db.shape) != (num_experts, hidden):
            raise ConfigError(
                f"{name} ({cls}): biases {tuple(gb.shape)} / {tuple(db.shape)} are not "
                f"({num_experts}, {two_i}) / ({num_experts}, {hidden})"
            )
    return ExpertsLayout(
        num_experts=num_experts,
        hidden=hidden,
        intermediate=two_i // 2,
        transposed=transposed,
        concatenated=bool(module.is_concatenated),
        has_bias=has_bias,
    )


def check_divisible(layout: ExpertsLayout, ep_size: int, tp_size: int, name: str = "experts") -> None:
    """ConfigError naming the numbers and the fix when ``ep_size`` / ``tp_size`` cannot split this module."""
    e, i = layout.num_experts, layout.intermediate
    if e % ep_size:
        choices = ", ".join(str(d) for d in range(1, e + 1) if e % d == 0)
        raise ConfigError(
            f"expert_parallel.autoep_size={ep_size} does not divide the {e} experts of {name}; "
            f"choose an expert-parallel size that divides {e} ({choices})"
        )
    if i % tp_size:
        choices = ", ".join(str(d) for d in range(1, i + 1) if i % d == 0)
        raise ConfigError(
            f"tensor_parallel.autotp_size={tp_size} does not divide the expert intermediate size {i} of {name}; "
            f"choose a tensor-parallel size that divides {i} ({choices})"
        )


class _GroupRef:
    """A process group held by a module.  ``copy.deepcopy`` of the model shares it (a group names ranks, it is
    not state to copy, and torch cannot copy it); pickling a model that holds one fails with the fix."""

    __slots__ = ("group",)

    def __init__(self, group):
        self.group = group

    def __deepcopy__(self, memo):
        return self

    def __reduce__(self):
        if self.group is None:
            return (_GroupRef, (None,))
        raise TypeError(
            "an expert-parallel module holds torch.distributed process groups and cannot be pickled; send the "
            "unsharded model (or a function that builds it) and apply AutoEP on the process that runs it"
        )


def _default_apply_gate(self, gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return self.act_fn(gate) * up


class ExpertParallelExperts(nn.Module):
    """This rank's share of a transformers experts module; a drop-in replacement for it.

    ``forward(hidden_states, top_k_index, top_k_weights)`` takes the whole local batch and global expert
    ids (as the router produced them), sends each (token, expert) pair to the EP rank holding the expert,
    computes one matmul per local expert, and returns the weighted sum for this rank's tokens, as the
    original module does.  Ids outside ``[0, num_experts)`` contribute nothing (transformers' sentinel).

    The plain attributes of the original module are kept as they were (``num_experts`` stays the global
    count, ``intermediate_dim`` the full size, ``config``, ``act_fn`` and any gate constants), so the MoE
    block and anything else reading them see the model's values; this rank's share is
    ``num_local_experts`` experts from ``expert_offset``, each of ``local_intermediate`` intermediate size.
    """

    def __init__(
        self,
        experts: nn.Module,
        ep_group=None,
        ep_size: int = 1,
        ep_rank: int = 0,
        tp_group=None,
        tp_size: int = 1,
        tp_rank: int = 0,
        name: str = "experts",
    ):
        super().__init__()
        if not looks_like_experts(experts):
            raise ConfigError(
                f"{name} ({type(experts).__name__}) is not an experts module: expected 3-D gate_up_proj and "
                "down_proj parameters with the experts along dim 0"
            )
        if isinstance(experts, ExpertParallelExperts):
            raise ConfigError(f"{name} is already expert-parallel; apply AutoEP to the unsharded model once")
        if not (0 <= ep_rank < ep_size) or not (0 <= tp_rank < tp_size):
            raise ConfigError(
                f"ranks out of range: ep_rank={ep_rank} with ep_size={ep_size}, "
                f"tp_rank={tp_rank} with tp_size={tp_size}"
            )
        layout = experts_layout(experts, name)
        check_divisible(layout, ep_size, tp_size, name)

        # what the model's code may read: every public plain attribute, then the child modules (act_fn, ...)
        for key, value in vars(experts).items():
            if not key.startswith("_") and key != "training":
                object.__setattr__(self, key, value)
        for child_name, child in experts.named_children():
            self.add_module(child_name, child)
        for buf_name, buf in experts.named_buffers(recurse=False):
            self.register_buffer(buf_name, buf, persistent=buf_name not in experts._non_persistent_buffers_set)
        self.train(experts.training)

        self.layout = layout
        self.ep_size, self.ep_rank, self.tp_size, self.tp_rank = ep_size, ep_rank, tp_size, tp_rank
        self._ep_group_ref, self._tp_group_ref = _GroupRef(ep_group), _GroupRef(tp_group)
        self.num_local_experts = layout.num_experts // ep_size
        self.expert_offset = ep_rank * self.num_local_experts
        self.local_intermediate = layout.intermediate // tp_size
        gate_fn = getattr(type(experts), "_apply_gate", None)
        self._gate_fn = gate_fn if gate_fn is not None else _default_apply_gate
        if not hasattr(self, "act_fn") and self._gate_fn is _default_apply_gate:
            raise ConfigError(f"{name} ({type(experts).__name__}) has no act_fn for its gate")

        # concatenated gate/up: cut both halves alike; interleaved pairs: a contiguous cut keeps pairs whole
        packed = 2 if layout.concatenated else 1
        tp_specs = {
            "gate_up_proj": SplitSpec("tp", layout.gate_up_dim, tp_size, tp_rank, packed=packed),
            "down_proj": SplitSpec("tp", layout.down_dim, tp_size, tp_rank),
            "gate_up_proj_bias": SplitSpec("tp", 1, tp_size, tp_rank, packed=packed),
            "down_proj_bias": None,  # (E, H): not cut; added once over the TP group (see _down_bias)
        }
        ep_spec = SplitSpec("ep", 0, ep_size, ep_rank)
        for pname, full in experts.named_parameters(recurse=False):
            local = full.detach()
            if ep_size > 1:
                local = take_slice(local, ep_spec)
            tp_spec = tp_specs[pname] if tp_size > 1 else None
            if tp_spec is not None:
                local = take_slice(local, tp_spec)
            # a copy, never a view: the full tensor must not stay alive behind this rank's slice
            param = nn.Parameter(local.clone(), requires_grad=full.requires_grad)
            param._rayzero_expert = True
            if ep_size > 1:
                mark_split(param, ep_spec)
            if tp_spec is not None:
                mark_split(param, tp_spec)
                param._rayzero_tp = "shard"
            self.register_parameter(pname, param)

    # ------------------------------------------------------------------ math
    def _linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        if self.layout.transposed:
            out = x @ weight
            return out + bias if bias is not None else out
        return F.linear(x, weight, bias)

    def _down_bias(self, bias: torch.Tensor) -> torch.Tensor:
        # partial outputs are summed over TP: only TP rank 0 adds the bias's value, every rank its gradient
        if self.tp_size == 1 or self.tp_rank == 0:
            return bias
        return bias - bias.detach()

    def _compute(self, x: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """Rows of ``x`` grouped by local expert (``counts[j]`` rows for expert j) -> one output row each.

        Every local expert runs, even on zero rows, so its weights always get a gradient and ``x`` always
        stays in the graph (the dispatch's backward exchange must run on every EP rank)."""
        bias = self.layout.has_bias
        outs = []
        for j, rows in enumerate(torch.split(x, counts, dim=0)):
            h = self._linear(rows, self.gate_up_proj[j], self.gate_up_proj_bias[j] if bias else None)
            h = self._gate_fn(self, h)
            out = self._linear(h, self.down_proj[j])
            if bias:
                out = out + self._down_bias(self.down_proj_bias[j])
            outs.append(out)
        return torch.cat(outs, dim=0)

    def forward(
        self,
        hidden_states: torch.Tensor,
        top_k_index: torch.Tensor | None = None,
        top_k_weights: torch.Tensor | None = None,
        **kwargs,
    ) -> torch.Tensor:
        # some transformers blocks name the routing arguments router_indices / routing_weights
        if top_k_index is None:
            top_k_index = kwargs.pop("router_indices")
        if top_k_weights is None:
            top_k_weights = kwargs.pop("routing_weights")
        if kwargs:
            raise TypeError(f"unexpected arguments: {', '.join(kwargs)}")
        shape = hidden_states.shape
        x = hidden_states.reshape(-1, shape[-1])
        index = top_k_index.reshape(x.shape[0], -1)
        weights = top_k_weights.reshape(x.shape[0], -1)
        # TP region: inputs are replicated over the TP group; their gradients (partial per TP rank, since
        # each rank holds part of every expert) are summed by copy_to_tp's backward
        if (self.ep_size > 1 or self.tp_size > 1) and not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError(
                f"this experts module is sharded over ep={self.ep_size} x tp={self.tp_size} ranks and routes "
                "tokens with torch.distributed, which is not initialized; initialize the process group (and "
                "pass its EP/TP groups) before running the model"
            )
        tp_group, ep_group = self._tp_group_ref.group, self._ep_group_ref.group
        x = copy_to_tp(x, tp_group, self.tp_size)
        weights = copy_to_tp(weights, tp_group, self.tp_size)
        out = expert_parallel_apply(x, index, weights, self.layout.num_experts, self._compute, ep_group, self.ep_size)
        out = reduce_from_tp(out, tp_group, self.tp_size)
        return out.reshape(shape)

    def extra_repr(self) -> str:
        lo = self.expert_offset
        return (
            f"experts [{lo}, {lo + self.num_local_experts}) of {self.layout.num_experts}, ep={self.ep_size} "
            f"(rank {self.ep_rank}), tp={self.tp_size} (rank {self.tp_rank}), intermediate "
            f"{self.local_intermediate} of {self.layout.intermediate}"
        )
