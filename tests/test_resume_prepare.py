"""Saves on a full volume, and the driver's choice of the checkpoint a ``fit`` run resumes from
(rayzero/train/resume.py), without Ray: real engines, real checkpoints, a real full tmpfs, and Ray Train's own
CheckpointManager reading the snapshot the driver leaves.  (The same under ``rayzero.fit``:
tests/test_ray_resume.py.)"""

from __future__ import annotations

import os
import resource
import subprocess

import pytest
import torch

import rayzero
from distributed import run_distributed
from rayzero.checkpoint.format import CheckpointError
from rayzero.checkpoint.tools import verify
from rayzero.config import ConfigError
from rayzero.train.resume import SNAPSHOT, prepare_resume

CONFIG = {"train_batch_size": 4, "zero_optimization": {"stage": 2}, "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}}}


def _engine(width: int = 8, world: int = 1):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.Tanh(), torch.nn.Linear(width, 3))
    return rayzero.initialize(model, {**CONFIG, "train_micro_batch_size_per_gpu": 4 // world})


def _step(engine, width: int = 8) -> None:
    g = torch.Generator().manual_seed(engine.global_steps)
    x = torch.randn(4 // engine.comm.world, width, generator=g)
    loss = engine(x).float().pow(2).mean()
    engine.backward(loss)
    engine.step()


def _tag(step: int) -> str:
    return f"checkpoint_step{step:08d}"


@pytest.fixture
def volume(tmp_path):
    """A 12 MB tmpfs (mounting needs root: skipped where it is not permitted)."""
    path = tmp_path / "vol"
    path.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=12m", "tmpfs", str(path)], capture_output=True, text=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({done.stderr.strip() or done.returncode}): needs root")
    try:
        yield str(path)
    finally:
        subprocess.run(["umount", str(path)], check=False)


def _fill(volume: str, leave: int) -> str:
    """Write a file that leaves ``leave`` bytes free on the volume."""
    st = os.statvfs(volume)
    filler = os.path.join(volume, "filler")
    with open(filler, "wb") as f:
        f.write(b"\0" * max(0, st.f_bavail * st.f_frsize - leave))
    return filler


def test_a_save_that_cannot_fit_fails_before_writing_naming_the_volume(volume):
    """A 3.2 MB checkpoint on a volume with 2 MB free: rayzero's CheckpointError names the volume, the bytes
    needed and free and the checkpoint kept; no staging directory is left; the kept one still verifies; and
    after space is freed the same save succeeds."""
    run = os.path.join(volume, "run")
    engine = _engine(width=512)
    _step(engine, 512)
    engine.save_checkpoint(run, tag=_tag(1))
    filler = _fill(volume, 2 << 20)
    _step(engine, 512)
    with pytest.raises(CheckpointError) as e:
        engine.save_checkpoint(run, tag=_tag(2))
    text = str(e.value)
    assert f"not enough free space for checkpoint {_tag(2)!r}" in text, text
    assert f"the volume {volume} has" in text, text
    data = 3 * (512 * 512 + 512 + 512 * 3 + 3) * 4  # masters and Adam's two moments, fp32
    assert f"{data:,} bytes of data" in text, text
    assert f"the last checkpoint kept is {_tag(1)!r}" in text, text
    assert sorted(os.listdir(run)) == [_tag(1), "latest"]  # no .tmp- staging directory
    assert open(os.path.join(run, "latest")).read() == _tag(1)
    assert verify(run, _tag(1)) == []
    os.remove(filler)
    engine.save_checkpoint(run, tag=_tag(2))
    assert verify(run, _tag(2)) == []
    engine.destroy()


def _rank1_cannot_write(rank: int, world: int, run: str) -> dict:
    """Rank 1 may write no byte to any file (RLIMIT_FSIZE 0: as on a full disk, not even its error marker)."""
    engine = _engine(world=world)
    _step(engine)
    engine.save_checkpoint(run, tag=_tag(1))
    _step(engine)
    if rank == 1:
        resource.setrlimit(resource.RLIMIT_FSIZE, (0, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))
    try:
        engine.save_checkpoint(run, tag=_tag(2))
        error = None
    except CheckpointError as e:
        error = str(e)
    finally:
        if rank == 1:
            resource.setrlimit(resource.RLIMIT_FSIZE, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
    engine.destroy()
    return {"error": error, "listing": sorted(os.listdir(run)) if rank == 0 else None}


def test_a_rank_that_cannot_write_fails_the_save_at_once_and_leaves_no_staging(tmp_path):
    run = str(tmp_path / "run")
    out = run_distributed(_rank1_cannot_write, 2, run, timeout=90)
    assert "File too large" in out[1]["error"], out
    assert "failed on another rank" in out[0]["error"], out
    assert out[0]["listing"] == [_tag(1), "latest"], out  # the staging directory is gone
    assert verify(run, _tag(1)) == []


# ---- the driver: which checkpoint a rerun resumes from ----------------------------------------------------
def _saved(run: str, steps: list[int]) -> None:
    engine = _engine()
    for s in range(1, max(steps) + 1):
        _step(engine)
        if s in steps:
            engine.save_checkpoint(run, tag=_tag(s))
    engine.destroy()


def _ray_snapshot(run: str, steps: list[int]) -> None:
    """Ray Train's record of a run that reported these checkpoints, as its CheckpointManager writes it."""
    from ray.train.v2._internal.execution.checkpoint.checkpoint_manager import _CheckpointManagerState

    results = [{"checkpoint_dir_name": _tag(s), "metrics": {"step": s}} for s in steps]
    state = _CheckpointManagerState(
        checkpoint_results=results, checkpoint_report_indices=list(range(len(steps))),
        latest_checkpoint_result=results[-1], pending_training_results=[], pending_validation_specs=[],
        current_report_index=len(steps), validated_checkpoint_dir_names=[],
        timed_out_validation_checkpoint_dir_names=[], failed_validation_checkpoint_dir_names=[])
    with open(os.path.join(run, SNAPSHOT), "w") as f:
        f.write(state.json())


def _ray_latest(storage: str, name: str) -> tuple[str | None, list[str]]:
    """What Ray Train's own CheckpointManager restores from the run's snapshot: its latest checkpoint's
    directory name and every one it keeps track of (it raises where the snapshot is unreadable)."""
    from ray.train import CheckpointConfig
    from ray.train.v2._internal.execution.checkpoint.checkpoint_manager import CheckpointManager
    from ray.train.v2._internal.execution.storage import StorageContext

    manager = CheckpointManager(CheckpointConfig(num_to_keep=3),
                                StorageContext(storage_path=storage, experiment_dir_name=name))
    latest = manager.latest_checkpoint_result
    names = [os.path.basename(r.checkpoint.path) for r in manager._checkpoint_results]
    return (os.path.basename(latest.checkpoint.path) if latest else None), names


def _corrupt(run: str, tag: str) -> None:
    path = os.path.join(run, tag, "rank_00000.arrow")
    with open(path, "r+b") as f:
        f.seek(os.path.getsize(path) // 2)
        b = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([b[0] ^ 0x01]))


def test_a_bad_latest_is_skipped_and_a_deleted_folder_leaves_ray_a_readable_record(tmp_path, caplog):
    from ray.train.v2._internal.exceptions import CheckpointManagerInitializationError

    run = str(tmp_path / "run")
    _saved(run, [2, 4, 6])
    _ray_snapshot(run, [2, 4, 6])
    _corrupt(run, _tag(6))
    import shutil

    shutil.rmtree(os.path.join(run, _tag(4)))  # the "obvious manual fix" of a bad folder
    with pytest.raises(CheckpointManagerInitializationError, match="does not exist anymore"):
        _ray_latest(str(tmp_path), "run")  # what Ray Train does with the record as it is
    warnings: list[str] = []
    assert prepare_resume(run, warn=warnings.append) == (2, _tag(2))
    assert any(_tag(6) in w and "fails verification" in w for w in warnings), warnings
    assert _ray_latest(str(tmp_path), "run") == (_tag(2), [_tag(2)])
    assert os.path.isdir(os.path.join(run, f".set-aside-{_tag(6)}"))  # kept for inspection, loaded by no one
    assert not os.path.exists(os.path.join(run, _tag(6)))
    assert open(os.path.join(run, "latest")).read() == _tag(2)
    assert prepare_resume(run) == (2, _tag(2))  # a second rerun: nothing left to change


def test_an_unreadable_snapshot_is_rebuilt_from_the_checkpoints_on_storage(tmp_path):
    run = str(tmp_path / "run")
    _saved(run, [2, 4])
    open(os.path.join(run, SNAPSHOT), "w").close()  # 0 bytes, as a full disk left it
    warnings: list[str] = []
    assert prepare_resume(run, warn=warnings.append) == (4, _tag(4))
    assert any("could not be read (0 bytes" in w for w in warnings), warnings
    assert _ray_latest(str(tmp_path), "run") == (_tag(4), [_tag(2), _tag(4)])


def test_resume_from_picks_a_checkpoint_by_hand_and_refuses_a_missing_or_bad_one(tmp_path):
    run = str(tmp_path / "run")
    _saved(run, [2, 4, 6])
    _ray_snapshot(run, [2, 4, 6])
    _corrupt(run, _tag(2))
    with pytest.raises(ConfigError, match=r"resume_from='checkpoint_step00000003'.*no committed checkpoint.*its "
                                          r"checkpoints: checkpoint_step00000006, checkpoint_step00000004"):
        prepare_resume(run, "checkpoint_step00000003")
    with pytest.raises(ConfigError, match=r"resume_from=2: checkpoint .*checkpoint_step00000002 fails verification "
                                          r"\(rank_00000.arrow: file hash mismatch"):
        prepare_resume(run, 2)
    assert prepare_resume(run, _tag(4)) == (4, _tag(4))
    assert _ray_latest(str(tmp_path), "run") == (_tag(4), [_tag(2), _tag(4)])
    assert sorted(n for n in os.listdir(run) if "step" in n) == [f".set-aside-{_tag(6)}", _tag(2), _tag(4)]
    with pytest.raises(ConfigError, match="needs the run's name"):
        rayzero.ClusterConfig(resume_from=4, storage=str(tmp_path)).validate()
    with pytest.raises(ConfigError, match=r"ClusterConfig.resume_from=-1 \(int\): must be None .* or its step"):
        rayzero.ClusterConfig(name="run", resume_from=-1, storage=str(tmp_path)).validate()


def test_fit_refuses_a_resume_from_the_run_does_not_have_before_starting_ray(tmp_path):
    ray = pytest.importorskip("ray")
    run = str(tmp_path / "run")
    _saved(run, [2])
    with pytest.raises(ConfigError, match=r"resume_from=4: run directory .* has no committed checkpoint "
                                          r"'checkpoint_step00000004'; its checkpoints: checkpoint_step00000002"):
        rayzero.fit(lambda: torch.nn.Linear(8, 3), {"workers": 1, "storage": str(tmp_path), "name": "run",
                                                     "resume_from": 4, "progress": False},
                    config=CONFIG, data=[torch.zeros(8)] * 4, max_steps=3)
    assert not ray.is_initialized()
