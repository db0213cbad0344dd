"""The universal checkpoint format (version 1).  docs/checkpoint_format.md describes it for readers.

A checkpoint is a directory::

    manifest.json            written last: what was saved, by whom, an XXH3 hash per fragment file (of the whole
                             file, and of its bytes outside the fragments' data), and its own hash
    rank_00000.arrow         Arrow IPC file: the fragments rank 0 owned
    rank_00001.arrow         ...

Each fragment file holds one record batch per fragment, one row each, with the columns
``param`` (the model's parameter name), ``state`` ("fp32" for the master weights, "whole" for module
buffers and frozen parameters, saved whole by rank 0, or an optimizer state name such as "exp_avg"), ``start``/``end`` (the element range of the
flattened parameter), ``dtype`` (torch dtype name), ``xxh3`` (the 64-bit XXH3 hash of the data bytes) and ``data`` (the raw
little-endian bytes; bf16 as its 16-bit patterns).  The schema metadata key ``rayzero.index`` lists the
same (param, state, start, end, dtype, xxh3) per batch, so a reader finds a fragment from the file
footer alone and reads only that batch: memory-mapped locally, as ranged reads on object stores.
"""

from __future__ import annotations

import contextlib
import json
import os
import warnings
from dataclasses import dataclass
from typing import Callable, ContextManager, Iterator

import numpy as np
import pyarrow as pa
import torch
import xxhash

FORMAT_NAME = "rayzero-universal-checkpoint"
FORMAT_VERSION = 1
MANIFEST = "manifest.json"
LATEST = "latest"
INDEX_KEY = b"rayzero.index"
RANK_KEY = b"rayzero.rank"  # schema metadata: {"rank", "world_size", "tag", "global_steps"} of the save
MANIFEST_HASH_KEY = "manifest_xxh3"  # the manifest's own hash: its last key (see manifest_bytes)
_HASH_FIELD = b'"manifest_xxh3": "'
_HASH_BLANK = b"0" * 16
# every key a manifest of format version 1 may have; a manifest without its own hash (written before rayzero
# hashed it) that has any other key is damaged (an edited key name) and is refused
MANIFEST_KEYS = frozenset({
    "format", "version", "tag", "created_unix", "world_size", "stage", "topology", "compute_dtype", "params",
    "whole", "optimizer", "scheduler", "loss_scaler", "global_steps", "micro_steps", "skipped_steps",
    "global_samples", "batch", "config", "client_state", "rng", "files", MANIFEST_HASH_KEY,
})
STATE_MASTER = "fp32"
STATE_WHOLE = "whole"  # buffers and frozen parameters, saved whole by rank 0

SCHEMA = pa.schema(
    [
        ("param", pa.string()),
        ("state", pa.string()),
        ("start", pa.int64()),
        ("end", pa.int64()),
        ("dtype", pa.string()),
        ("xxh3", pa.uint64()),
        ("data", pa.large_binary()),
    ]
)


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be used as asked; the message names the file and the fix."""


class ChecksumError(CheckpointError):
    pass


class StorageFullError(CheckpointError):
    """The checkpoint volume has less free space than a save needs; nothing was written.  A retry of the run
    would meet it again at the same save, so ``rayzero.fit`` ends the run at once (``rayzero.train.failures``)."""


def rank_file_name(rank: int) -> str:
    return f"rank_{rank:05d}.arrow"


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def dtype_from_name(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise CheckpointError(f"unknown dtype {name!r} in checkpoint")
    return dtype


@dataclass(frozen=True)
class Deferred:
    """A fragment's data that is only in memory while its ``group`` is made resident (the optimizer's
    sub-groups under NVMe offload): ``get()`` returns the 1-D CPU tensor then."""

    group: int
    get: Callable[[], torch.Tensor]


@dataclass(frozen=True)
class Fragment:
    """Elements ``[start, end)`` of the flattened parameter ``param``'s state ``state``."""

    param: str
    state: str
    start: int
    end: int
    tensor: torch.Tensor | Deferred  # 1-D, contiguous, on the CPU, ``end - start`` elements


