"""``keep_checkpoints`` under ``fit``: checkpoint folders that no record holds are deleted.

Ray Train keeps ``keep_checkpoints`` of the checkpoints reported to it (``CheckpointConfig(num_to_keep)``)
and records them in ``checkpoint_manager_snapshot.json``; it deletes a checkpoint after writing the record
without it, so a process that dies in between leaves that folder in no record, and so does a checkpoint
committed by a worker that died before reporting it once a later one is recorded.  Ray never deletes those.
When a worker group (re)starts, rank 0 calls :func:`prune` after loading its checkpoint: what crashed saves
left (``writer.clean_leftovers``), and every committed ``checkpoint_step*`` folder older than both Ray's
newest recorded checkpoint and the one being resumed from that Ray's record does not hold.  Newer ones are
never deleted (Ray may not have recorded them yet; the worker resumes from the newest), nor the one being
resumed from, nor anything while Ray's record cannot be read.
"""

from __future__ import annotations

import json
import logging

from rayzero.checkpoint.storage import Storage
from rayzero.checkpoint.writer import clean_leftovers
from rayzero.train.resume import SNAPSHOT  # Ray Train's record of the run's checkpoints

logger = logging.getLogger("rayzero")


def recorded(storage: Storage) -> set[str] | None:
    """The checkpoint folder names Ray Train's record of the run holds (an empty set: no record yet), or None
    where the record cannot be read (then nothing may be deleted)."""
    path = storage.join(SNAPSHOT)
    if not storage.exists(path):
        return set()
    try:
        state = json.loads(storage.read_bytes(path).decode())
    except (OSError, ValueError):
        return None
    if not isinstance(state, dict):
        return None
    names = set()
    entries = list(state.get("checkpoint_results") or []) + list(state.get("pending_training_results") or [])
    entries.append(state.get("latest_checkpoint_result"))
    for entry in entries:
        if isinstance(entry, dict) and isinstance(entry.get("checkpoint_dir_name"), str):
            names.add(entry["checkpoint_dir_name"])
    return names


def prune(storage: Storage, resumed_from: str | None) -> list[str]:
    """Rank 0, when the worker group starts, before any save: delete what crashed saves left and the committed
    checkpoints in no record (see the module docstring); returns the names deleted."""
    from rayzero.train.worker import TAG_PATTERN

    removed = clean_leftovers(storage)
    names = recorded(storage)
    if names is None:
        logger.warning("rayzero: %s is unreadable; no old checkpoint folders were deleted", storage.join(SNAPSHOT))
        return removed
    steps = [int(m.group(1)) for n in names | {resumed_from or ""} if (m := TAG_PATTERN.fullmatch(n))]
    if not steps:
        return removed
    newest = max(steps)
    for name in storage.listdir(storage.root):
        m = TAG_PATTERN.fullmatch(name)
        if m and int(m.group(1)) < newest and name not in names and name != resumed_from:
            storage.delete_dir(storage.join(name))
            removed.append(name)
    if removed:
        logger.info("rayzero: removed checkpoint folders no record holds: %s", removed)
    return removed
