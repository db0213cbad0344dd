"""Reading a universal checkpoint's directory: which tag to load, its manifest, and where each fragment is
(``FragmentIndex``).  No engine: the engine's load (``engine_io.load``) and the ``rayzero ckpt`` tools
(``tools.py``) both read through it."""

from __future__ import annotations

import torch

from rayzero.checkpoint.format import LATEST, MANIFEST, CheckpointError, FragmentFile, parse_manifest
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
    return parse_manifest(storage.read_bytes(path), path)


class FragmentIndex:
    """Every saved fragment of a checkpoint, by (param, state); files are opened (footer only) lazily."""

    def __init__(self, storage: Storage, tag: str, manifest: dict):
        self.storage, self.tag = storage, tag
        self.files: dict[str, FragmentFile] = {}
        self.where: dict[tuple[str, str], list[tuple[str, int, int, int]]] = {}
        for info in manifest["files"]:
            path = storage.join(tag, info["file"])
            if not storage.exists(path):
                raise CheckpointError(f"checkpoint {tag!r} is missing its fragment file {info['file']}")
            size = storage.file_size(path)
            if size != info["size"]:
                from rayzero.checkpoint.format import ChecksumError

                raise ChecksumError(
                    f"{info['file']} in checkpoint {tag!r} is {size} bytes, the manifest says {info['size']}: "
                    "the file is truncated or was replaced"
                )
            ff = FragmentFile(info["file"], storage.open_random_access(path), path if storage.local else None)
            self.files[info["file"]] = ff
            for i, entry in enumerate(ff.index):
                self.where.setdefault((entry["param"], entry["state"]), []).append(
                    (info["file"], i, entry["start"], entry["end"])
                )

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
