"""AutoEP: expert parallelism for a Hugging Face MoE model without changing its code.

:func:`apply_auto_ep` walks the model once and shards every MoE block it recognises:

* a **transformers experts module** (transformers 5 layout, found by structure: a module directly holding
  3-D ``gate_up_proj`` and ``down_proj`` parameters whose dim 0 is the number of experts) is replaced, in
  its parent, by :class:`rayzero.moe.experts.ExpertParallelExperts`, which keeps this rank's experts under
  the same parameter names and routes tokens over the EP group;
* a module with a ``shard_experts(ep_group, ep_size, ep_rank, tp_group=None, tp_size=1, tp_rank=0)``
  method (rayzero's own MoE layer) shards itself.

The router (``gate``), shared experts and every other dense module stay whole on every rank, so the model's
own outputs keep working: ``output_router_logits=True``, the load-balancing aux loss and ``labels=`` losses
are computed from this rank's tokens exactly as without EP.

Verified by ``tests/test_auto_ep.py`` (forward, loss incl. aux loss, and gradients against the
single-process model): Mixtral, Qwen3-MoE, Qwen2-MoE (shared expert), OLMoE, DeepSeek-V3 (shared experts,
dense first layer); and, as standalone experts modules under EP x TP, Mixtral's and GPT-OSS's (transposed,
interleaved gate/up, biases, its own clamped gate).
Other transformers families whose experts class uses transformers' experts interface
(``use_experts_implementation``) follow the same contract and are accepted, but are not tested here.
Experts classes outside that interface (e.g. Llama-4's) are refused with a ConfigError when EP or TP must
shard them; with ``ep_size == tp_size == 1`` nothing is replaced, and every expert module found, whatever
its class, only has its parameters marked.

Every expert parameter is marked ``_rayzero_expert = True`` (also when ``ep_size == 1``) so the engine
reduces its gradient over the expert-data-parallel group.
"""

from __future__ import annotations

import torch.distributed as dist
import torch.nn as nn

from rayzero.config import ConfigError
from rayzero.moe.experts import (
    ExpertParallelExperts,
    check_divisible,
    experts_layout,
    looks_like_experts,
)

# DeepSpeed AutoEP's `preset_model` values rayzero accepts; each must equal the model's config.model_type.
PRESET_MODELS = ("mixtral", "qwen3_moe", "qwen2_moe", "olmoe", "deepseek_v3")


def _model_types(model: nn.Module) -> list[str]:
    config = getattr(model, "config", None)
    types = []
    if config is not None:
        types.append(getattr(config, "model_type", None))
        get_text = getattr(config, "get_text_config", None)
        if callable(get_text):
            try:
                types.append(getattr(get_text(), "model_type", None))
            except Exception:  # a config without a text sub-config
                pass
    return [t for t in dict.fromkeys(types) if t]


def _check_preset(model: nn.Module, preset_model: str | None) -> None:
    if preset_model is None:
        return
    if preset_model not in PRESET_MODELS:
        raise ConfigError(
            f"expert_parallel.preset_model={preset_model!r} is not a preset rayzero knows; use one of "
            f"{', '.join(PRESET_MODELS)}, or remove preset_model to find the MoE blocks by structure"
        )
    types = _model_types(model)
    if preset_model not in types:
        found = f"model_type {types[0]!r}" if types else "no config.model_type"
        fix = f"set preset_model to {types[0]!r} or remove it" if types and types[0] in PRESET_MODELS else "remove it"
        raise ConfigError(
            f"expert_parallel.preset_model={preset_model!r} does not match the model: "
            f"{type(model).__name__} has {found}; {fix} (AutoEP then finds the MoE blocks by structure)"
        )


_SIZE_KEYS = {"ep": "expert_parallel.autoep_size", "tp": "tensor_parallel.autotp_size"}


def _check_size(kind: str, size: int, rank: int) -> None:
    if not isinstance(size, int) or size < 1:
        raise ConfigError(f"{_SIZE_KEYS[kind]}={size!r}: the {kind} size must be an integer >= 1")
    if not isinstance(rank, int) or not 0 <= rank < size:
        raise ConfigError(f"{kind}_rank={rank!r} is outside [0, {size}) for {kind}_size={size}")


def _check_group(kind: str, group, size: int, rank: int) -> None:
    # Without torch.distributed the model can still be sliced (e.g. to inspect or convert a rank's share);
    # running it then fails with the fix (ExpertParallelExperts.forward).
    key = _SIZE_KEYS[kind]
    if size == 1 or not (dist.is_available() and dist.is_initialized()):
        return
    actual = dist.get_world_size(group)
    if actual != size:
        raise ConfigError(
            f"{key}={size} but the {kind} process group passed has {actual} ranks; pass the group of the "
            f"{size} ranks that share the {'experts' if kind == 'ep' else 'tensor-parallel slices'}"
        )
    actual_rank = dist.get_rank(group)
    if actual_rank != rank:
        raise ConfigError(f"{kind}_rank={rank} but this process is rank {actual_rank} of the {kind} group")


