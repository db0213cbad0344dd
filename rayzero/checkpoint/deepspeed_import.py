"""Import a DeepSpeed checkpoint as a rayzero universal checkpoint (``rayzero ckpt import-deepspeed``).

Reads, with torch alone (DeepSpeed need not be installed):

- a ZeRO stage 1, 2 or 3 checkpoint as ``engine.save_checkpoint`` writes it: ``<dir>/latest`` naming a tag,
  ``<tag>/mp_rank_00_model_states.pt`` (stage 3: one ``zero_pp_rank_<r>_mp_rank_00_model_states.pt`` per
  rank) and one ``[bf16_]zero_pp_rank_<r>_mp_rank_00_optim_states.pt`` per data-parallel rank, saved at any
  world size, in fp32, bf16 or fp16;
- a universal checkpoint as DeepSpeed's ``ds_to_universal`` writes it: ``zero/<param>/fp32.pt``,
  ``exp_avg.pt``, ``exp_avg_sq.pt``, ``step.pt`` and ``mp_rank_00_model_states.pt``.

The layouts (what each rank's flat fp32 partition holds):

- stages 1-2: each param group's flat vector is the concatenation of the ranks' partitions, in rank order;
  the group's parameters lie in it one after another in ``param_shapes`` order (each followed by its
  ``param_alignment_paddings`` entry, if any), and the vector ends with padding up to a multiple of the
  world size.  The optimizer's ``exp_avg``/``exp_avg_sq`` partitions have the same layout (a rank's state may
  be longer than its fp32 partition by the group's padding: the extra elements are padding);
- stage 3: each rank holds, for every parameter in ``param_shapes`` order, ``ceil(numel / world)``
  consecutive elements (its chunk ``r`` of the parameter, the last one padded), across the concatenation of
  its sub-groups' flat tensors; the optimizer state per sub-group has the same layout.

DeepSpeed's pickles name DeepSpeed classes (its loss scaler, its ZeRO stage enum, fragment addresses, ...).
They are read with a restricted unpickler: tensors, storages and plain containers load as usual, every
``deepspeed.*`` class becomes a :class:`DeepSpeedObject` placeholder that only records its arguments and
state (nothing of DeepSpeed runs), and any other global is refused with a :class:`CheckpointError`.

The output is written with rayzero's own writer as one rank file (world size 1: each tensor whole), so it
verifies with ``rayzero ckpt verify`` and loads into an engine of any world size and stage.
"""
from __future__ import annotations

import glob
import json
import logging
import math
import os
import pickle
import random
import re
import time
import types
from dataclasses import dataclass, field
from typing import Any

import torch

from rayzero.checkpoint.format import (
    FORMAT_NAME,
    FORMAT_VERSION,
    LATEST,
    MANIFEST,
    STATE_MASTER,
    STATE_WHOLE,
    CheckpointError,
    Fragment,
    dtype_name,
)
from rayzero.checkpoint.storage import Storage
from rayzero.checkpoint.writer import abort, commit, prepare, staging_dir, write_rank

logger = logging.getLogger("rayzero")

ADAM_STATES = ("exp_avg", "exp_avg_sq")


# ---- reading DeepSpeed's pickles without DeepSpeed ----------------------------------------------------------
class DeepSpeedObject:
    """Stands in for an object of a DeepSpeed class in a checkpoint: ``ds_class`` is the class's dotted name,
    ``args`` what it was constructed with (an enum's value, a named tuple's fields), and its pickled state
    is set as attributes (``vars()``)."""

    ds_class = "deepspeed"

    def __new__(cls, *args, **kwargs):
        obj = object.__new__(cls)
        obj.__dict__["args"] = args
        return obj

    def __init__(self, *args, **kwargs):
        pass

    def __setstate__(self, state):
        if isinstance(state, tuple) and len(state) == 2:  # (dict, slots)
            state = {**(state[0] or {}), **(state[1] or {})}
        if isinstance(state, dict):
            self.__dict__.update(state)
        else:
            self.__dict__["state"] = state

    @property
    def value(self):
        """An enum's value (its first constructor argument)."""
        return self.args[0] if self.args else None

    def __repr__(self) -> str:
        return f"<{self.ds_class} {self.args or ''} {dict((k, v) for k, v in vars(self).items() if k != 'args')}>"


_placeholders: dict[str, type] = {}


def _placeholder(module: str, name: str) -> type:
    key = f"{module}.{name}"
    if key not in _placeholders:
        _placeholders[key] = type(name, (DeepSpeedObject,), {"ds_class": key})
    return _placeholders[key]


