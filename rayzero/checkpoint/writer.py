"""Parallel, atomic saving: every rank writes its own fragment file; rank 0 commits.

Commit protocol (no collectives, so it can run on a background thread while training goes on):

1. Rank 0 prepares a staging directory ``<dir>/.tmp-<tag>`` (local storage) after ``recover()`` (below) and
   removes leftovers of crashed saves, never the only complete copy of a tag.  All ranks meet at a barrier
   (the caller does that on the main thread), then each rank:
2. writes ``rank_XXXXX.arrow`` under a temporary name, syncs it, renames it, and drops a small
   ``rank_XXXXX.done.json`` marker with its size, XXH3 hash and RNG state (or ``rank_XXXXX.error.json``);
3. rank 0 waits for every marker, writes ``manifest.json`` (synced, renamed into place), renames the
   staging directory to ``<dir>/<tag>`` (re-saving a tag: the old ``<tag>`` is renamed to ``.old-<tag>``
   first) and only then moves ``<dir>/latest`` to the new tag.  A replaced ``.old-<tag>`` is deleted on a
   background thread after the commit (freeing a large file's cached pages takes a while, and the save is
   already durable); the next save's ``prepare()`` and the engine's checkpoint wait points wait for it.

A crash at any moment leaves ``latest`` naming a complete checkpoint: the previous one, or, when the save
re-used the tag ``latest`` names, that tag's old or new copy.  A crash between the two renames of a re-save
leaves ``<tag>`` missing; ``recover()`` (run by ``prepare()`` and by readers that find ``<tag>`` missing)
renames the complete staging directory (one with its manifest) back to ``<tag>``, or else ``.old-<tag>``.
Incomplete staging directories are ignored by readers and removed by the next save.  On object stores (no
atomic directory rename) files go straight to ``<dir>/<tag>``: a directory without a manifest is
incomplete, and ``latest`` still moves last.

Testing hook: ``RAYZERO_CHECKPOINT_CRASH_AT=<point>`` (or ``<point>:<tag>``) makes ``commit()`` SIGKILL its
own process at that point (``crash_point`` calls: before_manifest, manifest_written, old_moved_aside,
new_in_place, before_latest, committed); with ``RAYZERO_CHECKPOINT_CRASH_ONCE=<file>`` only the process that
creates that file dies.  Unset, it costs one environment lookup per point.
"""
from __future__ import annotations

import json
import os
import signal
import threading
import time
from typing import Callable, ContextManager

import torch

from rayzero.checkpoint import direct_io
from rayzero.checkpoint.format import (
    LATEST,
    MANIFEST,
    CheckpointError,
    Fragment,
    StorageFullError,
    manifest_bytes,
    metadata_xxh3,
    rank_file_name,
    schema_metadata,
    write_fragments,
)
from rayzero.checkpoint.storage import HashingWriter, Storage

STAGING_PREFIX = ".tmp-"
OLD_PREFIX = ".old-"  # local re-save: the previous copy of the tag, until the new one is in place
CRASH_ENV = "RAYZERO_CHECKPOINT_CRASH_AT"  # testing hook, see the module docstring
CRASH_ONCE_ENV = "RAYZERO_CHECKPOINT_CRASH_ONCE"


