"""AutoTP: shard a model's linear layers over a tensor-parallel group, following a tp_plan.

:func:`apply_auto_tp` rewrites a model in place so that every rank of a TP group holds a slice of each
planned ``nn.Linear`` and the ranks together compute exactly what the unsharded model computes:

* ``colwise`` — the weight's rows (output features) and the bias are cut; the input enters through
  :func:`~rayzero.tp.regions.copy_to_tp`, so the output stays sharded along its last dimension.
* ``rowwise`` — the weight's columns (input features) are cut; the partial outputs are summed by
  :func:`~rayzero.tp.regions.reduce_from_tp` and the whole bias is added once, after the sum.
* ``packed_colwise`` / ``packed_rowwise`` — as colwise / rowwise, for a fused projection whose sharded
  dimension holds two blocks (e.g. ``gate_up_proj``): each rank takes its piece of each block.
* ``replicated_with_grad_allreduce`` — the parameter stays whole, but its gradient on each rank only covers
  that rank's slice of the activations (Qwen3's per-head ``q_norm``/``k_norm`` see only the local heads), so
  it is marked ``_rayzero_tp = "partial"`` and the engine sums its gradient over the TP group.
* replicated styles (``replicate``, ``colwise_gather_output``, ``rowwise_split_input``, ``embedding_*``,
  ``sequence_parallel``, ``local_params`` ...) — left whole: the layer is computed in full on every rank,
  which costs memory and compute but is exact.

A sliced parameter is a *new* ``nn.Parameter`` under the same attribute name, so parameter names stay those
of the original model (checkpoints and HF state dicts line up); it carries ``_rayzero_tp = "shard"`` and a
:class:`~rayzero.parallel.slicing.SplitSpec` (``mark_split``) recording which slice it is, which the engine
and the checkpoint code use to place and reassemble it.

Where the plan comes from: the ``plan`` argument (``"tensor_parallel": {"tp_plan": {...}}`` in the config),
else the Hugging Face config's ``base_model_tp_plan`` (its keys are relative to the base model and are
prefixed with ``base_model_prefix``), else name patterns for plain torch models (``q_proj``/``fc1``/``w1``
... colwise, ``o_proj``/``fc2``/``w2`` ... rowwise; a module's layers are only sharded by these patterns when
the same parent holds both a colwise and a rowwise match, so a sharded activation always meets the layer
that reduces it).  In a pattern ``*`` stands for one dotted name component (a layer number).

Not sharded:

* experts — parameters marked ``_rayzero_expert`` and plan entries under ``.experts``; AutoEP places them.
* embeddings and ``lm_head`` stay replicated.  Sharding the vocabulary would need a vocab-parallel
  embedding and a vocab-parallel cross entropy (the loss computed from logits split over the ranks), which
  rayzero does not build; a replicated vocabulary costs memory on every rank but gives exact logits and loss.

Attention: heads must divide evenly (``num_attention_heads`` and ``num_key_value_heads`` by ``tp_size``).
Attention modules that reshape with ``-1`` heads (Llama, Qwen3 ...) need nothing more; head-count attributes
stored on the attention module (``num_heads``, ``num_key_value_heads``, ``all_head_size`` ...) are divided to
the local count.
"""

from __future__ import annotations

import logging
import math
import re
from typing import Iterable

import torch
import torch.nn as nn
import torch.nn.functional as F

from rayzero.config import ConfigError
from rayzero.parallel.slicing import SplitSpec, mark_split, splits_of, take_slice
from rayzero.tp.regions import copy_to_tp, reduce_from_tp

__all__ = ["apply_auto_tp", "FALLBACK_COLWISE", "FALLBACK_ROWWISE"]

log = logging.getLogger(__name__)

FALLBACK_COLWISE = ("q_proj", "k_proj", "v_proj", "query", "key", "value", "gate_proj", "up_proj", "w1", "w3",
                    "fc1", "c_fc")
FALLBACK_ROWWISE = ("o_proj", "out_proj", "down_proj", "w2", "fc2", "c_proj")

