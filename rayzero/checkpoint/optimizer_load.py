"""What loading a checkpoint takes from the saved optimizer, and what the config keeps.

Only the optimizer *state* (moments, step counts) comes from the checkpoint; the param-group settings the
engine was built with (the config, the user's group overrides, the fused/foreach/capturable choice) win,
with one warning listing what differs.  Under ``strict=False`` parameters the checkpoint does not hold
must start as a fresh optimizer would start them, or the load is refused with the fix.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import torch

from rayzero.checkpoint.format import CheckpointError

if TYPE_CHECKING:
    from rayzero.engine import Engine

logger = logging.getLogger("rayzero")


def group_hparams(group: dict) -> dict:
    out = {}
    for k, v in group.items():
        if k == "params":
            continue
        if torch.is_tensor(v):
            v = v.item()
        if isinstance(v, tuple):
            v = list(v)
        if isinstance(v, (int, float, str, bool, list)) or v is None:
            out[k] = v
    return out


# Param-group keys that are not the config's hyper-parameters: torch's bookkeeping, and the lr when a
# scheduler sets it (the scheduler's own state says where in the schedule the run is).
_NOT_HPARAMS = ("params", "state", "param_names", "initial_lr")

# Optimizer states a torch optimizer keeps only under some settings: with the config's settings winning,
# a state the checkpoint has but the config turned off is dropped, and one the config turned on starts
# as torch starts it (zeros: amsgrad's running maximum of exp_avg_sq).
STATE_USED_WHEN = {
    "max_exp_avg_sq": lambda group: bool(group.get("amsgrad", False)),
    "momentum_buffer": lambda group: group.get("momentum", 0) != 0,
}
STATE_STARTS_AT_ZERO = ("max_exp_avg_sq",)


def _saved_groups_of(g, loadable: set[str], saved_params: dict, saved_group_of: dict) -> list[dict]:
    """The checkpoint's optimizer groups that this partition group's loaded parameters came from."""
    out: dict[int, dict] = {}
    for e in g.layout.entries:
        if e.name in loadable:
            saved = saved_group_of.get(saved_params[e.name]["name"])
            if saved is not None:
                out.setdefault(id(saved), saved)
    return list(out.values())


def _names_summary(names: list[str], most: int = 4) -> str:
    shown = ", ".join(names[:most])
    return shown + (f", +{len(names) - most} more" if len(names) > most else "")


def warn_hparam_differences(engine: "Engine", loadable: set[str], saved_params: dict, saved_group_of: dict) -> None:
    """Log once (rank 0) which of the checkpoint's param-group hyper-parameters differ from the config's.

    Compared per optimizer group (a user param group can be several: dense and expert partitions) and
    reported per user param group, naming its parameters; a value that differs only in some of a user
    group's partitions is tagged with their kinds."""
    skip = set(_NOT_HPARAMS) | ({"lr"} if engine.lr_scheduler is not None else set())
    # user group -> key -> (saved, now) -> partition kinds
    found: dict[int, dict[str, dict[tuple[str, str], list[str]]]] = {}
    kinds_of: dict[int, list[str]] = {}
    names_of: dict[int, list[str]] = {}
    for g, group in zip(engine.partitions.groups, engine.optimizer.param_groups):
        kinds_of.setdefault(g.user_group, []).append(g.domain.kind)
        names_of.setdefault(g.user_group, []).extend(e.name for e in g.layout.entries)
        now = group_hparams(group)
        for saved in _saved_groups_of(g, loadable, saved_params, saved_group_of):
            for k, v in saved.items():
                if k in skip or k not in now or v == now[k]:
                    continue
                kinds = found.setdefault(g.user_group, {}).setdefault(k, {}).setdefault((repr(v), repr(now[k])), [])
                if g.domain.kind not in kinds:
                    kinds.append(g.domain.kind)
    if not found or engine.rank != 0:
        return
    parts = []
    for u in sorted(found):
        diffs = []
        for k, values in found[u].items():
            for (old, new), kinds in values.items():
                partial = len(values) > 1 or len(kinds) < len(set(kinds_of[u]))
                where = f" ({', '.join(kinds)} parameters)" if partial else ""
                diffs.append(f"{k} saved {old} now {new}{where}")
        parts.append(f"param group {u} [{_names_summary(names_of[u])}]: " + ", ".join(diffs))
    logger.warning(
        "load_checkpoint: the checkpoint's optimizer settings differ from the config, using the config "
        "(only the optimizer state was restored): %s", "; ".join(parts)
    )


def check_new_params_can_start_fresh(
    engine: "Engine", loadable: set[str], saved_params: dict, saved_group_of: dict, state_names: list[str]
) -> None:
    """strict=False: refuse a partition group that mixes loaded and new parameters where the new ones
    cannot get the state a fresh optimizer would give them.

    Within one partition group the optimizer keeps one state for one flat tensor: the new parameters'
    moments can be zeros (as fresh) but the group's scalar states (Adam's ``step``) are shared, so they
    would inherit the saved step and Adam's bias correction would be wrong for them.  SGD's zero momentum
    buffer equals a fresh one (the gradient itself) only without dampening.  A group made only of new
    parameters starts from an empty state (step 0), which is exact.
    """
    bad = []
    for gi, (g, group) in enumerate(zip(engine.partitions.groups, engine.optimizer.param_groups)):
        new = [e.name for e in g.layout.entries if e.name not in loadable]
        if not new or len(new) == len(g.layout.entries):
            continue
        reasons = []
        for saved in _saved_groups_of(g, loadable, saved_params, saved_group_of):
            for k, info in saved.get("state", {}).items():
                if info.get("value", 0) != 0:
                    reasons.append(f"{k} {info['value']:g}")
        if "momentum_buffer" in state_names and group.get("momentum", 0) != 0 and group.get("dampening", 0) != 0:
            reasons.append("a momentum buffer with dampening")
        if reasons:
            bad.append(f"{sorted(new)} share optimizer group {gi} (param group {g.user_group}) with loaded "
                       f"parameters, whose saved state has {', '.join(dict.fromkeys(reasons))}")
    if bad:
        raise CheckpointError(
            "strict=False cannot give the parameters it does not load (new, or of another shape) a fresh "
            "optimizer state: " + "; ".join(bad) + ". The optimizer keeps one step count per group, so they "
            "would resume at the saved step instead of 0. Put the new parameters in a param group of their own, e.g. "
            "rayzero.initialize(model, config, model_parameters=[{'params': loaded_params}, "
            "{'params': new_params}]); a group of only new parameters starts at step 0"
        )
