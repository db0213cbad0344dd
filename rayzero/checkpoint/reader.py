"""Reading a universal checkpoint's directory: which tag to load, its manifest, and where each fragment is
(``FragmentIndex``).  No engine: the engine's load (``engine_io.load``) and the ``rayzero ckpt`` tools
(``tools.py``) both read through it."""

from __future__ import annotations

import logging

import torch

from rayzero.checkpoint.format import (
    LATEST,
    MANIFEST,
    MANIFEST_HASH_KEY,
    STATE_MASTER,
    STATE_WHOLE,
    CheckpointError,
    ChecksumError,
    FragmentFile,
    parse_manifest,
    rank_file_name,
)
from rayzero.checkpoint.storage import Storage
from rayzero.checkpoint.writer import recover


def resolve_tag(storage: Storage, tag: str | None) -> str:
    if tag is not None:
        return tag
    latest = storage.join(LATEST)
    if not storage.exists(latest):
        raise CheckpointError(
            f"no checkpoint found in {storage.root!r}: there is no '{LATEST}' file (pass tag= to load a "
            "specific checkpoint directory)"
        )
    return storage.read_bytes(latest).decode().strip()


def read_manifest(storage: Storage, tag: str) -> dict:
    path = storage.join(tag, MANIFEST)
    if not storage.exists(path):
        recover(storage, tag)  # a crash inside a re-save of this tag: its complete copy goes back in place
    if not storage.exists(path):
        raise CheckpointError(
            f"{path} does not exist: checkpoint {tag!r} was never committed (or is not a rayzero checkpoint)"
        )
    manifest = parse_manifest(storage.read_bytes(path), path)
    if MANIFEST_HASH_KEY not in manifest:
        logging.getLogger("rayzero").warning(
            "%s has no %s (it was written by a rayzero before manifests were hashed): its contents cannot be "
            "verified; save the state again to get a checkpoint that can", path, MANIFEST_HASH_KEY)
    return manifest


