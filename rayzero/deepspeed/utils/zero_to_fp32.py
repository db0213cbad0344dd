"""``rayzero.deepspeed.utils.zero_to_fp32``: DeepSpeed's checkpoint-to-weights helpers, on rayzero checkpoints.

A rayzero checkpoint is already universal (one set of fragments, any world size and stage), so consolidating
is reading: every trained parameter is assembled from its fp32 master fragments, and buffers and frozen
parameters come as saved (``rayzero ckpt export`` does the same into a file, in the model's dtypes).
``checkpoint_dir`` is the save directory (the one holding ``latest`` and the tag directories), a local path
or a pyarrow.fs URI.
"""

from __future__ import annotations

import os
import re

import torch

from rayzero.config import NotSupportedYetError

__all__ = [
    "convert_zero_checkpoint_to_fp32_state_dict",
    "get_fp32_state_dict_from_zero_checkpoint",
    "load_state_dict_from_zero_checkpoint",
]


def _tag(checkpoint_dir, tag):
    from rayzero.checkpoint.format import LATEST, MANIFEST
    from rayzero.checkpoint.storage import Storage

    storage = Storage.resolve(checkpoint_dir)
    if tag is None:
        latest = storage.join(LATEST)
        if not storage.exists(latest):
            raise ValueError(f"there is no 'latest' file at {latest}: pass tag= to name the checkpoint to read")
        tag = storage.read_bytes(latest).decode().strip()
    tag = str(tag)
    if not storage.exists(storage.join(tag, MANIFEST)) and not storage.is_dir(storage.join(tag)):
        raise FileNotFoundError(f"checkpoint {storage.join(tag)} does not exist")
    return tag


@torch.no_grad()
def get_fp32_state_dict_from_zero_checkpoint(checkpoint_dir, tag=None, exclude_frozen_parameters: bool = False,
                                             lazy_mode: bool = False) -> dict[str, torch.Tensor]:
    """The whole model's ``state_dict`` from the checkpoint ``checkpoint_dir/tag`` (default: the tag
    ``latest`` names), on the CPU: trained parameters in fp32 from the masters (tied ones under each of
    their names), buffers and frozen parameters as saved.  ``lazy_mode`` is accepted and loads at once."""
    if exclude_frozen_parameters:
        raise NotSupportedYetError(
            "get_fp32_state_dict_from_zero_checkpoint(exclude_frozen_parameters=True) is not supported yet: a "
            "rayzero checkpoint stores frozen parameters and buffers together; drop the names you do not want")
    from rayzero.checkpoint.format import STATE_MASTER, STATE_WHOLE, dtype_from_name
    from rayzero.checkpoint.reader import FragmentIndex
    from rayzero.checkpoint.tools import _assemble, _numel, _open

    ck = _open(checkpoint_dir, _tag(checkpoint_dir, tag))
    m = ck.manifest
    index = FragmentIndex(ck.storage, ck.tag, m)
    out: dict[str, torch.Tensor] = {}
    for p in m["params"]:
        t = _assemble(index, p["name"], STATE_MASTER, p["numel"], p["shape"], p.get("splits")).float()
        for name in [p["name"], *p.get("aliases", [])]:
            out[name] = t
    for w in m.get("whole", []):
        if not w.get("persistent", True):
            continue
        t = _assemble(index, w["name"], STATE_WHOLE, _numel(w["shape"]), w["shape"], w.get("splits"))
        t = t.to(dtype_from_name(w["dtype"]))
        for name in [w["name"], *w.get("aliases", [])]:
            out[name] = t
    return out


_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


def _bytes(size) -> int:
    if isinstance(size, int):
        return size
    match = re.fullmatch(r"\s*([0-9.]+)\s*([A-Za-z]*)\s*", str(size))
    if not match or match.group(2).upper() not in _UNITS:
        raise ValueError(f"max_shard_size {size!r} is not a size such as '5GB' or '500MB'")
    return int(float(match.group(1)) * _UNITS[match.group(2).upper()])


def convert_zero_checkpoint_to_fp32_state_dict(checkpoint_dir, output_dir, max_shard_size="5GB",
                                               safe_serialization: bool = False, tag=None,
                                               exclude_frozen_parameters: bool = False) -> None:
    """Write the fp32 ``state_dict`` of the checkpoint to ``output_dir/pytorch_model.bin`` (``torch.save``),
    or ``output_dir/model.safetensors`` with ``safe_serialization``.  A model above ``max_shard_size`` would
    need several files, which is not supported yet (raises before writing)."""
    state = get_fp32_state_dict_from_zero_checkpoint(checkpoint_dir, tag, exclude_frozen_parameters)
    total = sum(t.numel() * t.element_size() for t in {id(t): t for t in state.values()}.values())
    if total > _bytes(max_shard_size):
        raise NotSupportedYetError(
            f"the model's weights take {total} bytes, above max_shard_size={max_shard_size!r}: writing them in "
            "several shard files is not supported yet; raise max_shard_size, or use `rayzero ckpt export` "
            "(one file of any size)")
    os.makedirs(output_dir, exist_ok=True)
    if safe_serialization:
        from safetensors.torch import save_file

        seen: set[int] = set()
        flat = {}
        for name, t in state.items():  # safetensors refuses tensors that share memory
            flat[name] = t.clone() if id(t) in seen else t.contiguous()
            seen.add(id(t))
        save_file(flat, os.path.join(output_dir, "model.safetensors"), metadata={"format": "pt"})
    else:
        torch.save(state, os.path.join(output_dir, "pytorch_model.bin"))


def load_state_dict_from_zero_checkpoint(model: torch.nn.Module, checkpoint_dir, tag=None) -> torch.nn.Module:
    """Move ``model`` to the CPU and load the checkpoint's fp32 weights into it (``strict=False``, as
    DeepSpeed does); returns the model.  A model a live engine trains is refused (destroy the engine first);
    the stand-ins a ZeRO stage 3 engine's ``destroy()`` left are replaced by the loaded tensors."""
    from rayzero.deepspeed.zero import _engine_of
    from rayzero.zero.stage3 import freed_by_destroy

    params = list(model.parameters())
    if _engine_of(params) is not None:
        raise RuntimeError(
            "load_state_dict_from_zero_checkpoint: a live rayzero engine trains this model, so its parameters "
            "are partitioned; call engine.destroy() first, or load the checkpoint into the engine with "
            "engine.load_checkpoint(checkpoint_dir)")
    state = get_fp32_state_dict_from_zero_checkpoint(checkpoint_dir, tag)
    stand_ins = any(freed_by_destroy(p) for p in params)
    model = model.cpu()
    model.load_state_dict(state, strict=False, assign=stand_ins)
    return model