# what a DeepSpeed checkpoint may name besides DeepSpeed's own classes: tensors, storages, plain containers
_ALLOWED = {
    ("collections", "OrderedDict"), ("collections", "defaultdict"),
    ("torch", "Size"), ("torch", "device"),
    ("torch._utils", "_rebuild_tensor"), ("torch._utils", "_rebuild_tensor_v2"),
    ("torch._utils", "_rebuild_tensor_v3"), ("torch._utils", "_rebuild_parameter"),
    ("torch._utils", "_rebuild_parameter_with_state"), ("torch.nn.parameter", "Parameter"),
    ("torch._tensor", "_rebuild_from_type_v2"), ("torch", "Tensor"),
    ("builtins", "set"), ("builtins", "frozenset"), ("builtins", "slice"), ("builtins", "complex"),
    ("builtins", "bytearray"), ("copyreg", "_reconstructor"), ("builtins", "object"),
}


class _Unpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        if module == "deepspeed" or module.startswith("deepspeed."):
            return _placeholder(module, name)
        if (module, name) in _ALLOWED or (module == "torch" and (name.endswith("Storage") or
                                                                 isinstance(getattr(torch, name, None), torch.dtype))):
            return super().find_class(module, name)
        raise CheckpointError(
            f"the pickle names {module}.{name}, which a DeepSpeed checkpoint has no business holding; it is not "
            "loaded (only tensors, plain containers and DeepSpeed's own classes are read)"
        )


_restricted_pickle = types.SimpleNamespace(Unpickler=_Unpickler, __name__="rayzero_deepspeed_pickle",
                                           load=lambda f, **kw: _Unpickler(f, **kw).load())


def load_pickle(path: str) -> Any:
    """``torch.load`` of one DeepSpeed file through the restricted unpickler, onto the CPU."""
    try:
        return torch.load(path, map_location="cpu", weights_only=False, pickle_module=_restricted_pickle)
    except CheckpointError as e:
        raise CheckpointError(f"{path}: {e}") from None
    except (OSError, RuntimeError, EOFError, pickle.UnpicklingError, ValueError, AttributeError) as e:
        raise CheckpointError(f"{path} is not a readable DeepSpeed checkpoint file ({type(e).__name__}: {e})") from None


# ---- what was imported --------------------------------------------------------------------------------------
@dataclass
class Imported:
    """A DeepSpeed checkpoint read whole: every parameter's fp32 master and Adam state, full shaped."""

    kind: str  # "zero" or "universal"
    source: str  # the directory the files were read from
    tag: str | None
    stage: int
    saved_world: int
    params: list[dict] = field(default_factory=list)  # {"name", "shape", "dtype", "group", "aliases"}
    masters: dict[str, torch.Tensor] = field(default_factory=dict)
    states: dict[str, dict[str, torch.Tensor]] = field(default_factory=dict)  # name -> {"exp_avg": ...}
    group_hparams: list[dict] = field(default_factory=list)
    group_steps: list[float | None] = field(default_factory=list)
    whole: dict[str, torch.Tensor] = field(default_factory=dict)  # buffers and frozen parameters
    model_states: dict = field(default_factory=dict)
    loss_scaler: Any = None
    dynamic_loss_scale: bool = False


# keys DeepSpeed's engine itself writes into the model-states file; everything else is the client's state
_DS_MODEL_KEYS = {
    "module", "buffer_names", "optimizer", "param_shapes", "frozen_param_shapes", "shared_params",
    "frozen_param_fragments", "lr_scheduler", "data_sampler", "random_ltd", "sparse_tensor_module_names",
    "skipped_steps", "global_steps", "global_samples", "dp_world_size", "mp_world_size", "ds_config",
    "ds_version", "checkpoint_parallel_dimensions", "autoep_layers", "ds_autoep_layers",
}


def _natural(path: str) -> list:
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", os.path.basename(path))]


def _shape(s) -> list[int]:
    return [int(d) for d in (s if not torch.is_tensor(s) else s.tolist())]


def _numel(shape: list[int]) -> int:
    return math.prod(shape)