# style -> (kind, dim of the weight that is cut, packed blocks)
_SHARD_STYLES = {
    "colwise": ("col", 0, 1),
    "rowwise": ("row", 1, 1),
    "packed_colwise": ("col", 0, 2),
    "packed_rowwise": ("row", 1, 2),
}
_PARTIAL_STYLES = {"replicated_with_grad_allreduce"}
# computed in full on every rank: exact, nothing to do
_WHOLE_STYLES = {
    "replicate", "replicated", "colwise_rep", "rowwise_rep", "colwise_gather_output", "rowwise_split_input",
    "embedding_rowwise", "embedding_colwise", "sequence_parallel", "local_params", "gather", "isolated",
}
_EXPERT_STYLES = {"moe_tp_experts", "moe_identity_expert", "ep_dispatch_experts", "grouped_gemm"}
_KNOWN_STYLES = set(_SHARD_STYLES) | _PARTIAL_STYLES | _WHOLE_STYLES | _EXPERT_STYLES

# attention-module attributes that count heads (divided by tp_size) or head features (likewise)
_HEAD_ATTRS = ("num_heads", "num_attention_heads", "num_key_value_heads", "num_kv_heads", "n_head", "n_heads",
               "n_kv_heads", "all_head_size")
_QKV_NAMES = {"q_proj", "k_proj", "v_proj", "query", "key", "value", "qkv_proj", "c_attn", "Wqkv"}


# --------------------------------------------------------------------------------------------------------
# the sharded linear layers (same parameters and attributes as nn.Linear; only forward changes)


class _ColwiseMixin:
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(copy_to_tp(x, self._tp_group, self._tp_size), self.weight, self.bias)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, tp=colwise {self._tp_rank}/{self._tp_size}"


class _RowwiseMixin:
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = reduce_from_tp(F.linear(x, self.weight), self._tp_group, self._tp_size)
        return out if self.bias is None else out + self.bias

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, tp=rowwise {self._tp_rank}/{self._tp_size}"


class ColwiseParallelLinear(_ColwiseMixin, nn.Linear):
    """An ``nn.Linear`` holding this rank's rows of the weight (and of the bias)."""


class RowwiseParallelLinear(_RowwiseMixin, nn.Linear):
    """An ``nn.Linear`` holding this rank's columns of the weight; the bias is whole and added after the sum."""


_CLASS_CACHE: dict[tuple[type, str], type] = {
    (nn.Linear, "col"): ColwiseParallelLinear,
    (nn.Linear, "row"): RowwiseParallelLinear,
}


def _tp_class(cls: type, kind: str) -> type:
    key = (cls, kind)
    if key not in _CLASS_CACHE:
        mixin = _ColwiseMixin if kind == "col" else _RowwiseMixin
        _CLASS_CACHE[key] = type(f"{'Colwise' if kind == 'col' else 'Rowwise'}Parallel{cls.__name__}", (mixin, cls), {})
    return _CLASS_CACHE[key]


# --------------------------------------------------------------------------------------------------------
# plan resolution


def _compile(pattern: str) -> re.Pattern:
    parts = re.split(r"(\*)", pattern)
    return re.compile("".join("[^.]+" if part == "*" else re.escape(part) for part in parts) + r"\Z")


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0] if n > 0 else [1]


def _valid_sizes(numbers: Iterable[int]) -> str:
    g = 0
    for n in numbers:
        g = math.gcd(g, int(n))
    return ", ".join(str(d) for d in _divisors(g))


def _base_prefix(model: nn.Module) -> str:
    prefix = getattr(model, "base_model_prefix", "") or ""
    if prefix and isinstance(getattr(model, prefix, None), nn.Module) and getattr(model, prefix) is not model:
        return prefix + "."
    return ""


def _hf_plan(model: nn.Module) -> dict | None:
    config = getattr(model, "config", None)
    if config is None:
        return None
    plan = getattr(config, "base_model_tp_plan", None)
    if not plan and hasattr(config, "get_text_config"):
        try:
            plan = getattr(config.get_text_config(), "base_model_tp_plan", None)
        except Exception:  # a config without a text part
            plan = None
    return dict(plan) if plan else None


def _is_expert_name(name: str) -> bool:
    return ".experts." in f".{name}." or name == "experts"


def _text_config(model: nn.Module):
    config = getattr(model, "config", None)
    if config is not None and hasattr(config, "get_text_config"):
        try:
            return config.get_text_config()
        except Exception:
            return config
    return config