def _raw_bytes(t: torch.Tensor) -> np.ndarray:
    return t.contiguous().view(torch.uint8).numpy()


def _tensors(fragments: list[Fragment], open_group: Callable[[int], ContextManager] | None
             ) -> Iterator[tuple[Fragment, torch.Tensor]]:
    """Each fragment with its tensor; a deferred one's group is made resident (``open_group``) for the run
    of consecutive fragments it has, so one group at a time is in memory."""
    with contextlib.ExitStack() as stack:
        current = None
        for f in fragments:
            t = f.tensor
            if isinstance(t, Deferred):
                if t.group != current:
                    stack.close()
                    if open_group is None:
                        raise ValueError("a deferred fragment needs open_group to make its group resident")
                    stack.enter_context(open_group(t.group))
                    current = t.group
                t = t.get()
            elif current is not None:
                stack.close()
                current = None
            yield f, t


def write_fragments(sink, fragments: list[Fragment], open_group: Callable[[int], ContextManager] | None = None,
                    meta: dict | None = None, before_batch: Callable[[int], None] | None = None) -> list[dict]:
    """Write one record batch per fragment into ``sink`` (a pyarrow-compatible output); return the index.

    The index (with every fragment's hash) goes into the schema, which comes first in the file, so deferred
    fragments are brought in twice, one group at a time: once to hash them, once to write them (and their
    hash is checked again then: nothing may change them in between).  ``meta`` (the saving rank, world size,
    tag and step) goes into the schema too, so a load can tell a rank file of another save.
    ``before_batch(nbytes)`` is told each fragment's data size before its batch is written."""
    index = []
    raws: list[np.ndarray | None] = []
    with contextlib.closing(_tensors(fragments, open_group)) as items:  # closed (group released) on errors too
        for f, t in items:
            _hash_into(index, raws, f, t)
    metadata = schema_metadata(index, meta)
    schema = SCHEMA.with_metadata(metadata)
    with pa.ipc.new_file(sink, schema) as writer, contextlib.closing(_tensors(fragments, open_group)) as items:
        for entry, raw, (f, t) in zip(index, raws, items):
            if raw is None:
                raw = _raw_bytes(t)
                if xxhash.xxh3_64_intdigest(raw) != entry["xxh3"]:
                    raise CheckpointError(f"{f.param}/{f.state} [{f.start}, {f.end}) changed while it was being saved")
            if before_batch is not None:
                before_batch(raw.nbytes)
            writer.write_batch(_batch(schema, entry, raw))
    return index


def schema_metadata(index: list[dict], meta: dict | None) -> dict[bytes, bytes]:
    """A fragment file's schema metadata: its index and (``meta``) who saved it."""
    metadata = {INDEX_KEY: json.dumps(index, separators=(",", ":")).encode()}
    if meta is not None:
        metadata[RANK_KEY] = json.dumps(meta, separators=(",", ":")).encode()
    return metadata


def metadata_xxh3(metadata: dict[bytes, bytes]) -> str:
    """XXH3 (hex) of the schema metadata that decides what a load restores from a fragment file: the index
    (each fragment's tensor, state, range, dtype and data hash) and the saving rank's record.  The manifest
    keeps it per file (``meta_xxh3``), and every load compares it on any storage: the metadata is read anyway,
    so an edit of a fragment's dtype or range, which its data hash cannot see, is found without reading more."""
    digest = xxhash.xxh3_64()
    digest.update(metadata.get(INDEX_KEY, b""))
    digest.update(b"\0")
    digest.update(metadata.get(RANK_KEY, b""))
    return digest.hexdigest()


def _hash_into(index: list[dict], raws: list, f: Fragment, t: torch.Tensor) -> None:
    raw = _raw_bytes(t)
    raws.append(None if isinstance(f.tensor, Deferred) else raw)  # a deferred one is not kept
    index.append({"param": f.param, "state": f.state, "start": f.start, "end": f.end, "dtype": dtype_name(t.dtype),
                  "xxh3": xxhash.xxh3_64_intdigest(raw)})