def find_checkpoint(src: str, tag: str | None) -> tuple[str, str, str | None]:
    """(kind, the directory holding the files, the tag) for ``src``: a DeepSpeed save directory (with ``latest``,
    or with ``tag``), a tag's directory itself, or a ``ds_to_universal`` output folder."""
    src = os.path.abspath(os.fspath(src))
    if not os.path.isdir(src):
        raise CheckpointError(f"{src} is not a directory: give the DeepSpeed checkpoint directory (the one "
                              "holding 'latest', or a tag's folder of *_model_states.pt files)")

    def kind_of(d: str) -> str | None:
        if os.path.isdir(os.path.join(d, "zero")) and glob.glob(os.path.join(d, "zero", "*", "fp32.pt")):
            return "universal"
        if glob.glob(os.path.join(d, "*_model_states.pt")) or glob.glob(os.path.join(d, "*_optim_states.pt")):
            return "zero"
        return None

    if tag is not None:
        tag = str(tag)
        d = os.path.join(src, tag)
        if not os.path.isdir(d):
            tags = sorted(n for n in os.listdir(src) if kind_of(os.path.join(src, n)))
            raise CheckpointError(f"{src} has no checkpoint tag {tag!r} (tags there: {tags or 'none'})")
        kind = kind_of(d)
        if kind is None:
            raise CheckpointError(f"{d} holds no DeepSpeed checkpoint files (*_model_states.pt, *_optim_states.pt "
                                  "or zero/<param>/fp32.pt)")
        return kind, d, tag
    kind = kind_of(src)
    if kind is not None:
        return kind, src, os.path.basename(src)
    for latest in ("latest", "latest_universal"):
        path = os.path.join(src, latest)
        if os.path.isfile(path):
            named = open(path).read().strip()
            d = os.path.join(src, named)
            kind = kind_of(d) if os.path.isdir(d) else None
            if kind is None and os.path.isfile(os.path.join(d, MANIFEST)):
                raise CheckpointError(f"{src} is a rayzero checkpoint already ({d} has {MANIFEST}), not a DeepSpeed "
                                      "one: load it as it is")
            if kind is None:
                raise CheckpointError(f"{path} names tag {named!r}, but {d} holds no DeepSpeed checkpoint files; "
                                      "give --tag, or the tag's directory")
            return kind, d, named
    raise CheckpointError(
        f"{src} is not a DeepSpeed checkpoint directory: it has no 'latest' file, no *_model_states.pt or "
        "*_optim_states.pt files and no zero/<param>/fp32.pt (ds_to_universal's output); give the directory "
        "passed to save_checkpoint, or a tag's folder in it"
    )


def _rank_files(d: str, pattern: str, what: str) -> list[str]:
    """The per-rank files ``pattern`` matches, in rank order; refuses model parallel (mp_rank other than 00)
    and pipeline checkpoints, and gaps in the rank numbers."""
    files = sorted(glob.glob(os.path.join(d, pattern)), key=_natural)
    other_mp = [f for f in glob.glob(os.path.join(d, "*mp_rank_*")) if "mp_rank_00" not in os.path.basename(f)]
    if other_mp:
        raise CheckpointError(f"{d} holds a tensor-parallel DeepSpeed checkpoint ({os.path.basename(other_mp[0])}); "
                              "only data parallel (mp_rank_00) checkpoints are imported: convert it with "
                              "DeepSpeed's ds_to_universal first")
    ranks = []
    for f in files:
        m = re.search(r"zero_pp_rank_(\d+)_", os.path.basename(f))
        ranks.append(int(m.group(1)) if m else 0)
    if ranks != list(range(len(ranks))):
        missing = sorted(set(range(max(ranks, default=-1) + 1)) - set(ranks))
        raise CheckpointError(f"{d}: {what} files for ranks {missing} are missing (found ranks {ranks}); the "
                              "checkpoint is incomplete: copy every rank's file")
    return files


def _model_states(d: str) -> list[dict]:
    if glob.glob(os.path.join(d, "layer_*-model_states.pt")):
        raise CheckpointError(f"{d} is a pipeline-parallel DeepSpeed checkpoint (layer_*-model_states.pt); only "
                              "data parallel checkpoints are imported")
    files = [f for f in _rank_files(d, "*mp_rank_00_model_states.pt", "model-states")]
    if not files:
        raise CheckpointError(f"{d} has no mp_rank_00_model_states.pt (nor zero_pp_rank_*_mp_rank_00_model_states.pt): "
                              "the checkpoint is incomplete")
    states = [load_pickle(f) for f in files]
    for f, s in zip(files, states):
        if not isinstance(s, dict) or "param_shapes" not in s:
            raise CheckpointError(f"{f} is not a DeepSpeed model-states file (it has no param_shapes)")
    return states


def _stage_of(osd: dict, where: str) -> int:
    z = osd.get("zero_stage")
    value = z.value if isinstance(z, DeepSpeedObject) else z
    if not isinstance(value, int) or value not in (1, 2, 3):
        raise CheckpointError(f"{where}: not a ZeRO checkpoint (zero_stage {value!r}); rayzero imports ZeRO "
                              "stage 1-3 and universal checkpoints")
    return value


def _adam_state(state: dict, where: str) -> dict:
    if not isinstance(state, dict) or not all(k in state for k in ADAM_STATES):
        keys = sorted(state) if isinstance(state, dict) else type(state).__name__
        raise CheckpointError(f"{where}: the optimizer state has {keys}, not Adam's exp_avg and exp_avg_sq; "
                              "rayzero imports Adam/AdamW state only")
    return state


def _step_value(v) -> float | None:
    if v is None:
        return None
    return float(v.item() if torch.is_tensor(v) else v)


