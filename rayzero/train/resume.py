"""The driver's side of resuming a ``rayzero.fit`` run: pick the checkpoint, and make Ray Train's record agree.

Before the workers start, ``prepare_resume`` looks at the run directory as it is on storage:

* the checkpoint to resume from is ``ClusterConfig(resume_from=...)`` when given (it must exist and verify),
  else the newest committed checkpoint (one with its manifest) that passes ``rayzero.checkpoint.tools.verify``;
  each newer one that fails is skipped with a warning naming it and its first problems;
* checkpoints newer than that one are set aside, so that no worker loads them (``worker._newer_commit``) and
  no later save collides with them: on local storage renamed to ``.set-aside-<tag>`` (kept for inspection,
  delete it by hand), on object stores deleted (a committed tag cannot be saved again there);
* Ray Train's ``checkpoint_manager_snapshot.json`` is rewritten to reference only checkpoints that exist, with
  the chosen one as its latest; an unreadable snapshot (a 0-byte file left by a full disk) is rebuilt from the
  checkpoints on storage.  Ray Train refuses a run whose snapshot is unreadable or names a checkpoint that is
  gone (``CheckpointManagerInitializationError``), so a checkpoint folder deleted by hand no longer blocks it.
"""

from __future__ import annotations

import json
import logging
from typing import Callable

from rayzero.checkpoint.format import LATEST, MANIFEST, CheckpointError
from rayzero.checkpoint.storage import Storage
from rayzero.config import ConfigError

logger = logging.getLogger("rayzero")

SNAPSHOT = "checkpoint_manager_snapshot.json"  # Ray Train's record of the run's reported checkpoints
SET_ASIDE = ".set-aside-"


def checkpoint_tag(resume_from: str | int) -> str:
    """The checkpoint directory name ``resume_from`` means: a tag as it is, or a step number."""
    from rayzero.train.worker import TAG_FORMAT

    if isinstance(resume_from, int):
        return TAG_FORMAT.format(resume_from)
    return resume_from.rstrip("/").rsplit("/", 1)[-1]


def committed(storage: Storage) -> list[tuple[int, str]]:
    """``(step, tag)`` of every committed checkpoint (its manifest written) in the run directory, newest first."""
    from rayzero.train.worker import TAG_PATTERN

    found = []
    for name in storage.listdir(storage.root):
        m = TAG_PATTERN.fullmatch(name)
        if m and storage.exists(storage.join(name, MANIFEST)):
            found.append((int(m.group(1)), name))
    return sorted(found, reverse=True)


def problems_of(storage: Storage, tag: str) -> list[str]:
    """What ``verify`` finds wrong with checkpoint ``tag`` (an unreadable manifest included); [] when intact."""
    from rayzero.checkpoint.tools import verify

    try:
        return verify(storage, tag)  # (a Storage: a URI's scheme and options stay)
    except (CheckpointError, OSError, ValueError, KeyError, TypeError) as e:
        return [f"{type(e).__name__}: {e}"]


def _short(problems: list[str], most: int = 3) -> str:
    more = len(problems) - most
    return "; ".join(problems[:most]) + (f"; and {more} more" if more > 0 else "")


