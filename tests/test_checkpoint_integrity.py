"""Checkpoints that cannot be silently wrong: every byte of a checkpoint directory is hashed (the manifest
too), so any single-byte edit is found by `verify` and refused by a load, naming the file; a checkpoint
whose parts come from different saves is refused, naming what disagrees."""

from __future__ import annotations

import json
import logging
import os
import shutil
import time

import pytest
import torch

import rayzero
from distributed import run_distributed
from rayzero.checkpoint.format import MANIFEST_HASH_KEY, CheckpointError, manifest_bytes
from rayzero.checkpoint.storage import Storage
from rayzero.checkpoint.tools import export, inspect, verify


def make_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.BatchNorm1d(2))


CONFIG = {"zero_optimization": {"stage": 2}, "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}}}


def _train(engine, steps: int, seed: int = 1) -> None:
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        out = engine(torch.randn(4, 3, generator=gen))
        engine.backward(out.float().pow(2).mean())
        engine.step()


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A world-1 checkpoint after 2 steps (tag global_step2) and one after 3 (global_step3), same run."""
    save_dir = str(tmp_path_factory.mktemp("integrity") / "run")
    engine = rayzero.initialize(make_model(), CONFIG)
    _train(engine, 2)
    engine.save_checkpoint(save_dir)
    _train(engine, 1, seed=2)
    engine.save_checkpoint(save_dir, tag="global_step3")
    engine.destroy()
    with open(os.path.join(save_dir, "latest"), "w") as f:
        f.write("global_step2")
    return save_dir


@pytest.fixture(scope="module")
def loader():
    engine = rayzero.initialize(make_model(), CONFIG)
    yield engine
    engine.destroy()


def _copy(save_dir: str, to) -> str:
    out = str(to / "copy")
    shutil.copytree(save_dir, out)
    return out


def _detected_by_verify(save_dir: str, name: str) -> str | None:
    """None when verify names ``name`` as damaged, else what it said."""
    try:
        problems = verify(save_dir)
    except CheckpointError as e:
        return None if name in str(e) else f"raised without naming {name}: {e}"
    if any(name in p for p in problems):
        return None
    return f"verify found {problems}"


def _detected_by_load(engine, save_dir: str, name: str) -> str | None:
    try:
        engine.load_checkpoint(save_dir)
    except CheckpointError as e:
        return None if name in str(e) else f"raised without naming {name}: {e}"
    return "loaded"


def _each_byte_edit(path: str, positions, check) -> list[str]:
    """Flip the low bit of each byte at ``positions`` (a digit becomes another digit, a letter another letter)
    in turn, run ``check`` on the damaged file, and put the byte back; the positions where check failed."""
    with open(path, "rb") as f:
        original = f.read()
    missed = []
    fd = os.open(path, os.O_WRONLY)  # edited in place, one byte at a time
    try:
        for i in positions:
            os.pwrite(fd, bytes([original[i] ^ 0x01]), i)
            why = check()
            os.pwrite(fd, original[i : i + 1], i)
            if why is not None:
                missed.append(f"byte {i} ({original[i:i + 1]!r}): {why}")
    finally:
        os.close(fd)
    with open(path, "rb") as f:
        assert f.read() == original
    return missed


# Every byte of the manifest (32 KB); every 3rd of the rank file (14 KB), whose every byte takes ~19 s
# (RAYZERO_TEST_EVERY_BYTE=1 edits every byte of both: 24 s on an idle 2-core machine).
EVERY_BYTE = os.environ.get("RAYZERO_TEST_EVERY_BYTE") == "1"


@pytest.mark.parametrize("file,stride", [("manifest.json", 1), ("rank_00000.arrow", 3)])
def test_every_single_byte_edit_is_detected_by_verify_and_load(saved, loader, tmp_path, file, stride):
    save_dir = _copy(saved, tmp_path)
    path = os.path.join(save_dir, "global_step2", file)
    size = os.path.getsize(path)
    assert verify(save_dir) == []
    files = json.load(open(os.path.join(save_dir, "global_step2", "manifest.json")))["files"]
    assert [sorted(f) for f in files] == [["file", "fragments", "frame_xxh3", "meta_xxh3", "size", "xxh3"]]
    positions = range(0, size, 1 if EVERY_BYTE else stride)
    t0 = time.perf_counter()
    missed = _each_byte_edit(path, positions, lambda: _detected_by_verify(save_dir, file)
                             or _detected_by_load(loader, save_dir, file))
    took = time.perf_counter() - t0
    assert not missed, f"{len(missed)} of {len(positions)} single-byte edits of {file} went unnoticed: {missed[:5]}"
    print(f"{file}: {len(positions)} of its {size} bytes edited one at a time, all detected by verify and load "
          f"in {took:.1f} s")
    loader.load_checkpoint(save_dir)  # intact again: loads
    assert loader.global_steps == 2


def test_edited_step_is_refused_as_in_the_issue(saved, loader, tmp_path):
    """The issue's case: "global_steps": 2 -> 3 and Adam's step likewise.  verify and load both refuse it."""
    save_dir = _copy(saved, tmp_path)
    path = os.path.join(save_dir, "global_step2", "manifest.json")
    text = open(path).read()
    assert '"global_steps": 2,' in text and '"value": 2.0' in text
    with open(path, "w") as f:
        f.write(text.replace('"global_steps": 2,', '"global_steps": 3,').replace('"value": 2.0', '"value": 3.0'))
    with pytest.raises(CheckpointError, match="manifest.json: checksum mismatch"):
        verify(save_dir)
    with pytest.raises(CheckpointError, match="manifest.json: checksum mismatch"):
        loader.load_checkpoint(save_dir)
    with pytest.raises(CheckpointError, match="manifest.json: checksum mismatch"):
        inspect(save_dir)
    with pytest.raises(CheckpointError, match="manifest.json: checksum mismatch"):
        export(save_dir, str(tmp_path / "out.pt"))


def _swap_in(save_dir: str, from_tag: str, to_tag: str, file: str) -> None:
    """Put ``from_tag``'s ``file`` into ``to_tag`` and re-seal ``to_tag``'s manifest over it (its size and
    hashes): every hash checks out, only the parts disagree."""
    shutil.copy(os.path.join(save_dir, from_tag, file), os.path.join(save_dir, to_tag, file))
    src = json.load(open(os.path.join(save_dir, from_tag, "manifest.json")))
    path = os.path.join(save_dir, to_tag, "manifest.json")
    m = json.load(open(path))
    m["files"] = src["files"]
    with open(path, "wb") as f:
        f.write(manifest_bytes(m))


def test_a_rank_file_of_another_save_is_refused_naming_what_disagrees(saved, loader, tmp_path):
    save_dir = _copy(saved, tmp_path)
    _swap_in(save_dir, "global_step3", "global_step2", "rank_00000.arrow")
    problems = verify(save_dir)
    assert "rank_00000.arrow: saved with tag 'global_step3', the manifest says 'global_step2' (the file belongs to " \
           "another save)" in problems, problems
    assert "rank_00000.arrow: saved with global_steps 3, the manifest says 2 (the file belongs to another save)" \
        in problems, problems
    with pytest.raises(CheckpointError, match=r"rank_00000.arrow: saved with tag 'global_step3', the manifest says "
                                              r"'global_step2'"):
        loader.load_checkpoint(save_dir)


def test_an_index_edit_is_refused_where_the_file_frame_is_not_hashed(saved, loader, tmp_path):
    """A fragment's dtype edited in a rank file's index: its data hash still matches (the bytes are the same),
    so on storage where a load does not hash the file's frame (object stores: no frame_xxh3 check) the index's
    own hash in the manifest (meta_xxh3) is what finds it."""
    save_dir = _copy(saved, tmp_path)
    path = os.path.join(save_dir, "global_step2", "rank_00000.arrow")
    data = open(path, "rb").read()
    at = data.rfind(b'"dtype":"float32"')  # in the footer's schema, the copy a reader takes the index from
    assert at > 0
    with open(path, "wb") as f:
        f.write(data[:at] + b'"dtype":"float16"' + data[at + len(b'"dtype":"float32"'):])
    manifest = os.path.join(save_dir, "global_step2", "manifest.json")
    m = json.load(open(manifest))
    for info in m["files"]:
        info.pop("frame_xxh3")  # what a load from an object store checks: no frame hash
    with open(manifest, "wb") as f:
        f.write(manifest_bytes(m))
    with pytest.raises(CheckpointError, match=r"checksum mismatch in rank_00000.arrow of checkpoint 'global_step2': "
                                              r"its index \(each fragment's tensor, range, dtype and hash\)"):
        loader.load_checkpoint(save_dir)
    assert any("rank_00000.arrow" in p for p in verify(save_dir))


def test_world_and_shapes_that_disagree_are_refused(saved, loader, tmp_path):
    save_dir = _copy(saved, tmp_path)
    path = os.path.join(save_dir, "global_step2", "manifest.json")
    original = json.load(open(path))
    m = json.loads(json.dumps(original))
    m["world_size"] = 2
    open(path, "wb").write(manifest_bytes(m))
    with pytest.raises(CheckpointError, match="the manifest lists 1 fragment files for world size 2"):
        loader.load_checkpoint(save_dir)
    assert "rank_00000.arrow: saved with world_size 1, the manifest says 2 (the file belongs to another save)" \
        in verify(save_dir)
    # a parameter's shape grown in the manifest (the model grown to match): its fragments no longer cover it
    m = json.loads(json.dumps(original))
    p = m["params"][0]
    assert p["name"] == "0.weight" and p["shape"] == [2, 3]
    p["shape"], p["numel"] = [3, 3], 9
    open(path, "wb").write(manifest_bytes(m))
    assert "0.weight/fp32: fragments cover [0, 6) of 9 elements" in verify(save_dir)
    bigger = rayzero.initialize(torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.BatchNorm1d(2)), CONFIG)
    try:
        with pytest.raises(CheckpointError, match=r"0.weight/fp32: fragments cover \[0, 6\) of 9 elements"):
            bigger.load_checkpoint(save_dir)
    finally:
        bigger.destroy()


def test_manifest_without_its_hash_loads_with_a_warning_and_fails_verify(saved, loader, tmp_path, caplog):
    """A checkpoint of a rayzero that did not hash its manifest still loads (with a warning); verify says it
    cannot vouch for the manifest."""
    save_dir = _copy(saved, tmp_path)
    path = os.path.join(save_dir, "global_step2", "manifest.json")
    m = json.load(open(path))
    del m[MANIFEST_HASH_KEY]
    open(path, "w").write(json.dumps(m, indent=1))  # as those versions wrote it
    with caplog.at_level(logging.WARNING, logger="rayzero"):
        loader.load_checkpoint(save_dir)
    assert loader.global_steps == 2
    assert any(f"has no {MANIFEST_HASH_KEY}" in r.getMessage() for r in caplog.records)
    assert any(p.startswith(f"manifest.json: no {MANIFEST_HASH_KEY}") for p in verify(save_dir))


# ---- storage the ranks do not share ---------------------------------------------------------------------
def _save_to_own_dir(rank: int, world: int, root: str) -> dict:
    engine = rayzero.initialize(make_model(), CONFIG)
    _train(engine, 1, seed=10 + rank)
    own = os.path.join(root, f"rank{rank}")  # as a local path on separate nodes, or per-rank dirs
    t0 = time.perf_counter()
    try:
        engine.save_checkpoint(own)
        error = None
    except CheckpointError as e:
        error = str(e)
    took = time.perf_counter() - t0
    leftovers = sorted(os.listdir(own)) if os.path.isdir(own) else None
    engine.destroy()
    return {"error": error, "took": took, "leftovers": leftovers}


def test_ranks_that_do_not_share_storage_fail_the_first_save_fast_naming_the_paths(tmp_path):
    results = run_distributed(_save_to_own_dir, 2, str(tmp_path))
    errors = {r["error"] for r in results}
    assert len(errors) == 1 and None not in errors, results  # every rank raises, the same message
    msg = errors.pop()
    assert msg.startswith("the checkpoint storage is not shared by all ranks: "), msg
    assert f"rank 0 (host {os.uname().nodename}) saves to {str(tmp_path / 'rank0')!r}" in msg, msg
    assert f"rank 1 (host {os.uname().nodename}) saves to {str(tmp_path / 'rank1')!r} and could not write there " \
           "(FileNotFoundError: the staging directory" in msg, msg
    assert "does not see the files of rank 1" in msg and "does not see the files of rank 0" in msg, msg
    assert "a shared filesystem mounted at the same path on every node, or an object store URI" in msg
    assert max(r["took"] for r in results) < 10.0, [r["took"] for r in results]  # the commit would wait 1,800 s
    assert results[0]["leftovers"] == [] and results[1]["leftovers"] is None  # rank 0's staging dir is gone


# ---- keep_checkpoints: folders no record holds -----------------------------------------------------------
def _tag(step: int) -> str:
    return f"checkpoint_step{step:08d}"


def _ray_record(run: str, recorded: list[int]) -> None:
    """Ray Train's checkpoint_manager_snapshot.json holding ``recorded`` (the last the latest), written by Ray's
    own state model."""
    from ray.train.v2._internal.execution.checkpoint.checkpoint_manager import (
        _CheckpointManagerState,
        _TrainingResultState,
    )

    results = [_TrainingResultState(checkpoint_dir_name=_tag(s), metrics={"step": s}) for s in recorded]
    state = _CheckpointManagerState(
        checkpoint_results=results, checkpoint_report_indices=list(range(len(results))),
        latest_checkpoint_result=results[-1], pending_training_results=[], pending_validation_specs=[],
        current_report_index=len(results), validated_checkpoint_dir_names=[],
        timed_out_validation_checkpoint_dir_names=[], failed_validation_checkpoint_dir_names=[])
    with open(os.path.join(run, "checkpoint_manager_snapshot.json"), "w") as f:
        f.write(state.json())


@pytest.fixture(scope="module")
def run_checkpoints(tmp_path_factory):
    """A run folder with committed checkpoints at steps 2, 4, 6, 8 and 10, as fit's workers save them."""
    run = str(tmp_path_factory.mktemp("retention") / "run")
    engine = rayzero.initialize(make_model(), CONFIG)
    for step in (2, 4, 6, 8, 10):
        _train(engine, 2, seed=step)
        engine.save_checkpoint(run, tag=_tag(step))
    engine.destroy()
    return run


def _left(run: str) -> list[str]:
    return sorted(n for n in os.listdir(run) if n.startswith(("checkpoint_step", ".tmp-", ".old-")))


def test_folders_no_record_holds_are_removed_at_resume(run_checkpoints, tmp_path):
    """keep_checkpoints=2: Ray's record holds steps 6 and 8.  Steps 2 and 4 are in no record (a process died
    between Ray's record and its delete, or after a commit that was never reported), a dead save left its
    staging folder, and step 10 was committed but not yet recorded (the worker resumes from it).  The resume
    leaves exactly Ray's two and the one it resumes from; Ray drops step 6 itself when step 10's report
    lands."""
    from rayzero.train.worker import _prune_unrecorded

    run = _copy(run_checkpoints, tmp_path)
    os.remove(os.path.join(run, "latest"))
    os.makedirs(os.path.join(run, ".tmp-" + _tag(12)))  # a save that died before its manifest
    open(os.path.join(run, ".tmp-" + _tag(12), "rank_00000.arrow.partial"), "wb").write(b"\0" * 100)
    _ray_record(run, [6, 8])
    _prune_unrecorded(Storage.resolve(run), _tag(10))
    assert _left(run) == [_tag(6), _tag(8), _tag(10)]
    # the next start resumes from Ray's latest (step 10 now recorded, step 6 deleted by Ray): nothing else goes
    shutil.rmtree(os.path.join(run, _tag(6)))
    _ray_record(run, [8, 10])
    _prune_unrecorded(Storage.resolve(run), _tag(10))
    assert _left(run) == [_tag(8), _tag(10)]


def test_resumed_newer_and_unreadable_records_are_never_removed(run_checkpoints, tmp_path):
    from rayzero.train.worker import _prune_unrecorded

    run = _copy(run_checkpoints, tmp_path)
    # resuming from step 4 (Ray's record holds 2 and 4): the newer ones may not be recorded yet, and stay
    _ray_record(run, [2, 4])
    _prune_unrecorded(Storage.resolve(run), _tag(4))
    assert _left(run) == [_tag(s) for s in (2, 4, 6, 8, 10)]
    # the one being resumed from stays although no record holds it and a newer one is recorded
    _ray_record(run, [8, 10])
    _prune_unrecorded(Storage.resolve(run), _tag(4))
    assert _left(run) == [_tag(4), _tag(8), _tag(10)]
    # an unreadable record (a full disk left it empty): nothing is deleted
    open(os.path.join(run, "checkpoint_manager_snapshot.json"), "w").close()
    _prune_unrecorded(Storage.resolve(run), _tag(10))
    assert _left(run) == [_tag(4), _tag(8), _tag(10)]
