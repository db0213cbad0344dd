"""What the engine does to the user's model before partitioning it: put it on the rank's device, make every
rank start from rank 0's weights, cut its EP/TP slices, and resolve the user's param groups."""

from __future__ import annotations

from typing import TYPE_CHECKING, Iterable

import torch

from rayzero.zero.init import materialize_frozen
from rayzero.zero.partition import USER_GROUP_KEY

if TYPE_CHECKING:
    from rayzero.accelerator import Accelerator
    from rayzero.comm import Communicator
    from rayzero.config import Config
    from rayzero.parallel.state import ParallelState
    from rayzero.topology import ParallelDims


@torch.no_grad()
def place_on_device(model: torch.nn.Module, accelerator: "Accelerator") -> None:
    """Off the CPU, the model's parameters and buffers go to the rank's device (zero_init's one-element
    stand-ins included: moving them is cheap, their shards live on the device already)."""
    if accelerator.name == "cpu":
        return
    device = accelerator.device()
    for t in [*model.parameters(), *model.buffers()]:
        if t.device != device:
            if hasattr(t, "_rayzero_shard"):  # an expanded one-element stand-in: keep it one element
                _move(t, torch.zeros(1, dtype=t.dtype, device=device).expand(t.shape))
            else:
                _move(t, t.data.to(device))


def _move(t: torch.Tensor, moved: torch.Tensor) -> None:
    """``t`` now holds ``moved`` and stays the same Python object (hooks, optimizer references and
    names keep working).  Where the device's tensors have another tensor type than the host's (a device
    registered from Python), ``t.data = moved`` is refused and the two objects' contents are swapped
    instead, as ``Module.to`` does."""
    if torch._has_compatible_shallow_copy_type(t, moved):
        t.data = moved
        return
    if isinstance(t, torch.nn.Parameter):
        moved = torch.nn.Parameter(moved, requires_grad=t.requires_grad)
    marks = dict(t.__dict__)  # rayzero's and the user's attributes stay with the object
    torch.utils.swap_tensors(t, moved)
    t.__dict__.update(marks)


@torch.no_grad()
def broadcast_from_rank0(model: torch.nn.Module, comm: "Communicator") -> None:
    """Every rank starts from rank 0's weights and buffers (as DDP does)."""
    if comm.world == 1:
        return
    for p in model.parameters():
        if not hasattr(p, "_rayzero_shard"):
            comm.broadcast(p.data)
    for b in model.buffers():
        comm.broadcast(b.data)


def apply_model_parallelism(
    model: torch.nn.Module, model_parameters, pre_sharded: bool, cfg: "Config", topology: "ParallelDims",
    parallel: "ParallelState", comm: "Communicator",
):
    """AutoEP, then AutoTP, on the (already consistent) model; returns the user's param groups with
    every sliced parameter replaced by its slice."""
    coords = parallel.coords
    ep_on, tp = cfg.expert_parallel.enabled, topology.tp
    if not ep_on and tp == 1:
        return model_parameters
    if pre_sharded:
        # zero_init sharded over the whole world; EP/TP slices and their DP/EDP partitions are cut
        # from whole tensors, so the shards are gathered here: set-up holds the whole model once,
        # afterwards every rank keeps only the ZeRO shards of its own slices.
        for p in model.parameters():
            if hasattr(p, "_rayzero_shard"):
                materialize_frozen(p, comm)
    before = {n: id(p) for n, p in model.named_parameters()}  # ids only: replaced tensors can be freed
    if ep_on:
        from rayzero.moe.auto_ep import apply_auto_ep

        apply_auto_ep(
            model, parallel.ep_group, topology.ep, coords.ep,
            tp_group=parallel.tp_group, tp_size=tp, tp_rank=coords.tp,
            preset_model=cfg.expert_parallel.preset_model,
        )
    if tp > 1:
        from rayzero.tp.auto_tp import apply_auto_tp

        apply_auto_tp(model, parallel.tp_group, tp, coords.tp, plan=cfg.tensor_parallel.tp_plan)
    after = dict(model.named_parameters())
    replaced = {before[n]: after[n] for n in before if n in after and id(after[n]) != before[n]}
    if model_parameters is None or not replaced:
        return model_parameters
    swap = lambda p: replaced.get(id(p), p)
    items = list(model_parameters)
    if items and isinstance(items[0], dict):
        return [dict(g, params=[swap(p) for p in g["params"]]) for g in items]
    return [swap(p) for p in items]


def param_groups(model: torch.nn.Module, model_parameters: Iterable | None) -> list[dict]:
    """The user's param groups (or one group of every trainable parameter), checked, frozen parameters
    dropped, each tagged with the user's group number."""
    trainable = [p for p in dict.fromkeys(model.parameters()) if p.requires_grad]
    if model_parameters is None:
        return [{"params": trainable}]
    items = list(model_parameters)
    if items and isinstance(items[0], dict):
        groups = [dict(g, params=list(g["params"])) for g in items]
    else:
        groups = [{"params": items}]
    owned = set(model.parameters())
    seen: set = set()
    for gi, g in enumerate(groups):
        for p in g["params"]:
            if p not in owned:
                raise ValueError(f"param group {gi} holds a tensor that is not a parameter of the model")
            if p in seen:
                raise ValueError(f"a parameter appears in more than one param group (group {gi})")
            seen.add(p)
        g["params"] = [p for p in g["params"] if p.requires_grad]
    missing = [p for p in trainable if p not in seen]
    if missing:
        raise ValueError(
            f"{len(missing)} trainable parameter(s) are in no param group; add them to a group or set "
            "requires_grad=False on them"
        )
    for gi, g in enumerate(groups):
        g[USER_GROUP_KEY] = gi  # the user's numbering survives dropping all-frozen groups
    return [g for g in groups if g["params"]]