def prepare_resume(run_dir: str, resume_from: str | int | None = None,
                   warn: Callable[[str], None] | None = None) -> tuple[int, str] | None:
    """Make the run at ``run_dir`` resume from the right checkpoint; returns its ``(step, tag)``, or None: the
    run starts fresh.  ``resume_from``: a checkpoint tag (or step) of this run, chosen by hand; a tag that does
    not exist or does not verify raises ConfigError before anything starts.  ``warn`` gets each warning (they
    also go to the log)."""
    from rayzero.train.worker import TAG_PATTERN

    def say(text: str) -> None:
        logger.warning("%s", text)
        if warn is not None:
            warn(text)

    storage = Storage.resolve(run_dir)
    if not storage.exists(storage.root):
        if resume_from is not None:
            raise ConfigError(f"resume_from={resume_from!r}: the run directory {run_dir} does not exist; name the "
                              "run (ClusterConfig(name=...)) whose checkpoint it is, or leave resume_from unset")
        return None
    found = committed(storage)
    target: tuple[int, str] | None = None
    aside: list[str] = []
    if resume_from is not None:
        tag = checkpoint_tag(resume_from)
        m = TAG_PATTERN.fullmatch(tag)
        if m is None or (int(m.group(1)), tag) not in found:
            have = ", ".join(t for _, t in found) or "none"
            raise ConfigError(f"resume_from={resume_from!r}: run directory {run_dir} has no committed checkpoint "
                              f"{tag!r}; its checkpoints: {have}")
        bad = problems_of(storage, tag)
        if bad:
            raise ConfigError(f"resume_from={resume_from!r}: checkpoint {storage.join(tag)} fails verification "
                              f"({_short(bad)}); pick another (its checkpoints: {', '.join(t for _, t in found)})")
        target = (int(m.group(1)), tag)
        aside = [t for s, t in found if s > target[0]]
        if aside:
            say(f"resume_from={resume_from!r}: the newer checkpoints {aside} of run {run_dir} are set aside")
    else:
        for step, tag in found:
            bad = problems_of(storage, tag)
            if not bad:
                target = (step, tag)
                break
            aside.append(tag)
            say(f"checkpoint {storage.join(tag)} fails verification and is skipped ({_short(bad)}); the run resumes "
                "from the newest checkpoint that verifies")
        if found and target is None:
            say(f"no checkpoint of run {run_dir} verifies: the run starts from step 0")
    for tag in aside:
        _set_aside(storage, tag, say)
    _point_latest(storage, target)
    _repair_snapshot(storage, target, say)
    return target


def _set_aside(storage: Storage, tag: str, say: Callable[[str], None]) -> None:
    if not storage.local:
        storage.delete_dir(storage.join(tag))
        say(f"checkpoint {storage.join(tag)} was deleted (an object store cannot save a committed tag again)")
        return
    dest, n = storage.join(SET_ASIDE + tag), 1
    while storage.exists(dest):
        n += 1
        dest = storage.join(f"{SET_ASIDE}{tag}-{n}")
    storage.move(storage.join(tag), dest)
    say(f"checkpoint {storage.join(tag)} was moved to {dest}; no run loads it from there (delete it when done)")


def _point_latest(storage: Storage, target: tuple[int, str] | None) -> None:
    """rayzero's own ``latest`` names the checkpoint the run resumes from."""
    path = storage.join(LATEST)
    try:
        now = storage.read_bytes(path).decode().strip() if storage.exists(path) else None
    except (OSError, UnicodeDecodeError):
        now = ""
    want = target[1] if target else None
    if now == want:
        return
    if want is None:
        storage.fs.delete_file(path)
    else:
        storage.write_bytes_atomic(path, want.encode())


def _state_model():
    try:
        from ray.train.v2._internal.execution.checkpoint.checkpoint_manager import _CheckpointManagerState

        return _CheckpointManagerState
    except ImportError:  # another Ray layout: the snapshot is written as plain JSON
        return None


def _read_snapshot(storage: Storage, path: str) -> tuple[dict | None, str | None]:
    """The snapshot as a dict Ray Train reads, or (None, why it cannot be read)."""
    try:
        data = storage.read_bytes(path)
        state = json.loads(data.decode())
        model = _state_model()
        if model is not None:
            model.parse_obj(state)
        if not isinstance(state, dict):
            raise ValueError("not a JSON object")
        return state, None
    except Exception as e:  # noqa: BLE001 - any failure to read it is what Ray Train would fail on
        size = storage.file_size(path) if storage.exists(path) else 0
        return None, f"{size} bytes, {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"