def _batch(schema: pa.Schema, entry: dict, raw: np.ndarray) -> pa.RecordBatch:
    data_buf = pa.py_buffer(raw)  # zero-copy view of the tensor's bytes
    offsets = pa.py_buffer(np.array([0, raw.nbytes], dtype=np.int64))
    data = pa.LargeBinaryArray.from_buffers(pa.large_binary(), 1, [None, offsets, data_buf])
    return pa.record_batch(
        [
            pa.array([entry["param"]], pa.string()),
            pa.array([entry["state"]], pa.string()),
            pa.array([entry["start"]], pa.int64()),
            pa.array([entry["end"]], pa.int64()),
            pa.array([entry["dtype"]], pa.string()),
            pa.array([entry["xxh3"]], pa.uint64()),
            data,
        ],
        schema=schema,
    )


# direct reads go in pieces this large: each is hashed while it is still in the CPU's cache
READ_PIECE = 2 << 20
# and each read asks the kernel to fetch this much past the fragment too
READ_AHEAD = 16 << 20


_ENTRY_TYPES = {"param": str, "state": str, "start": int, "end": int, "dtype": str, "xxh3": int}


def _entry_ok(e) -> bool:
    return (isinstance(e, dict) and all(isinstance(e.get(k), t) and not isinstance(e.get(k), bool)
                                        for k, t in _ENTRY_TYPES.items())
            and isinstance(getattr(torch, e["dtype"], None), torch.dtype))


