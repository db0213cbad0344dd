"""Offline tools for universal checkpoints: inspect, verify, export.  No process group, no Engine.

Each tool reads only what it needs: ``inspect`` the manifest and the file footers, ``verify`` every byte
(streamed, one fragment at a time), ``export`` the master weights and whole tensors, one parameter at a time.
``path_or_uri`` is either a save directory (the tag defaults to the one its ``latest`` names) or a checkpoint
directory itself (the one holding ``manifest.json``), local or any pyarrow.fs URI.
"""

from __future__ import annotations

import os
import posixpath
from dataclasses import dataclass
from typing import Any

import torch

from rayzero.checkpoint.reader import (
    FragmentIndex,
    coverage_problems,
    file_problems,
    layout_problems,
    read_manifest,
    resolve_tag,
)
from rayzero.checkpoint.format import (
    MANIFEST,
    MANIFEST_HASH_KEY,
    STATE_MASTER,
    STATE_WHOLE,
    CheckpointError,
    ChecksumError,
    FragmentFile,
    dtype_from_name,
)
from rayzero.checkpoint.storage import Storage, xxh3_of
from rayzero.parallel.slicing import canonical_to_full, from_layout_dicts, local_shape_of

__all__ = ["inspect", "format_inspect", "verify", "export"]

EXPORT_FORMATS = {".safetensors": "safetensors", ".pt": "torch", ".pth": "torch", ".bin": "torch"}


@dataclass(frozen=True)
class _Opened:
    storage: Storage  # the save directory
    tag: str
    manifest: dict


def _open(path_or_uri: str | os.PathLike, tag: str | None) -> _Opened:
    storage = Storage.resolve(path_or_uri)
    if tag is None and storage.exists(storage.join(MANIFEST)):
        # Pointed at the checkpoint directory itself: its parent is the save directory.
        split = os.path.split if storage.local else posixpath.split
        parent, tag = split(storage.root.rstrip("/\\"))
        storage = Storage(storage.fs, parent, storage.local)
    elif not storage.exists(storage.root):
        raise CheckpointError(f"{os.fspath(path_or_uri)!r} does not exist; pass a save directory or a checkpoint "
                              "directory (the one holding manifest.json)")
    tag = resolve_tag(storage, tag)
    return _Opened(storage, tag, read_manifest(storage, tag))


# ---- inspect -------------------------------------------------------------------------------------------
def inspect(path_or_uri: str | os.PathLike, tag: str | None = None) -> dict:
    """A JSON-able summary of a checkpoint, from its manifest and the fragment files' footers."""
    ck = _open(path_or_uri, tag)
    m = ck.manifest
    states_of: dict[str, set[str]] = {}
    problem = None
    try:
        index = FragmentIndex(ck.storage, ck.tag, m)  # footers only
        for param, state in index.where:
            states_of.setdefault(param, set()).add(state)
    except CheckpointError as e:  # still summarize what the manifest says; verify tells the rest
        problem = str(e)
        for p in m["params"]:
            states_of[p["name"]] = {STATE_MASTER, *m["optimizer"]["state_names"]}
        for w in m.get("whole", []):
            states_of[w["name"]] = {STATE_WHOLE}

    def ordered(states: set[str]) -> list[str]:
        return sorted(states, key=lambda s: (s != STATE_MASTER, s == STATE_WHOLE, s))

    params = [
        {**{k: p[k] for k in ("name", "aliases", "shape", "dtype", "numel", "group")},
         "states": ordered(states_of.get(p["name"], set()))}
        for p in m["params"]
    ]
    whole = [
        {"name": w["name"], "shape": w["shape"], "dtype": w["dtype"], "numel": _numel(w["shape"]),
         "states": ordered(states_of.get(w["name"], set()))}
        for w in m.get("whole", [])
    ]
    files = [{"file": f["file"], "size": f["size"], "fragments": f["fragments"], "xxh3": f["xxh3"]}
             for f in m["files"]]
    client_state = m.get("client_state")
    groups = m["optimizer"]["param_groups"]
    return {
        "path": ck.storage.join(ck.tag),
        "tag": ck.tag,
        "format_version": m["version"],
        "created_unix": m.get("created_unix"),
        "step": m["global_steps"],
        "micro_steps": m.get("micro_steps"),
        "skipped_steps": m.get("skipped_steps"),
        "global_samples": m.get("global_samples"),
        "world_size": m["world_size"],
        "stage": m["stage"],
        "topology": m["topology"],
        "compute_dtype": m.get("compute_dtype"),
        "dtypes": sorted({p["dtype"] for p in m["params"]}),
        "optimizer": m["optimizer"]["type"],
        "lr": [g.get("lr") for g in groups],
        "states": ordered({s for v in states_of.values() for s in v}),
        "num_params": len(params),
        "num_elements": sum(p["numel"] for p in params),
        "num_whole": len(whole),
        "whole_elements": sum(w["numel"] for w in whole),
        "params": params,
        "whole": whole,
        "files": files,
        "num_fragments": sum(f["fragments"] for f in files),
        "total_bytes": sum(f["size"] for f in files),
        "client_state_keys": sorted(client_state) if isinstance(client_state, dict) else None,
        "problem": problem,
    }