def crash_point(point: str, tag: str) -> None:
    """Testing hook: SIGKILL this process at ``point`` when $RAYZERO_CHECKPOINT_CRASH_AT is ``point`` or
    ``point:tag``, and, with $RAYZERO_CHECKPOINT_CRASH_ONCE naming a file, only if that file can be created."""
    if os.environ.get(CRASH_ENV) in (point, f"{point}:{tag}"):
        once = os.environ.get(CRASH_ONCE_ENV)
        try:
            if once:
                os.close(os.open(once, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        except FileExistsError:
            return
        os.kill(os.getpid(), signal.SIGKILL)


def staging_dir(storage: Storage, tag: str) -> str:
    return storage.join(STAGING_PREFIX + tag) if storage.local else storage.join(tag)


INCOMPLETE = ".rayzero-incomplete"  # object stores: marks a checkpoint directory still being written


def _tag_of(leftover: str) -> str:
    return leftover[len(STAGING_PREFIX):]  # both prefixes are 5 characters


def _complete(storage: Storage, name: str) -> bool:
    return storage.exists(storage.join(name, MANIFEST))


def recover(storage: Storage, tag: str | None = None) -> None:
    """Local storage: put back ``<tag>`` (with no tag: every tag that has leftovers) where a crash inside a
    re-save left it missing, from its complete staging directory (the new copy) or else from ``.old-<tag>``
    (the old one).  Renames only, so concurrent callers are safe: one rename wins, the others fail on a
    missing source or a non-empty target and find ``<tag>`` in place."""
    if not storage.local:
        return
    tags = [tag] if tag is not None else sorted(
        {_tag_of(n) for n in storage.listdir(storage.root) if n.startswith((STAGING_PREFIX, OLD_PREFIX))})
    for t in tags:
        for prefix in (STAGING_PREFIX, OLD_PREFIX):
            if storage.exists(storage.join(t)):
                break
            if _complete(storage, prefix + t):
                try:
                    storage.move(storage.join(prefix + t), storage.join(t))
                except OSError:
                    pass


def clean_leftovers(storage: Storage) -> list[str]:
    """Remove what crashed saves left in ``storage`` (incomplete staging directories, replaced copies whose
    tag is in place, object-store directories still marked incomplete) after putting back any tag a crashed
    re-save left missing; returns the names removed.  No save may be in flight in ``storage``."""
    recover(storage)
    removed = []
    for name in storage.listdir(storage.root):
        if name.startswith((STAGING_PREFIX, OLD_PREFIX)):
            if not _complete(storage, name) or _complete(storage, _tag_of(name)):
                storage.delete_dir(storage.join(name))
                removed.append(name)
        elif not storage.local and storage.exists(storage.join(name, INCOMPLETE)):
            if not storage.exists(storage.join(name, MANIFEST)):
                storage.delete_dir(storage.join(name))
                removed.append(name)
    return removed


def prepare(storage: Storage, tag: str) -> None:
    """Rank 0, before the barrier: a clean staging directory, and no leftovers of crashed saves.

    Only directories rayzero itself marked as unfinished are ever removed, never other data, and never the
    only complete copy of a tag (``recover()`` puts such a copy back in place first)."""
    wait_discards()
    storage.makedirs(storage.root)
    clean_leftovers(storage)
    stage = staging_dir(storage, tag)
    if not storage.local and storage.exists(storage.join(tag, MANIFEST)):
        # An object store cannot swap a directory atomically: replacing the tag would delete the
        # committed checkpoint before the new one exists.
        raise CheckpointError(
            f"checkpoint {tag!r} already exists in {storage.root!r}; on object stores a committed checkpoint is "
            "never overwritten: save under a new tag (the default tag includes the step)"
        )
    if storage.local and _complete(storage, STAGING_PREFIX + tag) and not _complete(storage, tag):
        raise CheckpointError(f"{stage} is the only complete copy of checkpoint {tag!r} (its directory "
                              f"{storage.join(tag)} has no {MANIFEST}): move one of them away, then save again")
    storage.delete_dir(stage)
    storage.makedirs(stage)
    if not storage.local:
        storage.write_bytes_atomic(f"{stage}/{INCOMPLETE}", b"")


SPACE_HEADROOM = 1 << 20  # bytes a save leaves free beyond the checkpoint: the manifest, ``latest``, and the
# small records written beside it (Ray Train's run snapshot, the metrics lines) must still fit after it


def fragment_bytes(fragments: list[Fragment]) -> int:
    """The bytes of ``fragments``' data (a deferred NVMe sub-group's states are fp32)."""
    total = 0
    for f in fragments:
        t = f.tensor
        total += (f.end - f.start) * (t.element_size() if isinstance(t, torch.Tensor) else 4)
    return total


def volume_of(path: str) -> str:
    """The mount point of the volume holding ``path`` (its nearest existing ancestor)."""
    path = os.path.realpath(path)
    while not os.path.exists(path):
        path = os.path.dirname(path)
    while not os.path.ismount(path):
        path = os.path.dirname(path)
    return path


def check_space(storage: Storage, tag: str, nbytes: int) -> StorageFullError | None:
    """Local storage: the error to raise when the volume under ``storage`` has less free space than checkpoint
    ``tag`` needs (``nbytes`` of data, with ``SPACE_HEADROOM``), naming the volume, both numbers and the
    checkpoint ``latest`` still names; None when it fits (and always on object stores)."""
    if not storage.local:
        return None
    st = os.statvfs(storage.root)
    free = st.f_bavail * st.f_frsize
    need = nbytes + SPACE_HEADROOM
    if need <= free:
        return None
    try:
        kept = storage.read_bytes(storage.join(LATEST)).decode().strip()
    except (OSError, UnicodeDecodeError):
        kept = ""
    last = (f"the last checkpoint kept is {kept!r} ({storage.join(kept)}), intact" if kept else
            "no earlier checkpoint is kept in it")
    return StorageFullError(
        f"not enough free space for checkpoint {tag!r} in {storage.root}: the volume {volume_of(storage.root)} has "
        f"{free:,} bytes free and the checkpoint needs {need:,} ({nbytes:,} bytes of data and {SPACE_HEADROOM:,} "
        f"of headroom). Nothing was written; {last}. Free space on that volume (or choose other storage) and run "
        "again: a run resumes from its last checkpoint"
    )


PROBE_PREFIX = ".probe-"  # a rank's probe file in the staging directory, while the first save checks the storage


def _probe(storage: Storage, stage: str, rank: int) -> str:
    name = f"{PROBE_PREFIX}{rank_file_name(rank)[: -len('.arrow')]}"
    return f"{stage}/{name}" if not storage.local else os.path.join(stage, name)


def check_shared(storage: Storage, tag: str, rank: int, world: int, all_gather: Callable[[object], list]) -> None:
    """Every rank, at its first save to ``storage``, after rank 0 made the staging directory of ``tag``: each
    writes a small probe file there, and each checks that it sees every rank's probe.  Storage that each rank
    has its own of (a local path on separate nodes, per-rank directories) fails here within seconds, on every
    rank with the same CheckpointError naming each rank's path and host, instead of rank 0 waiting for rank
    files it can never see.  ``all_gather(obj)`` returns every rank's ``obj`` (a collective, so a barrier)."""
    import socket

    host, stage = socket.gethostname(), staging_dir(storage, tag)
    wrote = None
    try:
        if storage.local and not os.path.isdir(stage):  # never made here: rank 0 made it on its own storage
            raise FileNotFoundError(f"the staging directory {stage} does not exist for this rank")
        storage.write_bytes_atomic(_probe(storage, stage, rank), json.dumps({"rank": rank, "host": host}).encode(),
                                   durable=False)
    except OSError as e:
        wrote = f"{type(e).__name__}: {e}"
    all_gather(None)  # every probe is written before any rank looks
    missing = [r for r in range(world) if not (r == rank and wrote) and not storage.exists(_probe(storage, stage, r))]
    views = all_gather({"rank": rank, "host": host, "path": storage.root, "missing": missing, "error": wrote})
    if wrote is None:  # after every rank looked, before this rank's file (so before the commit)
        try:
            storage.fs.delete_file(_probe(storage, stage, rank))
        except OSError:
            pass
    if not any(v["missing"] or v["error"] for v in views):
        return
    if rank == 0:
        abort(storage, tag)
    lines = []
    for v in views:
        what = f"rank {v['rank']} (host {v['host']}) saves to {v['path']!r}"
        if v["error"]:
            what += f" and could not write there ({v['error']})"
        if v["missing"]:
            what += f" and does not see the files of rank{'s' if len(v['missing']) > 1 else ''} " \
                    f"{', '.join(map(str, v['missing']))}"
        lines.append(what)
    raise CheckpointError(
        "the checkpoint storage is not shared by all ranks: " + "; ".join(lines) + ". Every rank writes its own "
        "part of a checkpoint into the same directory, so checkpoints need storage every rank shares: a shared "
        "filesystem mounted at the same path on every node, or an object store URI (s3://, gs://, ...)"
    )


def write_rank(storage: Storage, stage: str, rank: int, fragments: list[Fragment], extra: dict,
               open_group: Callable[[int], ContextManager] | None = None, meta: dict | None = None) -> None:
    """Write this rank's fragment file and its done marker (or an error marker, then re-raise).
    ``open_group`` makes a deferred fragment's group resident (``format.write_fragments``); ``meta`` (rank,
    world size, tag, step) is recorded in the file's schema."""
    final = f"{stage}/{rank_file_name(rank)}" if not storage.local else os.path.join(stage, rank_file_name(rank))
    try:
        tmp = final + ".partial"
        if storage.local and direct_io.enabled(stage):
            sink = HashingWriter(direct_io.DirectFile(tmp))  # the file syncs itself at close
        elif storage.local:
            raw = open(tmp, "wb")
            sink = HashingWriter(raw, local_file=raw)
        else:
            sink = HashingWriter(storage.open_output(final))
        import pyarrow as pa

        try:
            with pa.PythonFile(sink, mode="w") as out:
                index = write_fragments(out, fragments, open_group, meta, sink.expect_data)
            sink.close()
        except BaseException:
            sink.abandon()
            raise
        if storage.local:
            os.replace(tmp, final)
        marker = {"file": rank_file_name(rank), "size": sink.size, "xxh3": sink.hasher.hexdigest(),
                  "fragments": len(index)}
        # the hash of what a load reads besides the fragments' data (each fragment's own hash covers that),
        # taken as the file was written; recorded only where every fragment's data was told apart
        if sink.data_skipped == sum(1 for e in index if e["end"] > e["start"]):
            marker["frame_xxh3"] = sink.frame.hexdigest()
        # the index and the saving rank's record, which every load checks on any storage (format.metadata_xxh3)
        marker["meta_xxh3"] = metadata_xxh3(schema_metadata(index, meta))
        marker.update(extra)
        # The marker only tells rank 0 this file is complete; the manifest (fsynced) is what commits.
        storage.write_bytes_atomic(f"{final[: -len('.arrow')]}.done.json", json.dumps(marker).encode(), durable=False)
    except BaseException as e:
        try:
            storage.write_bytes_atomic(
                f"{final[: -len('.arrow')]}.error.json", json.dumps({"rank": rank, "error": repr(e)}).encode()
            )
        except BaseException:
            pass
        raise


def commit(
    storage: Storage,
    tag: str,
    world: int,
    manifest_of: Callable[[list[dict]], dict],
    timeout_s: float = 1800.0,
) -> None:
    """Rank 0: wait for every rank's marker, write the manifest, publish the directory, move ``latest``."""
    stage = staging_dir(storage, tag)
    sep = "/" if not storage.local else os.sep
    deadline = time.monotonic() + timeout_s
    markers: list[dict | None] = [None] * world
    while True:
        for r in range(world):
            if markers[r] is not None:
                continue
            base = f"{stage}{sep}{rank_file_name(r)[: -len('.arrow')]}"
            if storage.exists(base + ".error.json"):
                err = json.loads(storage.read_bytes(base + ".error.json"))
                abort(storage, tag)
                raise CheckpointError(f"rank {r} failed to write its part of checkpoint {tag!r}: {err['error']}")
            if storage.exists(base + ".done.json"):
                markers[r] = json.loads(storage.read_bytes(base + ".done.json"))
        if all(m is not None for m in markers):
            break
        if time.monotonic() > deadline:
            abort(storage, tag)
            missing = [r for r, m in enumerate(markers) if m is None]
            raise CheckpointError(f"checkpoint {tag!r}: ranks {missing} did not finish writing within {timeout_s}s")
        time.sleep(0.01)
    manifest = manifest_of(markers)
    for r in range(world):  # before the manifest: a complete directory holds no markers
        base = f"{stage}{sep}{rank_file_name(r)[: -len('.arrow')]}"
        storage.fs.delete_file(base + ".done.json")
    crash_point("before_manifest", tag)
    storage.write_bytes_atomic(f"{stage}{sep}{MANIFEST}", manifest_bytes(manifest))
    if not storage.local:
        storage.fs.delete_file(f"{stage}/{INCOMPLETE}")
    crash_point("manifest_written", tag)
    old = None
    if storage.local:
        final = storage.join(tag)
        if storage.exists(final):  # re-saving a tag: move the old one aside, then drop it after the switch
            old = storage.join(OLD_PREFIX + tag)
            storage.move(final, old)
            crash_point("old_moved_aside", tag)
            _publish(storage, stage, final)
            crash_point("new_in_place", tag)
        else:
            _publish(storage, stage, final)
    crash_point("before_latest", tag)
    storage.write_bytes_atomic(storage.join(LATEST), tag.encode())
    crash_point("committed", tag)
    if old is not None:
        discard_later(storage, old)


_discards: list[threading.Thread] = []


def discard_later(storage: Storage, path: str) -> None:
    """Delete ``path`` (a replaced copy, no longer named by anything) on a background thread."""
    t = threading.Thread(target=_discard, args=(storage, path), name="rayzero-checkpoint-discard", daemon=True)
    t.start()
    _discards.append(t)


def _discard(storage: Storage, path: str) -> None:
    try:
        storage.delete_dir(path)
    except OSError:
        pass  # what is left is removed by the next save's prepare()


def wait_discards() -> None:
    """Wait until every replaced copy this process started deleting is gone."""
    while _discards:
        _discards.pop(0).join()


def _publish(storage: Storage, stage: str, final: str) -> None:
    """Rename the complete staging directory to the tag; a reader's ``recover()`` may have done it already."""
    try:
        storage.move(stage, final)
    except OSError:
        if storage.exists(stage) or not storage.exists(os.path.join(final, MANIFEST)):
            raise


def abort(storage: Storage, tag: str) -> None:
    if storage.local:
        try:
            storage.delete_dir(staging_dir(storage, tag))
        except OSError:
            pass


class BackgroundSave:
    """One save in flight on a background thread; ``wait()`` re-raises its failure on the caller."""

    def __init__(self, work: Callable[[], None]):
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, args=(work,), name="rayzero-checkpoint", daemon=False)
        self.thread.start()

    def _run(self, work: Callable[[], None]) -> None:
        try:
            work()
        except BaseException as e:  # surfaced by wait()
            self.error = e

    def wait(self) -> BaseException | None:
        self.thread.join()
        return self.error