class FragmentFile:
    """Random access to one rank's fragment file; reads a fragment's bytes only when asked.

    ``path``: the file on local disk (with ``source`` its memory map).  Then :meth:`read_into` reads a
    fragment with ``pread`` straight into the tensor it belongs in, hashing each piece as it arrives,
    instead of copying it out of the map after a separate hashing pass."""

    def __init__(self, name: str, source, path: str | None = None):
        self.name = name
        self.source, self.path = source, path
        self._base: int | None = None  # address of the map's first byte
        try:
            self.reader = pa.ipc.open_file(source)
            meta = self.reader.schema.metadata or {}
            self.index = json.loads(meta[INDEX_KEY])
            self.meta = json.loads(meta[RANK_KEY]) if RANK_KEY in meta else None
            self.metadata_xxh3 = metadata_xxh3(meta)
        except (pa.ArrowException, KeyError, ValueError, TypeError, OSError) as e:
            raise ChecksumError(
                f"fragment file {name} is corrupt or truncated ({e}); restore it from a copy or load an "
                "earlier checkpoint"
            ) from None
        if not self.reader.schema.remove_metadata().equals(SCHEMA):
            raise ChecksumError(f"fragment file {name}: its schema is not a rayzero fragment file's "
                                f"({self.reader.schema.remove_metadata()}); the file is corrupt: restore it or load "
                                "an earlier checkpoint")
        if not isinstance(self.index, list) or not all(_entry_ok(e) for e in self.index):
            raise ChecksumError(f"fragment file {name}: its index (schema metadata {INDEX_KEY.decode()}) is malformed; "
                                "the file is corrupt: restore it or load an earlier checkpoint")
        if len(self.index) != self.reader.num_record_batches:
            raise ChecksumError(f"fragment file {name}: index lists {len(self.index)} fragments, file holds "
                                f"{self.reader.num_record_batches}; the file is corrupt")

    def _data(self, i: int):
        """Fragment ``i``'s data buffer and the byte range of its bytes in it (metadata only: no data read)."""
        try:
            column = self.reader.get_batch(i).column("data")
            _, offsets, data = column.buffers()
            lo, hi = np.frombuffer(offsets, dtype=np.int64)[:2]
        except (pa.ArrowException, OSError, ValueError, KeyError, TypeError) as e:
            raise ChecksumError(f"fragment file {self.name}: fragment {i} unreadable ({e})") from None
        return data, int(lo), int(hi)

    def _corrupt(self, entry: dict) -> "ChecksumError":
        return ChecksumError(
            f"checksum mismatch in {self.name}: fragment {entry['param']}/{entry['state']} "
            f"[{entry['start']}, {entry['end']}) is corrupt; restore the file or load an earlier checkpoint"
        )

    def read(self, i: int) -> torch.Tensor:
        entry = self.index[i]
        data, lo, hi = self._data(i)
        raw = np.frombuffer(data, dtype=np.uint8)[lo:hi]
        if xxhash.xxh3_64_intdigest(raw) != entry["xxh3"]:
            raise self._corrupt(entry)
        dtype = dtype_from_name(entry["dtype"])
        if raw.nbytes == 0:
            return torch.empty(0, dtype=dtype)
        with warnings.catch_warnings():  # a read-only mmap: the tensor is only ever copied from
            warnings.simplefilter("ignore", UserWarning)
            t = torch.frombuffer(raw, dtype=torch.uint8)
        return t.view(dtype)

    def read_into(self, i: int, out: torch.Tensor) -> bool:
        """Read all of fragment ``i`` into ``out`` (a contiguous host tensor of its dtype and length) with
        ``pread``, verifying its hash piece by piece as it reads; False where that cannot be done (not a
        local file, another dtype or device), and the caller copies through :meth:`read` instead.  On a
        hash mismatch ``out`` holds the corrupt bytes and ChecksumError is raised."""
        entry = self.index[i]
        if (self.path is None or out.device.type != "cpu" or not out.is_contiguous()
                or out.dtype != dtype_from_name(entry["dtype"]) or out.numel() != entry["end"] - entry["start"]):
            return False
        data, lo, hi = self._data(i)
        nbytes = hi - lo
        if nbytes != out.numel() * out.element_size():
            raise ChecksumError(f"fragment file {self.name}: fragment {i} holds {nbytes} bytes, its index says "
                                f"{out.numel()} elements of {entry['dtype']}; the file is corrupt")
        if self._base is None:
            self._base = self._map_address()
            if self._base is None:
                self.path = None
                return False
        offset = data.address - self._base + lo
        if nbytes == 0:
            if xxhash.xxh3_64_intdigest(b"") != entry["xxh3"]:
                raise self._corrupt(entry)
            return True
        view = memoryview(out.detach().view(torch.uint8).numpy())
        digest = xxhash.xxh3_64()
        fd = os.open(self.path, os.O_RDONLY)
        try:
            # start the disk reading ahead of us: this fragment and the next bytes of the file (a load reads
            # fragments in the order they were saved, so a cold read never waits between two of them)
            os.posix_fadvise(fd, offset, nbytes + READ_AHEAD, os.POSIX_FADV_WILLNEED)
            at = 0
            while at < nbytes:
                piece = view[at : min(at + READ_PIECE, nbytes)]
                got = os.preadv(fd, [piece], offset + at)
                if got <= 0:
                    raise ChecksumError(f"fragment file {self.name}: fragment {i} ends early (at byte "
                                        f"{offset + at}); the file is truncated")
                digest.update(piece[:got])
                at += got
        finally:
            os.close(fd)
        if digest.intdigest() != entry["xxh3"]:
            raise self._corrupt(entry)
        return True

    def frame_xxh3(self) -> str | None:
        """The XXH3 hash (hex) of every byte of the file outside the fragments' data: the Arrow metadata,
        the other columns, padding and footer, in file order.  With each fragment's own hash (checked as it
        is read) it covers every byte of the file without reading the data twice.  None where the file is
        not a local memory map."""
        base = self._map_address()
        if base is None:
            return None
        ranges = []
        for i in range(len(self.index)):
            data, lo, hi = self._data(i)
            if hi > lo:  # an empty fragment has no bytes of its own (and its buffer may lie anywhere)
                at = data.address - base + lo
                ranges.append((at, at + hi - lo))
        size = self.source.size()
        whole = np.frombuffer(_mapped(self.source, size), dtype=np.uint8)
        digest = xxhash.xxh3_64()
        at = 0
        for a, b in sorted(ranges):
            if a < at or b > size:
                raise ChecksumError(f"fragment file {self.name}: fragment data overlaps or lies past the end "
                                    f"(bytes [{a}, {b}) of {size}); the file is corrupt")
            digest.update(whole[at:a])
            at = b
        digest.update(whole[at:size])
        return digest.hexdigest()

    def _map_address(self) -> int | None:
        """The address of the memory map's first byte (None: the source is not a memory map)."""
        source = self.source
        if not isinstance(source, pa.MemoryMappedFile):
            return None
        at = source.tell()
        try:
            source.seek(0)
            return source.read_buffer(1).address
        finally:
            source.seek(at)