def _group_hparams(group: dict) -> dict:
    out = {}
    for k, v in group.items():
        if k == "params":
            continue
        if torch.is_tensor(v) and v.numel() == 1:
            v = v.item()
        if isinstance(v, tuple):
            v = list(v)
        if isinstance(v, (int, float, str, bool, list)):  # None: torch's "its default", not a setting
            out[k] = v
    return out


def _param_list(model_states: dict) -> tuple[list[dict], dict[str, list[str]]]:
    shapes = model_states["param_shapes"]
    if isinstance(shapes, dict):
        shapes = [shapes]
    aliases: dict[str, list[str]] = {}
    for alias, owner in (model_states.get("shared_params") or {}).items():
        aliases.setdefault(owner, []).append(alias)
    module = model_states.get("module") or {}
    params = []
    for gi, group in enumerate(shapes):
        for name, shape in group.items():
            t = module.get(name)
            params.append({"name": name, "shape": _shape(shape), "group": gi, "aliases": aliases.get(name, []),
                           "dtype": dtype_name(t.dtype) if torch.is_tensor(t) else None})
    return params, aliases


def _whole_tensors(model_states: list[dict], stage: int, world: int) -> dict[str, torch.Tensor]:
    """Buffers (saved whole in the model states) and frozen parameters (stages 1-2: whole in rank 0's file;
    stage 3: one chunk per rank's file)."""
    first = model_states[0]
    module = first.get("module") or {}
    out = {n: module[n] for n in first.get("buffer_names") or [] if n in module}
    frozen = first.get("frozen_param_shapes") or {}
    for name, shape in frozen.items():
        shape = _shape(shape)
        if stage <= 2:
            out[name] = first["frozen_param_fragments"][name].reshape(shape)
        else:
            if len(model_states) != world:
                raise CheckpointError(f"stage 3 frozen parameter {name}: {len(model_states)} model-states files for "
                                      f"{world} ranks")
            parts = [s["frozen_param_fragments"][name].reshape(-1) for s in model_states]
            out[name] = torch.cat(parts)[: _numel(shape)].reshape(shape)
    return {n: t.detach().clone() for n, t in out.items()}


def read_zero(d: str, tag: str | None) -> Imported:
    """Read a ZeRO 1-3 checkpoint (the directory of one tag)."""
    model_states = _model_states(d)
    optim_files = _rank_files(d, "*zero_pp_rank_*_mp_rank_00_optim_states.pt", "optimizer-states")
    if not optim_files:
        raise CheckpointError(f"{d} has no *zero_pp_rank_<r>_mp_rank_00_optim_states.pt files: it is not a ZeRO "
                              "checkpoint (or its optimizer states were not saved); rayzero needs them to carry the "
                              "fp32 masters and the optimizer state")
    first = load_pickle(optim_files[0]).get("optimizer_state_dict")
    if not isinstance(first, dict):
        raise CheckpointError(f"{optim_files[0]} has no optimizer_state_dict: not a ZeRO optimizer-states file")
    stage = _stage_of(first, optim_files[0])
    counts = first.get("partition_count")
    world = max(counts) if isinstance(counts, (list, tuple)) else int(counts)
    if world != len(optim_files):
        raise CheckpointError(f"{d}: the checkpoint was saved by {world} ranks but holds {len(optim_files)} optimizer-"
                              "states files; it is incomplete (a rank's file is missing) or mixes two saves")
    osds = [first] + [load_pickle(f)["optimizer_state_dict"] for f in optim_files[1:]]
    params, _ = _param_list(model_states[0])
    imp = Imported(kind="zero", source=d, tag=tag, stage=stage, saved_world=world, params=params,
                   model_states=model_states[0], loss_scaler=first.get("loss_scaler"),
                   dynamic_loss_scale=bool(first.get("dynamic_loss_scale", False)))
    n_groups = 1 + max((p["group"] for p in params), default=0)
    if stage <= 2:
        _read_zero12(imp, osds, optim_files, n_groups)
    else:
        _read_zero3(imp, osds, optim_files, n_groups)
    imp.whole = _whole_tensors(model_states, stage, world)
    return imp