def _numel(shape: list[int]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def numels(manifest: dict) -> dict[str, int]:
    """Element count of every tensor the manifest lists (parameters and whole tensors), by name."""
    out = {p["name"]: p["numel"] for p in manifest["params"]}
    out.update({w["name"]: _numel(w["shape"]) for w in manifest.get("whole", [])})
    return out


def layout_problems(manifest: dict) -> list[str]:
    """Where the manifest's file list disagrees with its world size (one file per saving rank, in order)."""
    files, world = manifest["files"], manifest["world_size"]
    problems = []
    if len(files) != world:
        problems.append(f"the manifest lists {len(files)} fragment files for world size {world}")
    for r, info in enumerate(files):
        if info.get("file") != rank_file_name(r):
            problems.append(f"the manifest's file {r} is {info.get('file')!r}, expected {rank_file_name(r)!r}")
    return problems


def file_problems(manifest: dict, r: int, ff: FragmentFile) -> list[str]:
    """Where rank file ``r`` (opened as ``ff``) disagrees with the manifest: its saving rank, world size, tag
    and step, its fragment count, and fragments of tensors the manifest does not list or past their end."""
    name, info = ff.name, manifest["files"][r]
    problems = []
    meta = ff.meta
    if meta is not None:  # files of checkpoints saved before rank files recorded it have none
        want = {"rank": r, "world_size": manifest["world_size"], "tag": manifest["tag"],
                "global_steps": manifest["global_steps"]}
        for key, value in want.items():
            if meta.get(key) != value:
                problems.append(f"{name}: saved with {key} {meta.get(key)!r}, the manifest says {value!r} (the file "
                                "belongs to another save)")
    if len(ff.index) != info["fragments"]:
        problems.append(f"{name}: holds {len(ff.index)} fragments, the manifest says {info['fragments']}")
    numel = numels(manifest)
    for i, e in enumerate(ff.index):
        where = f"{name}: fragment {i} ({e['param']}/{e['state']} [{e['start']}, {e['end']}))"
        if e["param"] not in numel:
            problems.append(f"{where}: not in the manifest's params or whole tables")
        elif not 0 <= e["start"] <= e["end"] <= numel[e["param"]]:
            problems.append(f"{where}: outside the tensor's {numel[e['param']]} elements")
    return problems


def coverage_problems(m: dict, covered: dict[tuple[str, str], list[tuple[int, int]]]) -> list[str]:
    """Each saved (param, state) covers [0, numel) exactly once; masters and whole tensors must be there."""
    problems = []
    numel = numels(m)
    required = [(p["name"], STATE_MASTER) for p in m["params"]] + [(w["name"], STATE_WHOLE) for w in m.get("whole", [])]
    for key in required:
        if key not in covered and numel[key[0]] > 0:
            problems.append(f"{key[0]}/{key[1]}: no fragment holds it")
    for (param, state), ranges in sorted(covered.items()):
        if param not in numel:
            continue  # file_problems names it
        pos = 0
        for start, end in sorted(ranges):
            if start != pos:
                what = "overlap" if start < pos else "gap"
                problems.append(f"{param}/{state}: {what} at element {min(start, pos)} (fragments [{start}, {end}))")
                break
            pos = end
        else:
            if pos != numel[param]:
                problems.append(f"{param}/{state}: fragments cover [0, {pos}) of {numel[param]} elements")
    return problems


def _refuse(tag: str, problems: list[str]) -> CheckpointError:
    shown = "; ".join(problems[:6]) + (f"; and {len(problems) - 6} more" if len(problems) > 6 else "")
    return CheckpointError(
        f"checkpoint {tag!r} is inconsistent: {shown}. Its parts disagree (files of different saves, or damage): "
        "restore it from a copy or load an earlier checkpoint (`rayzero ckpt verify` lists every problem)"
    )


class FragmentIndex:
    """Every saved fragment of a checkpoint, by (param, state); files are opened (footer only) lazily."""

    def __init__(self, storage: Storage, tag: str, manifest: dict):
        self.storage, self.tag = storage, tag
        self.files: dict[str, FragmentFile] = {}
        self.where: dict[tuple[str, str], list[tuple[str, int, int, int]]] = {}
        problems = layout_problems(manifest)
        if problems:
            raise _refuse(tag, problems)
        covered: dict[tuple[str, str], list[tuple[int, int]]] = {}
        for r, info in enumerate(manifest["files"]):
            path = storage.join(tag, info["file"])
            if not storage.exists(path):
                raise CheckpointError(f"checkpoint {tag!r} is missing its fragment file {info['file']}")
            size = storage.file_size(path)
            if size != info["size"]:
                raise ChecksumError(
                    f"{info['file']} in checkpoint {tag!r} is {size} bytes, the manifest says {info['size']}: "
                    "the file is truncated or was replaced"
                )
            ff = FragmentFile(info["file"], storage.open_random_access(path), path if storage.local else None)
            if info.get("meta_xxh3") is not None and ff.metadata_xxh3 != info["meta_xxh3"]:
                raise ChecksumError(
                    f"checksum mismatch in {info['file']} of checkpoint {tag!r}: its index (each fragment's tensor, "
                    f"range, dtype and hash) hashes to {ff.metadata_xxh3}, the manifest says {info['meta_xxh3']}; the "
                    "file is corrupt or was replaced: restore it or load an earlier checkpoint")
            if info.get("frame_xxh3") is not None and storage.local:
                # what a load reads besides the fragments' data: each fragment's hash covers its data
                frame = ff.frame_xxh3()
                if frame is not None and frame != info["frame_xxh3"]:
                    raise ChecksumError(
                        f"checksum mismatch in {info['file']} of checkpoint {tag!r}: its Arrow metadata (index, "
                        f"columns, footer) hashes to {frame}, the manifest says {info['frame_xxh3']}; the file is "
                        "corrupt or was replaced: restore it or load an earlier checkpoint")
            problems += file_problems(manifest, r, ff)
            self.files[info["file"]] = ff
            for i, entry in enumerate(ff.index):
                self.where.setdefault((entry["param"], entry["state"]), []).append(
                    (info["file"], i, entry["start"], entry["end"])
                )
                covered.setdefault((entry["param"], entry["state"]), []).append((entry["start"], entry["end"]))
        problems += coverage_problems(manifest, covered)
        if problems:
            raise _refuse(tag, problems)

    def fill(self, param: str, state: str, lo: int, hi: int, out: torch.Tensor) -> None:
        """Copy elements ``[lo, hi)`` of ``param``'s ``state`` into ``out`` from every overlapping fragment."""
        pieces = []
        for file, i, start, end in self.where.get((param, state), []):
            a, b = max(start, lo), min(end, hi)
            if a >= b:
                continue
            ff = self.files[file]
            # a whole fragment goes straight into its place (hashed as it is read); a part of one (another
            # world size or stage) is copied out of the verified fragment
            if not ((a, b) == (start, end) and ff.read_into(i, out[a - lo : b - lo])):
                out[a - lo : b - lo].copy_(ff.read(i)[a - start : b - start])
            pieces.append((a, b))
        # the pieces must tile [lo, hi) exactly: overlaps could otherwise hide a gap
        pieces.sort()
        covered, at = 0, lo
        for a, b in pieces:
            if a != at:
                break
            covered, at = covered + b - a, b
        if at != hi:
            raise CheckpointError(
                f"checkpoint {self.tag!r} covers {covered} of the {hi - lo} elements [{lo}, {hi}) of "
                f"{param!r}/{state}; it is incomplete"
            )