class _Target:
    """One planned object: a module (a Linear, or a module whose parameters get a mark) or a bare parameter."""

    def __init__(self, name: str, style: str, pattern: str, module: nn.Module | None, param_owner=None,
                 param_attr: str | None = None):
        self.name, self.style, self.pattern = name, style, pattern
        self.module = module
        self.param_owner, self.param_attr = param_owner, param_attr


def _resolve_plan(model, plan: dict, prefix: str, user: bool) -> tuple[list[_Target], list[str], bool]:
    """Match plan entries to modules / parameters.  Returns (targets, patterns tried, expert entry matched)."""
    tried: list[str] = []
    compiled: list[tuple[str, str, list[re.Pattern]]] = []
    for pattern, style in plan.items():
        if not isinstance(pattern, str) or not isinstance(style, str):
            raise ConfigError(
                f"tensor_parallel.tp_plan: entries must be 'module pattern': 'style', got {pattern!r}: {style!r}"
            )
        if style not in _KNOWN_STYLES:
            raise ConfigError(
                f"tensor_parallel.tp_plan: style {style!r} for {pattern!r} is not supported by AutoTP; "
                f"supported: {', '.join(sorted(_SHARD_STYLES) + sorted(_PARTIAL_STYLES))} (sharded or partial), "
                f"{', '.join(sorted(_WHOLE_STYLES))} (left whole), "
                f"{', '.join(sorted(_EXPERT_STYLES))} (experts, left to AutoEP)"
            )
        full = [prefix + pattern] if prefix else [pattern]
        if user and prefix:  # a user plan may name modules from the top or from the base model
            full = [pattern, prefix + pattern]
        tried.extend(full)
        compiled.append((pattern, style, [_compile(p) for p in full]))

    def match(name: str):
        hits = [(pattern, style) for pattern, style, regs in compiled if any(r.match(name) for r in regs)]
        if not hits:
            return None
        exact = [h for h in hits if "*" not in h[0]]
        return (exact or hits)[0]

    targets: list[_Target] = []
    expert_matched = False
    modules = dict(model.named_modules())
    for name, module in modules.items():
        if not name:
            continue
        hit = match(name)
        if hit is None:
            continue
        pattern, style = hit
        if style in _EXPERT_STYLES or _is_expert_name(name) or any(
            getattr(p, "_rayzero_expert", False) for p in module.parameters()
        ):
            expert_matched = True
            continue
        targets.append(_Target(name, style, pattern, module))
    # plan entries naming a bare parameter (e.g. per-head attention sinks)
    for name, param in model.named_parameters():
        hit = match(name)
        if hit is None:
            continue
        pattern, style = hit
        if style in _EXPERT_STYLES or _is_expert_name(name) or getattr(param, "_rayzero_expert", False):
            expert_matched = True
            continue
        owner_name, _, attr = name.rpartition(".")
        targets.append(_Target(name, style, pattern, None, modules[owner_name], attr))
    return targets, tried, expert_matched


def _fallback_targets(model: nn.Module) -> list[_Target]:
    targets = []
    for parent_name, parent in model.named_modules():
        if isinstance(parent, nn.MultiheadAttention):  # its forward reads out_proj.weight directly
            continue
        cols, rows = [], []
        for child_name, child in parent.named_children():
            if not isinstance(child, nn.Linear):
                continue
            if any(getattr(p, "_rayzero_expert", False) for p in child.parameters()):
                continue
            full = f"{parent_name}.{child_name}" if parent_name else child_name
            if _is_expert_name(full):
                continue
            if child_name in FALLBACK_COLWISE:
                cols.append(_Target(full, "colwise", child_name, child))
            elif child_name in FALLBACK_ROWWISE:
                rows.append(_Target(full, "rowwise", child_name, child))
        if cols and rows:  # a colwise output must meet a rowwise layer that reduces it
            targets.extend(cols + rows)
    return targets


# --------------------------------------------------------------------------------------------------------
# validation and rewriting


def _embedding_modules(model: nn.Module) -> set[int]:
    ids = set()
    for getter in ("get_input_embeddings", "get_output_embeddings"):
        fn = getattr(model, getter, None)
        if callable(fn):
            try:
                m = fn()
            except Exception:
                m = None
            if isinstance(m, nn.Module):
                ids.add(id(m))
    for m in model.modules():
        if isinstance(m, nn.Embedding):
            ids.add(id(m))
    return ids