def _read_zero12(imp: Imported, osds: list[dict], files: list[str], n_groups: int) -> None:
    for r, (o, f) in enumerate(zip(osds, files)):
        if "single_partition_of_fp32_groups" not in o or "base_optimizer_state" not in o:
            raise CheckpointError(f"{f} has no single_partition_of_fp32_groups / base_optimizer_state: not a ZeRO "
                                  "stage 1-2 optimizer-states file")
        if len(o["single_partition_of_fp32_groups"]) != n_groups:
            raise CheckpointError(f"{f} has {len(o['single_partition_of_fp32_groups'])} param groups, the model states "
                                  f"list {n_groups}")
    base_groups = osds[0]["base_optimizer_state"]["param_groups"]
    for gi in range(n_groups):
        parts, states = [], {k: [] for k in ADAM_STATES}
        step = None
        for o, f in zip(osds, files):
            part = o["single_partition_of_fp32_groups"][gi].reshape(-1).float()
            base = o["base_optimizer_state"]
            key = base["param_groups"][gi]["params"][0]
            st = _adam_state(base["state"].get(key, {}), f)
            for k in ADAM_STATES:  # a rank's state may run past its partition by the group's padding
                states[k].append(st[k].reshape(-1)[: part.numel()].float())
            parts.append(part)
            step = _step_value(st.get("step")) if step is None else step
        flat = torch.cat(parts)
        flat_states = {k: torch.cat(v) for k, v in states.items()}
        pads = (osds[0].get("param_alignment_paddings") or [None] * n_groups)[gi]
        offset = 0
        group_params = [p for p in imp.params if p["group"] == gi]
        for i, p in enumerate(group_params):
            n = _numel(p["shape"])
            if offset + n > flat.numel():
                raise CheckpointError(f"{imp.source}: param group {gi}'s partitions hold {flat.numel()} elements, "
                                      f"too few for its parameters (at {p['name']}); the files do not belong together")
            imp.masters[p["name"]] = flat[offset:offset + n].reshape(p["shape"]).clone()
            imp.states[p["name"]] = {k: v[offset:offset + n].reshape(p["shape"]).clone() for k, v in flat_states.items()}
            offset += n + (pads[i] if pads else 0)
        # what is left is the group's padding, less than DeepSpeed's alignment of 2 x world elements
        if not 0 <= flat.numel() - offset < 2 * imp.saved_world:
            raise CheckpointError(f"{imp.source}: param group {gi}'s partitions hold {flat.numel()} elements, its "
                                  f"parameters {offset}; the files do not belong together")
        imp.group_hparams.append(_group_hparams(base_groups[gi]))
        imp.group_steps.append(step)