def _mapped(source, size: int):
    """The whole memory-mapped file as one buffer (no copy)."""
    at = source.tell()
    try:
        source.seek(0)
        return source.read_buffer(size)
    finally:
        source.seek(at)


def manifest_bytes(manifest: dict) -> bytes:
    """The manifest as written: JSON (indent 1) whose last key, ``manifest_xxh3``, is the XXH3 hash (16 hex
    digits) of these very bytes with that value's digits written as zeros.  So every byte of the file but
    the 16 digits is hashed, and those digits are the hash: any edit of any byte is found."""
    body = {k: v for k, v in manifest.items() if k != MANIFEST_HASH_KEY}
    data = json.dumps({**body, MANIFEST_HASH_KEY: _HASH_BLANK.decode()}, indent=1).encode()
    at = data.rindex(_HASH_FIELD) + len(_HASH_FIELD)
    return data[:at] + xxhash.xxh3_64_hexdigest(data).encode() + data[at + len(_HASH_BLANK):]


def manifest_digest_problem(data: bytes) -> str | None:
    """Why the manifest bytes ``data`` fail their own hash, or None when they match (or have no
    ``manifest_xxh3`` field at all: a manifest of a rayzero that did not hash it, see parse_manifest).  Runs
    before the JSON is parsed: a damaged manifest is refused without parsing it."""
    at = data.rfind(_HASH_FIELD)
    if at < 0:
        return None
    at += len(_HASH_FIELD)
    stored = data[at : at + len(_HASH_BLANK)]
    actual = xxhash.xxh3_64_hexdigest(data[:at] + _HASH_BLANK + data[at + len(_HASH_BLANK):])
    if actual.encode() != stored:
        return f"checksum mismatch (the file hashes to {actual}, it records {stored.decode('ascii', 'replace')})"
    return None


def parse_manifest(data: bytes, where: str) -> dict:
    problem = manifest_digest_problem(data)
    if problem is not None:
        raise ChecksumError(
            f"{where}: {problem}: the manifest was edited or damaged after the save, so the state it describes "
            "cannot be trusted; restore it from a copy or load an earlier checkpoint"
        )
    try:
        manifest = json.loads(data)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(
            f"{where} is unreadable ({e.__class__.__name__}: {e}): the manifest is truncated or corrupt, so this "
            "checkpoint is incomplete; load an earlier one (a checkpoint without a valid manifest was never "
            "committed)"
        ) from None
    if not isinstance(manifest, dict):
        raise CheckpointError(f"{where} is not a JSON object: the manifest is corrupt; load an earlier checkpoint")
    if MANIFEST_HASH_KEY in manifest:
        # the bytes matched the hash they record: that field must be the top-level one the JSON holds
        at, value = data.rfind(_HASH_FIELD) + len(_HASH_FIELD), manifest[MANIFEST_HASH_KEY]
        if at < len(_HASH_FIELD) or not isinstance(value, str) or data[at : at + len(_HASH_BLANK)] != value.encode():
            raise ChecksumError(f"{where}: its {MANIFEST_HASH_KEY} field is damaged; restore the manifest or load an "
                                "earlier checkpoint")
    else:
        unknown = sorted(set(manifest) - MANIFEST_KEYS)
        if unknown:
            raise CheckpointError(
                f"{where} has keys this rayzero does not know ({unknown}) and no {MANIFEST_HASH_KEY}: the manifest "
                "is damaged (or was written by a newer rayzero); restore it or load an earlier checkpoint"
            )
    if manifest.get("format") != FORMAT_NAME:
        raise CheckpointError(f"{where} is not a rayzero checkpoint manifest (format={manifest.get('format')!r})")
    if manifest.get("version") != FORMAT_VERSION:
        raise CheckpointError(
            f"{where} has format version {manifest.get('version')}; this rayzero reads version {FORMAT_VERSION}"
        )
    return manifest