def _parent_of(model: nn.Module, name: str) -> nn.Module:
    parent_name = name.rpartition(".")[0]
    return model.get_submodule(parent_name) if parent_name else model


def apply_auto_tp(model: nn.Module, tp_group, tp_size: int, tp_rank: int, plan: dict | None = None) -> list[str]:
    """Shard ``model``'s planned linear layers over ``tp_group`` in place; return the sharded modules' names.

    ``plan`` maps module-name patterns to styles (see the module docstring); without it the Hugging Face
    config's ``base_model_tp_plan`` is used, else name patterns for plain torch models.  Raises
    :class:`~rayzero.config.ConfigError` when nothing matches, when a style is unknown or cannot apply to the
    module it names, or when ``tp_size`` does not divide a sharded dimension or the attention heads; nothing
    is changed when it raises.  With ``tp_size == 1`` nothing is changed and ``[]`` is returned.
    """
    tp_size, tp_rank = int(tp_size), int(tp_rank)
    if tp_size < 1 or not 0 <= tp_rank < tp_size:
        raise ConfigError(f"tensor_parallel: tp_rank {tp_rank} must be in [0, tp_size={tp_size})")
    if tp_size == 1:
        return []

    prefix = _base_prefix(model)
    if plan:
        source = "tensor_parallel.tp_plan"
        targets, tried, expert_matched = _resolve_plan(model, dict(plan), prefix, user=True)
    elif (hf := _hf_plan(model)) is not None:
        source = f"{type(getattr(model, 'config', None)).__name__}.base_model_tp_plan"
        targets, tried, expert_matched = _resolve_plan(model, hf, prefix, user=False)
    else:
        source = "name patterns"
        # experts already cut over TP (by AutoEP, or a rayzero MoE layer's shard_experts: both run before
        # AutoTP) count as handled; experts that stay whole do not, or TP would silently do nothing
        experts = any(
            getattr(p, "_rayzero_expert", False) and any(s.axis == "tp" for s in splits_of(p))
            for p in model.parameters()
        )
        targets, expert_matched = _fallback_targets(model), experts
        tried = [f"*.{n} (colwise)" for n in FALLBACK_COLWISE] + [f"*.{n} (rowwise)" for n in FALLBACK_ROWWISE]

    shard = [t for t in targets if t.style in _SHARD_STYLES]
    if not shard and not expert_matched:
        raise ConfigError(
            f"tensor_parallel: autotp_size={tp_size} but no module of {type(model).__name__} matches the "
            f"{source} ({'; '.join(tried) or 'empty plan'}); name the layers to shard with "
            '"tensor_parallel": {"tp_plan": {"<module pattern>": "colwise" | "rowwise" | "packed_colwise"}} '
            "(module names as in model.named_modules(); * stands for one name component such as a layer number)"
        )

    # ---- validate everything before changing anything
    embeddings = _embedding_modules(model)
    problems: list[str] = []
    constraints: list[int] = []
    for t in shard:
        kind, dim, packed = _SHARD_STYLES[t.style]
        if t.module is not None:
            if id(t.module) in embeddings:
                raise ConfigError(
                    f"tensor_parallel: {t.name} is an embedding / lm_head; AutoTP keeps these replicated "
                    f"(vocab-parallel embedding and cross entropy are not built); drop {t.pattern!r} from the plan"
                )
            if not isinstance(t.module, nn.Linear):
                raise ConfigError(
                    f"tensor_parallel: {t.name} ({type(t.module).__name__}) is planned {t.style!r}, but AutoTP "
                    f"only shards nn.Linear layers; change the entry {t.pattern!r} in the tp_plan"
                )
            size = t.module.weight.shape[dim]
        else:
            param = getattr(t.param_owner, t.param_attr)
            if kind != "col" or packed != 1:
                raise ConfigError(
                    f"tensor_parallel: parameter {t.name} is planned {t.style!r}; a bare parameter can only be "
                    "'colwise' (cut along dim 0)"
                )
            dim, size = 0, param.shape[0]
        constraints.append(size // packed if size % packed == 0 else size)
        if size % (tp_size * packed):
            blocks = f" ({packed} packed blocks)" if packed > 1 else ""
            problems.append(f"{t.name}: dim {dim} has {size} elements{blocks}")

    # attention heads, when attention projections are cut
    attn_parents: dict[str, nn.Module] = {}
    for t in shard:
        if t.module is None or _SHARD_STYLES[t.style][0] != "col":
            continue
        leaf = t.name.rpartition(".")[2]
        parent_name = t.name.rpartition(".")[0]
        if leaf in _QKV_NAMES or re.search(r"attn|attention", parent_name.rpartition(".")[2], re.I):
            attn_parents[parent_name] = _parent_of(model, t.name)
    if attn_parents:
        cfg = _text_config(model)
        heads = getattr(cfg, "num_attention_heads", None) if cfg is not None else None
        if isinstance(heads, int):
            kv = getattr(cfg, "num_key_value_heads", None) or heads
            constraints += [heads, kv]
            if heads % tp_size or kv % tp_size:
                problems.append(f"num_attention_heads={heads}, num_key_value_heads={kv}")
        for parent_name, parent in attn_parents.items():
            for attr in _HEAD_ATTRS:
                v = parent.__dict__.get(attr)
                if isinstance(v, int) and not isinstance(v, bool) and v > 0:
                    constraints.append(v)
                    if v % tp_size:
                        problems.append(f"{parent_name or type(parent).__name__}.{attr}={v}")
    if problems:
        raise ConfigError(
            f"tensor_parallel: autotp_size={tp_size} does not divide {'; '.join(problems)}; "
            f"valid tp sizes for this model: {_valid_sizes(constraints)}"
        )

    # ---- rewrite
    sharded: list[str] = []
    for t in shard:
        kind, dim, packed = _SHARD_STYLES[t.style]
        if t.module is None:
            spec = SplitSpec("tp", 0, tp_size, tp_rank)
            _replace_param(t.param_owner, t.param_attr, spec)
            sharded.append(t.name)
            continue
        m = t.module
        spec = SplitSpec("tp", dim, tp_size, tp_rank, packed)
        _replace_param(m, "weight", spec)
        if m.bias is not None and kind == "col":
            _replace_param(m, "bias", SplitSpec("tp", 0, tp_size, tp_rank, packed))
        if kind == "col":
            m.out_features = m.weight.shape[0]
        else:
            m.in_features = m.weight.shape[1]
        m._tp_group, m._tp_size, m._tp_rank, m._tp_style = tp_group, tp_size, tp_rank, t.style
        m.__class__ = _tp_class(type(m), kind)
        sharded.append(t.name)

    for parent in attn_parents.values():
        for attr in _HEAD_ATTRS:
            v = parent.__dict__.get(attr)
            if isinstance(v, int) and not isinstance(v, bool) and v > 0:
                setattr(parent, attr, v // tp_size)

    for t in targets:
        if t.style not in _PARTIAL_STYLES:
            continue
        params = [getattr(t.param_owner, t.param_attr)] if t.module is None else list(t.module.parameters())
        for p in params:
            if getattr(p, "_rayzero_tp", None) is None and not getattr(p, "_rayzero_expert", False):
                p._rayzero_tp = "partial"

    order = {name: i for i, (name, _) in enumerate(model.named_parameters())}
    sharded.sort(key=lambda n: order.get(n, order.get(n + ".weight", len(order))))
    log.info("AutoTP (%s): sharded %d modules over %d ranks", source, len(sharded), tp_size)
    return sharded


def _replace_param(owner: nn.Module, attr: str, spec: SplitSpec) -> None:
    old = getattr(owner, attr)
    if getattr(old, "_rayzero_tp", None) == "shard":
        raise ConfigError(f"tensor_parallel: {type(owner).__name__}.{attr} is already tensor-parallel sharded")
    new = nn.Parameter(take_slice(old.data, spec), requires_grad=old.requires_grad)
    for key, value in vars(old).items():  # keep rayzero's other marks (outer splits, expert ...)
        if key.startswith("_rayzero"):
            setattr(new, key, value)
    new._rayzero_tp = "shard"
    mark_split(new, spec)
    setattr(owner, attr, new)