def _write_snapshot(storage: Storage, path: str, state: dict) -> None:
    import ray

    state.setdefault("ray_version", ray.__version__)
    model = _state_model()
    text = model.parse_obj(state).json() if model is not None else json.dumps(state)
    storage.write_bytes_atomic(path, text.encode())


def _repair_snapshot(storage: Storage, target: tuple[int, str] | None, say: Callable[[str], None]) -> None:
    """Rewrite Ray Train's snapshot so that every checkpoint it names exists and its latest is ``target``."""
    path = storage.join(SNAPSHOT)
    if not storage.exists(path):
        return  # no record: the workers find the checkpoint on storage themselves (worker._newer_commit)
    state, why = _read_snapshot(storage, path)
    if state is None:
        state = _rebuilt(storage, target)
        _write_snapshot(storage, path, state)
        say(f"Ray Train's record of the run, {path}, could not be read ({why}); it was rebuilt from the checkpoints "
            f"on storage ({[r['checkpoint_dir_name'] for r in state['checkpoint_results']]})")
        return
    results = state.get("checkpoint_results") or []
    indices = state.get("checkpoint_report_indices") or []
    keep = [(r, i) for r, i in zip(results, indices) if storage.is_dir(storage.join(r["checkpoint_dir_name"]))]
    names = [r["checkpoint_dir_name"] for r, _ in keep]
    report = int(state.get("current_report_index") or 0)
    if target is not None and target[1] not in names:
        keep.append(({"checkpoint_dir_name": target[1], "metrics": {"step": target[0]}}, report))
        names.append(target[1])
        report += 1
    latest = state.get("latest_checkpoint_result")
    new_latest = None
    if target is not None:
        new_latest = next(r for r, _ in keep if r["checkpoint_dir_name"] == target[1])
    if (len(keep) == len(results) and (latest or {}).get("checkpoint_dir_name") == (target[1] if target else None)
            and all(r["checkpoint_dir_name"] in names for r in state.get("pending_training_results") or [])):
        return  # already consistent
    pending = [(r, v) for r, v in zip(state.get("pending_training_results") or [],
                                      state.get("pending_validation_specs") or []) if r["checkpoint_dir_name"] in names]
    dropped = [r["checkpoint_dir_name"] for r in results if r["checkpoint_dir_name"] not in names]
    state.update(
        checkpoint_results=[r for r, _ in keep],
        checkpoint_report_indices=[i for _, i in keep],
        latest_checkpoint_result=new_latest,
        pending_training_results=[r for r, _ in pending],
        pending_validation_specs=[v for _, v in pending],
        current_report_index=report,
    )
    for key in ("validated_checkpoint_dir_names", "timed_out_validation_checkpoint_dir_names",
                "failed_validation_checkpoint_dir_names"):
        state[key] = [n for n in state.get(key) or [] if n in names]
    _write_snapshot(storage, path, state)
    say(f"Ray Train's record of the run, {path}, now names {names} (latest: {target[1] if target else 'none'})"
        + (f"; it no longer names {dropped}, which are not on storage" if dropped else ""))


def _rebuilt(storage: Storage, target: tuple[int, str] | None) -> dict:
    """A snapshot naming the committed checkpoints on storage up to ``target``, oldest first, ``target`` latest."""
    kept = [] if target is None else sorted((s, t) for s, t in committed(storage) if s <= target[0])
    results = [{"checkpoint_dir_name": t, "metrics": {"step": s}} for s, t in kept]
    return {
        "checkpoint_results": results,
        "checkpoint_report_indices": list(range(len(results))),
        "latest_checkpoint_result": results[-1] if results else None,
        "pending_training_results": [],
        "pending_validation_specs": [],
        "current_report_index": len(results),
        "validated_checkpoint_dir_names": [],
        "timed_out_validation_checkpoint_dir_names": [],
        "failed_validation_checkpoint_dir_names": [],
    }