def _numel(shape: list[int]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def _human(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError


def _table(headers: list[str], rows: list[list[str]]) -> list[str]:
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(headers)]
    fmt = "  ".join(f"{{:<{w}}}" for w in widths)
    return [fmt.format(*headers).rstrip(), fmt.format(*("-" * w for w in widths)).rstrip()] + [
        fmt.format(*r).rstrip() for r in rows
    ]


def format_inspect(summary: dict) -> str:
    """``inspect``'s summary as readable text: header, parameters, whole tensors, files."""
    s = summary
    topo = ", ".join(f"{k}={v}" for k, v in s["topology"].items())
    lines = [
        f"checkpoint {s['tag']}  ({s['path']})",
        f"  step {s['step']} (micro-steps {s['micro_steps']}, skipped {s['skipped_steps']}, "
        f"samples {s['global_samples']})",
        f"  saved by world size {s['world_size']}, ZeRO stage {s['stage']}, topology {topo}",
        f"  dtypes {', '.join(s['dtypes']) or '-'} (compute {s['compute_dtype']}), optimizer {s['optimizer']} "
        f"(lr {', '.join(f'{lr:g}' if isinstance(lr, (int, float)) else str(lr) for lr in s['lr'])})",
        f"  {s['num_params']} parameters, {s['num_elements']:,} elements; {s['num_whole']} whole tensors "
        f"(buffers, frozen parameters), {s['whole_elements']:,} elements",
        f"  states: {', '.join(s['states'])}",
        f"  client_state keys: {s['client_state_keys']}",
    ]
    if s.get("problem"):
        lines.append(f"  PROBLEM: {s['problem']} (run `rayzero ckpt verify`)")
    lines += ["", "parameters:"]
    rows = [
        [p["name"] + (f" (= {', '.join(p['aliases'])})" if p["aliases"] else ""), str(tuple(p["shape"])),
         f"{p['numel']:,}", p["dtype"], str(p["group"]), ",".join(p["states"])]
        for p in s["params"]
    ]
    lines += ["  " + ln for ln in _table(["name", "shape", "numel", "dtype", "group", "states"], rows)]
    if s["whole"]:
        lines += ["", "whole tensors:"]
        rows = [[w["name"], str(tuple(w["shape"])), f"{w['numel']:,}", w["dtype"]] for w in s["whole"]]
        lines += ["  " + ln for ln in _table(["name", "shape", "numel", "dtype"], rows)]
    lines += ["", "files:"]
    rows = [[f["file"], f"{f['size']:,}", str(f["fragments"]), f["xxh3"]] for f in s["files"]]
    lines += ["  " + ln for ln in _table(["file", "bytes", "fragments", "xxh3"], rows)]
    lines.append(f"  total {s['total_bytes']:,} bytes ({_human(s['total_bytes'])}), {s['num_fragments']} fragments")
    return "\n".join(lines)


# ---- verify --------------------------------------------------------------------------------------------
def verify(path_or_uri: str | os.PathLike, tag: str | None = None) -> list[str]:
    """Every problem found in a committed checkpoint; an empty list means it is intact.

    Checks, per file in the manifest: present, its size, its XXH3 hash (streamed), its footer index, and each
    fragment's XXH3 hash and length; then that every parameter's master weights (and every state saved for it)
    and every whole tensor are covered exactly once.  A manifest that cannot be read raises CheckpointError.
    """
    ck = _open(path_or_uri, tag)
    storage, m = ck.storage, ck.manifest
    problems: list[str] = []
    covered: dict[tuple[str, str], list[tuple[int, int]]] = {}
    whole_files = True  # coverage is only worth checking when every file could be read
    if MANIFEST_HASH_KEY not in m:
        problems.append(f"{MANIFEST}: no {MANIFEST_HASH_KEY} (written by a rayzero before manifests were hashed): "
                        "its contents cannot be verified")
    problems += layout_problems(m)
    for r, info in enumerate(m["files"]):
        name = info["file"]
        path = storage.join(ck.tag, name)
        if not storage.exists(path):
            problems.append(f"{name}: missing")
            whole_files = False
            continue
        size = storage.file_size(path)
        if size != info["size"]:
            problems.append(f"{name}: size {size} bytes, the manifest says {info['size']} (truncated or replaced)")
        digest = xxh3_of(storage, path)
        if digest != info["xxh3"]:
            problems.append(f"{name}: file hash mismatch (file xxh3 {digest}, manifest {info['xxh3']})")
        try:
            ff = FragmentFile(name, storage.open_random_access(path))
        except CheckpointError as e:
            problems.append(f"{name}: {e}")
            whole_files = False
            continue
        problems += file_problems(m, r, ff)
        for i, entry in enumerate(ff.index):
            where = f"{name}: fragment {i} ({entry['param']}/{entry['state']} [{entry['start']}, {entry['end']}))"
            covered.setdefault((entry["param"], entry["state"]), []).append((entry["start"], entry["end"]))
            try:
                data = ff.read(i)
            except ChecksumError as e:
                problems.append(f"{where}: checksum mismatch" if "checksum mismatch" in str(e) else f"{where}: {e}")
                continue
            if data.numel() != entry["end"] - entry["start"]:
                n = entry["end"] - entry["start"]
                problems.append(f"{where}: holds {data.numel()} elements, its range has {n}")
    if whole_files:
        problems += coverage_problems(m, covered)
    return problems


# ---- export --------------------------------------------------------------------------------------------
def _export_format(out_path: str, fmt: str | None) -> str:
    if fmt is None:
        suffix = os.path.splitext(out_path)[1].lower()
        if suffix not in EXPORT_FORMATS:
            raise CheckpointError(
                f"cannot tell the export format from {out_path!r}: name it *.safetensors or *.pt/*.pth, or give the "
                "format (fmt='safetensors' or 'torch'; --format on the command line)"
            )
        fmt = EXPORT_FORMATS[suffix]
    if fmt not in ("safetensors", "torch"):
        raise CheckpointError(f"unknown export format {fmt!r}; use 'safetensors' or 'torch'")
    if fmt == "safetensors":
        try:
            import safetensors.torch  # noqa: F401
        except ImportError:
            raise CheckpointError(
                "exporting to safetensors needs the safetensors package: `pip install safetensors`, or export "
                "to a .pt file (a torch state dict)"
            ) from None
    return fmt


def _assemble(
    index: FragmentIndex, name: str, state: str, numel: int, shape: list[int], splits: list[dict] | None = None
) -> torch.Tensor:
    """One tensor from its fragments, in the dtype they were saved in (EP/TP slices put back in place)."""
    places = index.where.get((name, state), [])
    if places:
        file, i = places[0][0], places[0][1]
        saved_dtype = dtype_from_name(index.files[file].index[i]["dtype"])
    else:  # an empty tensor has no fragments
        saved_dtype = torch.float32
    flat = torch.empty(numel, dtype=saved_dtype)
    index.fill(name, state, 0, numel, flat)
    if splits:
        cuts = from_layout_dicts(splits)
        return canonical_to_full(flat, local_shape_of(shape, cuts), cuts)
    return flat.view(shape)


@torch.no_grad()
def export(
    path_or_uri: str | os.PathLike, out_path: str | os.PathLike, tag: str | None = None, fmt: str | None = None
) -> dict[str, Any]:
    """Write the consolidated weights under the model's own names, ready for ``model.load_state_dict``.

    Every parameter (under its name and each alias, so tied weights appear under every name) is assembled
    from its master-weight fragments, whatever world size saved them, one at a time, and cast to the
    parameter's dtype; buffers and frozen parameters ("whole" tensors) come as saved.  ``fmt`` is
    "safetensors" or "torch" (``torch.save`` of plain tensors), by default from ``out_path``'s suffix.
    Returns ``{"path", "tag", "tensors", "bytes"}``.
    """
    out_path = os.fspath(out_path)
    fmt = _export_format(out_path, fmt)
    ck = _open(path_or_uri, tag)
    m = ck.manifest
    index = FragmentIndex(ck.storage, ck.tag, m)
    tensors: dict[str, torch.Tensor] = {}
    nbytes = 0
    for p in m["params"]:
        t = _assemble(index, p["name"], STATE_MASTER, p["numel"], p["shape"], p.get("splits"))
        t = t.to(dtype_from_name(p["dtype"]))
        nbytes += t.numel() * t.element_size()
        tensors[p["name"]] = t
        for alias in p.get("aliases", []):
            # safetensors refuses tensors that share memory; a torch file stores a shared one once
            tensors[alias] = t.clone() if fmt == "safetensors" else t
    for w in m.get("whole", []):
        if not w.get("persistent", True):  # not part of the model's state_dict
            continue
        t = _assemble(index, w["name"], STATE_WHOLE, _numel(w["shape"]), w["shape"], w.get("splits"))
        t = t.to(dtype_from_name(w["dtype"]))
        nbytes += t.numel() * t.element_size()
        tensors[w["name"]] = t
        for alias in w.get("aliases", []):
            tensors[alias] = t.clone() if fmt == "safetensors" else t
    out_dir = os.path.dirname(os.path.abspath(out_path))
    os.makedirs(out_dir, exist_ok=True)
    tmp = f"{out_path}.tmp-{os.getpid()}"
    try:
        if fmt == "safetensors":
            from safetensors.torch import save_file

            save_file(tensors, tmp, metadata={"format": "pt", "rayzero.tag": ck.tag,
                                              "rayzero.step": str(m["global_steps"])})
        else:
            torch.save(tensors, tmp)
        os.replace(tmp, out_path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
    return {"path": out_path, "tag": ck.tag, "tensors": len(tensors), "bytes": nbytes}