def _read_zero3(imp: Imported, osds: list[dict], files: list[str], n_groups: int) -> None:
    world = imp.saved_world
    flats, flat_states = [], []
    for o, f in zip(osds, files):
        if "fp32_flat_groups" not in o or "optimizer_state_dict" not in o:
            raise CheckpointError(f"{f} has no fp32_flat_groups / optimizer_state_dict: not a ZeRO stage 3 "
                                  "optimizer-states file")
        subgroups = [t.reshape(-1).float() for t in o["fp32_flat_groups"]]
        inner = o["optimizer_state_dict"]
        # the torch optimizer's state per sub-group flat tensor, in sub-group order
        order = [k for g in inner["param_groups"] for k in g["params"]]
        if len(order) != len(subgroups):
            raise CheckpointError(f"{f}: {len(subgroups)} fp32 sub-groups but {len(order)} optimizer entries")
        sts = [_adam_state(inner["state"].get(k, {}), f) for k in order]
        flats.append(torch.cat(subgroups))
        flat_states.append({k: torch.cat([s[k].reshape(-1)[: t.numel()].float() for s, t in zip(sts, subgroups)])
                            for k in ADAM_STATES})
    inner0 = osds[0]["optimizer_state_dict"]
    offset = 0
    for p in imp.params:
        n = _numel(p["shape"])
        chunk = -(-n // world)
        if offset + chunk > flats[0].numel():
            raise CheckpointError(f"{imp.source}: the stage 3 partitions hold {flats[0].numel()} elements per rank, "
                                  f"too few for the parameters (at {p['name']}); the files do not belong together")
        imp.masters[p["name"]] = torch.cat([fl[offset:offset + chunk] for fl in flats])[:n].reshape(p["shape"]).clone()
        imp.states[p["name"]] = {k: torch.cat([s[k][offset:offset + chunk] for s in flat_states])[:n]
                                 .reshape(p["shape"]).clone() for k in ADAM_STATES}
        offset += chunk
    if offset != flats[0].numel():
        raise CheckpointError(f"{imp.source}: the stage 3 partitions hold {flats[0].numel()} elements per rank, the "
                              f"parameters' chunks {offset}; the files do not belong together")
    groups = inner0["param_groups"]
    if len(groups) != n_groups:
        raise CheckpointError(f"{files[0]}: {len(groups)} optimizer param groups, the model states list {n_groups}")
    for g in groups:
        imp.group_hparams.append(_group_hparams(g))
        imp.group_steps.append(_step_value(inner0["state"].get(g["params"][0], {}).get("step")) if g["params"] else None)


def read_universal(d: str, tag: str | None) -> Imported:
    """Read DeepSpeed's universal checkpoint (ds_to_universal's output folder)."""
    model_files = sorted(glob.glob(os.path.join(d, "*mp_rank_00_model_states.pt")), key=_natural)
    if not model_files:
        raise CheckpointError(f"{d} has zero/ but no mp_rank_00_model_states.pt: the universal checkpoint is "
                              "incomplete (ds_to_universal copies it there)")
    all_ms = [load_pickle(f) for f in model_files]  # (stage 3: one per rank, each with its frozen chunks)
    ms = all_ms[0]
    params, _ = _param_list(ms)
    opt_path = os.path.join(d, "zero", "optimizer_state.pt")
    opt = load_pickle(opt_path) if os.path.isfile(opt_path) else {}
    stage = opt.get("zero_stage")
    stage = stage.value if isinstance(stage, DeepSpeedObject) else stage
    counts = opt.get("partition_count", 1)
    imp = Imported(kind="universal", source=d, tag=tag, stage=stage if isinstance(stage, int) else 0,
                   saved_world=max(counts) if isinstance(counts, (list, tuple)) else int(counts), params=params,
                   model_states=ms, loss_scaler=opt.get("loss_scaler"),
                   dynamic_loss_scale=bool(opt.get("dynamic_loss_scale", False)))

    def tensor(name: str, what: str) -> torch.Tensor | None:
        path = os.path.join(d, "zero", name, f"{what}.pt")
        if not os.path.isfile(path):
            return None
        v = load_pickle(path)
        return v["param"] if isinstance(v, dict) else v

    n_groups = 1 + max((p["group"] for p in params), default=0)
    steps: list[float | None] = [None] * n_groups
    for p in params:
        fp32 = tensor(p["name"], "fp32")
        if fp32 is None:
            raise CheckpointError(f"{d}: zero/{p['name']}/fp32.pt is missing; the universal checkpoint is incomplete")
        if fp32.numel() != _numel(p["shape"]):  # (stage 3's are saved flat)
            raise CheckpointError(f"{d}: zero/{p['name']}/fp32.pt has shape {_shape(fp32.shape)}, the model states say "
                                  f"{p['shape']} (a tensor-parallel slice?); only data parallel checkpoints are imported")
        imp.masters[p["name"]] = fp32.detach().float().reshape(p["shape"]).clone()
        st = {}
        for k in ADAM_STATES:
            t = tensor(p["name"], k)
            if t is None:
                raise CheckpointError(f"{d}: zero/{p['name']}/{k}.pt is missing; rayzero imports Adam/AdamW state")
            if t.numel() != fp32.numel():
                raise CheckpointError(f"{d}: zero/{p['name']}/{k}.pt has {t.numel()} elements, fp32.pt {fp32.numel()}")
            st[k] = t.detach().float().reshape(p["shape"]).clone()
        imp.states[p["name"]] = st
        if steps[p["group"]] is None:
            steps[p["group"]] = _step_value(tensor(p["name"], "step"))
    groups = opt.get("param_groups") or [{} for _ in range(n_groups)]
    imp.group_hparams = [_group_hparams(g) for g in groups[:n_groups]]
    imp.group_hparams += [{} for _ in range(n_groups - len(imp.group_hparams))]
    # ds_to_universal leaves out step.pt for a stage 3 checkpoint: Adam then stepped once per optimizer step
    # that was not skipped
    taken = float(int(ms.get("global_steps", 0) or 0) - int(ms.get("skipped_steps", 0) or 0))
    imp.group_steps = [taken if s is None else s for s in steps]
    imp.whole = _whole_tensors(all_ms, 3 if imp.stage == 3 else 2, len(all_ms))
    return imp


def read(src: str, tag: str | None = None) -> Imported:
    """Read the DeepSpeed checkpoint at ``src`` (see :func:`find_checkpoint`) whole, checking it as it goes."""
    kind, d, found = find_checkpoint(src, tag)
    with torch.no_grad():
        imp = read_universal(d, found) if kind == "universal" else read_zero(d, found)
    _strip_wrapper_prefix(imp)
    return imp


WRAPPER_PREFIX = "module."


def _strip_wrapper_prefix(imp: Imported) -> None:
    """A model saved inside a wrapper (its names all ``module.<name>``) is imported under the inner model's
    names, the ones the model that loads the import has."""
    names = [p["name"] for p in imp.params] + [a for p in imp.params for a in p["aliases"]] + list(imp.whole)
    if not names or not all(n.startswith(WRAPPER_PREFIX) for n in names):
        return
    cut = len(WRAPPER_PREFIX)
    for p in imp.params:
        p["name"], p["aliases"] = p["name"][cut:], [a[cut:] for a in p["aliases"]]
    imp.masters = {n[cut:]: t for n, t in imp.masters.items()}
    imp.states = {n[cut:]: t for n, t in imp.states.items()}
    imp.whole = {n[cut:]: t for n, t in imp.whole.items()}


# ---- writing it as a rayzero checkpoint ---------------------------------------------------------------------
def _optimizer_type(imp: Imported) -> str:
    groups = imp.group_hparams
    if groups and all("decoupled_weight_decay" in g for g in groups):
        return "AdamW" if groups[0]["decoupled_weight_decay"] else "Adam"
    opt = ((imp.model_states.get("ds_config") or {}).get("optimizer") or {})
    kind = str(opt.get("type", "AdamW")).lower()
    if kind == "adam" and not (opt.get("params") or {}).get("adam_w_mode", True):
        return "Adam"
    return "AdamW"


def _loss_scaler_state(imp: Imported) -> dict:
    from rayzero.optim.loss_scaler import LossScaler

    state = LossScaler().state_dict()
    ls = imp.loss_scaler
    if isinstance(ls, DeepSpeedObject):
        v = vars(ls)
        mapping = {"cur_scale": "scale", "scale_window": "window", "delayed_shift": "hysteresis",
                   "cur_hysteresis": "hysteresis_left", "consecutive_hysteresis": "consecutive_hysteresis",
                   "min_scale": "min_scale", "scale_factor": "scale_factor"}
        for ds_key, key in mapping.items():
            if ds_key in v and isinstance(v[ds_key], (int, float, bool)):
                state[key] = type(state[key])(v[ds_key])
        state["dynamic"] = bool(v.get("dynamic", imp.dynamic_loss_scale))
        it, last = v.get("cur_iter"), v.get("last_overflow_iter")
        if isinstance(it, int) and isinstance(last, int) and state["dynamic"]:
            state["good_steps"] = max(it - last - 1, 0)  # the steps since the last overflow
    return state


def _scheduler_state(imp: Imported) -> dict | None:
    """DeepSpeed's schedulers keep ``last_batch_iteration`` (-1 before the first step), and so do rayzero's
    (rayzero/optim/schedulers.py, stepped as DeepSpeed steps them): the position carries over as it is."""
    sd = imp.model_states.get("lr_scheduler")
    if not isinstance(sd, dict) or "last_batch_iteration" not in sd:
        return None
    return {"last_batch_iteration": int(sd["last_batch_iteration"]),
            "deepspeed": {k: v for k, v in sd.items() if _is_json(v)}}


def _is_json(v) -> bool:
    try:
        json.dumps(v)
        return True
    except (TypeError, ValueError):
        return False


def _config_dict(ds_config: dict) -> dict:
    """The manifest's record of the config: rayzero's reading of DeepSpeed's config where it accepts it,
    else rayzero's defaults (loads never read it back: the loading engine's own config is what counts)."""
    from rayzero.config import Config

    try:
        return Config.from_any(dict(ds_config)).to_dict()
    except Exception as e:  # noqa: BLE001 - any refusal: the record falls back to the defaults
        logger.warning("the DeepSpeed config was not accepted by rayzero (%s); the imported checkpoint records "
                       "rayzero's default config instead (it is only a record: loads use the engine's own)", e)
        return Config().to_dict()


def _derived_rng(seed: int, step: int) -> dict:
    """Random streams for the single saved rank, derived from (seed, step, rank 0) as a load at another world
    size derives them (DeepSpeed does not save its RNG states); this process's own streams are left as found."""
    from rayzero.checkpoint.rng import rederive_rng, rng_state

    saved = (torch.get_rng_state(), random.getstate())
    try:
        import numpy as np

        saved_np = np.random.get_state()
    except ImportError:
        saved_np = None
    cpu = types.SimpleNamespace(name="cpu", manual_seed=lambda s: None)
    try:
        rederive_rng(seed, step, 0, cpu)
        return rng_state(cpu)
    finally:
        torch.set_rng_state(saved[0])
        random.setstate(saved[1])
        if saved_np is not None:
            np.random.set_state(saved_np)


def _plain_tag(imp: Imported, global_steps: int) -> str:
    tag = imp.tag
    if tag and "/" not in tag and not tag.startswith(".") and tag != LATEST and tag != "zero":
        return tag
    return f"global_step{global_steps}"


def build(imp: Imported, tag: str) -> tuple[dict, list[Fragment], dict]:
    """The manifest (without ``files``/``rng``), the one rank's fragments, and its rng entry."""
    ms = imp.model_states
    ds_config = ms.get("ds_config") or {}
    global_steps = int(ms.get("global_steps", 0) or 0)
    compute = "float32"
    if (ds_config.get("bf16") or ds_config.get("bfloat16") or {}).get("enabled"):
        compute = "bfloat16"
    elif (ds_config.get("fp16") or {}).get("enabled"):
        compute = "float16"
    fragments: list[Fragment] = []
    params = []
    for p in imp.params:
        n = _numel(p["shape"])
        params.append({"name": p["name"], "aliases": list(p["aliases"]), "shape": list(p["shape"]),
                       "dtype": p["dtype"] or compute, "numel": n, "group": p["group"], "kind": "dense"})
        if n == 0:
            continue
        fragments.append(Fragment(p["name"], STATE_MASTER, 0, n, imp.masters[p["name"]].reshape(-1).contiguous()))
        for k in ADAM_STATES:
            fragments.append(Fragment(p["name"], k, 0, n, imp.states[p["name"]][k].reshape(-1).contiguous()))
    whole = []
    for name, t in imp.whole.items():
        whole.append({"name": name, "aliases": [], "shape": _shape(t.shape), "dtype": dtype_name(t.dtype),
                      "persistent": True})
        fragments.append(Fragment(name, STATE_WHOLE, 0, t.numel(), t.reshape(-1).contiguous()))
    groups = []
    for gi, hp in enumerate(imp.group_hparams):
        step = imp.group_steps[gi] if gi < len(imp.group_steps) else None
        state = {} if step is None else {"step": {"kind": "tensor", "value": step, "dtype": "float32"}}
        groups.append({"params": [p["name"] for p in imp.params if p["group"] == gi], **hp, "state": state})
    client = {k: v for k, v in ms.items() if k not in _DS_MODEL_KEYS}
    dropped = sorted(k for k, v in client.items() if not _is_json(v))
    if dropped:
        logger.warning("client_state keys %s of the DeepSpeed checkpoint are not JSON and are left out", dropped)
    client = {k: v for k, v in client.items() if k not in dropped}
    tbs = ds_config.get("train_batch_size")
    mbs = ds_config.get("train_micro_batch_size_per_gpu")
    gas = ds_config.get("gradient_accumulation_steps", 1)
    cfg = _config_dict(ds_config)
    manifest = {
        "format": FORMAT_NAME,
        "version": FORMAT_VERSION,
        "tag": tag,
        "created_unix": time.time(),
        "world_size": 1,
        "stage": imp.stage,
        "topology": {"dp": 1, "tp": 1, "ep": 1},
        "compute_dtype": compute,
        "params": params,
        "whole": whole,
        "optimizer": {"type": _optimizer_type(imp), "state_names": list(ADAM_STATES), "param_groups": groups},
        "scheduler": _scheduler_state(imp),
        "loss_scaler": _loss_scaler_state(imp),
        "global_steps": global_steps,
        "micro_steps": global_steps * int(gas or 1),
        "skipped_steps": int(ms.get("skipped_steps", 0) or 0),
        "global_samples": int(ms.get("global_samples", 0) or 0),
        "batch": {"train_batch_size": tbs, "micro_batch_size": mbs, "gradient_accumulation_steps": gas},
        "config": cfg,
        "client_state": client or None,
    }
    rng = _derived_rng(int(cfg.get("seed", 1234)), global_steps)
    return manifest, fragments, rng


def import_deepspeed(src: str | os.PathLike, out: str | os.PathLike, tag: str | None = None) -> dict:
    """Read the DeepSpeed checkpoint at ``src`` and write it as a rayzero universal checkpoint into the save
    directory ``out`` (local path or pyarrow.fs URI), under the DeepSpeed tag (or ``global_step<N>``), with
    ``out/latest`` naming it.  Everything is read and checked before anything is written; a failure while
    writing leaves ``out`` as it was.  Returns a summary: ``kind``, ``source``, ``stage``, ``saved_world``,
    ``params``, ``global_steps``, ``tag``, ``path``."""
    imp = read(os.fspath(src), tag)
    global_steps = int(imp.model_states.get("global_steps", 0) or 0)
    out_tag = _plain_tag(imp, global_steps)
    manifest, fragments, rng = build(imp, out_tag)
    storage = Storage.resolve(os.fspath(out))
    if storage.exists(storage.join(out_tag, MANIFEST)):
        raise CheckpointError(f"{storage.join(out_tag)} already holds a checkpoint; import into another directory "
                              "or remove it first")
    created = storage.local and not os.path.exists(storage.root)
    meta = {"rank": 0, "world_size": 1, "tag": out_tag, "global_steps": global_steps}
    try:
        prepare(storage, out_tag)
        write_rank(storage, staging_dir(storage, out_tag), 0, fragments, {"rng": rng}, None, meta)
        commit(storage, out_tag, 1, lambda markers: {**manifest, "rng": [m.pop("rng") for m in markers],
                                                     "files": markers})
    except BaseException:
        abort(storage, out_tag)
        if created:
            try:
                os.rmdir(storage.root)  # only if nothing else is in it
            except OSError:
                pass
        raise
    return {"kind": imp.kind, "source": imp.source, "stage": imp.stage, "saved_world": imp.saved_world,
            "params": len(imp.params), "global_steps": global_steps, "tag": out_tag, "path": storage.join(out_tag)}