def _inside(name: str, prefix: str) -> bool:
    return prefix == "" or name.startswith(prefix + ".")


def find_moe_modules(model: nn.Module) -> tuple[list[tuple[str, nn.Module]], list[tuple[str, nn.Module]]]:
    """``(native, experts)``: modules with ``shard_experts``, and transformers-style experts modules."""
    native: list[tuple[str, nn.Module]] = []
    experts: list[tuple[str, nn.Module]] = []
    for name, module in model.named_modules():
        if any(_inside(name, n) for n, _ in native):
            continue  # a rayzero MoE layer shards its own children
        if callable(getattr(module, "shard_experts", None)):
            native.append((name, module))
        elif isinstance(module, ExpertParallelExperts):
            raise ConfigError(
                f"{name or type(model).__name__} is already expert-parallel: apply_auto_ep runs once, on the "
                "unsharded model"
            )
        elif looks_like_experts(module):
            experts.append((name, module))
    return native, experts


def _no_moe_error(model: nn.Module) -> ConfigError:
    types = _model_types(model)
    what = f"{type(model).__name__}" + (f" (model_type {types[0]!r})" if types else "")
    return ConfigError(
        f"{what} has no MoE block AutoEP recognises: it looked for transformers experts modules (a module "
        "holding 3-D gate_up_proj (E, 2I, H) and down_proj (E, H, I) parameters, as in Mixtral, Qwen2-MoE, "
        "Qwen3-MoE, OLMoE and DeepSeek-V3 under transformers >= 5) and for rayzero MoE layers (a module with a "
        "shard_experts method), and found neither; for a dense model remove expert_parallel from the config "
        "(or set expert_parallel.enabled to false)"
    )


def apply_auto_ep(
    model: nn.Module,
    ep_group,
    ep_size: int,
    ep_rank: int,
    tp_group=None,
    tp_size: int = 1,
    tp_rank: int = 0,
    preset_model: str | None = None,
) -> list[str]:
    """Shard every MoE block of ``model`` in place over the EP (and TP) group; return the expert modules' names.

    The names are those of the modules holding the experts: each replaced transformers experts module
    (e.g. ``model.layers.0.mlp.experts``) and each module whose ``shard_experts`` was called.  With
    ``ep_size == tp_size == 1`` the transformers experts modules are kept as they are (no routing is
    needed) and only have their parameters marked as experts; they are still named in the result.

    Every check of AutoEP's runs before the model is touched, so its ConfigErrors leave the model unchanged
    (a rayzero MoE layer's own checks run inside its ``shard_experts``): a model with no
    recognised MoE block, ``preset_model`` not matching ``model.config.model_type``, ``ep_size`` not dividing
    a block's number of experts, ``tp_size`` not dividing its intermediate size, a process group whose
    size or rank disagrees with ``ep_size``/``ep_rank`` (``tp_size``/``tp_rank``), or an experts class whose
    math AutoEP cannot reproduce.
    """
    _check_size("ep", ep_size, ep_rank)
    _check_size("tp", tp_size, tp_rank)
    _check_preset(model, preset_model)
    native, experts = find_moe_modules(model)
    if not native and not experts:
        raise _no_moe_error(model)
    shard = ep_size > 1 or tp_size > 1
    if shard:
        for name, module in experts:
            if name == "":
                raise ConfigError(
                    f"the model itself ({type(model).__name__}) is an experts module; wrap it in the module "
                    "that routes to it, or use ExpertParallelExperts directly"
                )
            check_divisible(experts_layout(module, name), ep_size, tp_size, name)
    for name, module in native:
        e = getattr(module, "num_experts", None)
        if isinstance(e, int) and e % ep_size:
            choices = ", ".join(str(d) for d in range(1, e + 1) if e % d == 0)
            raise ConfigError(
                f"expert_parallel.autoep_size={ep_size} does not divide the {e} experts of "
                f"{name or type(model).__name__}; choose an expert-parallel size that divides {e} ({choices})"
            )
    _check_group("ep", ep_group, ep_size, ep_rank)
    _check_group("tp", tp_group, tp_size, tp_rank)

    for name, module in native:
        module.shard_experts(ep_group, ep_size, ep_rank, tp_group=tp_group, tp_size=tp_size, tp_rank=tp_rank)
    for name, module in experts:
        if not shard:
            for p in module.parameters(recurse=False):
                p._rayzero_expert = True
            continue
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        replacement = ExpertParallelExperts(module, ep_group, ep_size, ep_rank, tp_group, tp_size, tp_rank, name=name)
        setattr(parent, child, replacement)
    position = {name: i for i, (name, _) in enumerate(model.named_modules())}
    return sorted([name for name, _ in native] + [name for name, _ in experts], key=position.__getitem__)
