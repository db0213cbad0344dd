"""``rayzero.fit`` reruns that must resume (real local Ray cluster, 2 workers): a run whose storage fills up,
leaving Ray Train's record unreadable and its latest checkpoint corrupt.  Each rerun is the
same call with the same name, and ends with the final weights and losses of an uninterrupted run, bit for bit.
(Without Ray: tests/test_resume_prepare.py.)"""

from __future__ import annotations

import os
import subprocess

import pytest
import torch

import rayzero
from rayzero.checkpoint.format import CheckpointError
from distributed import run_distributed
from ray_cases import CONFIG, Regression, cpu_fit, model_factory, mse
import shared_ray

ray = pytest.importorskip("ray")
SHARED_RAY = True  # runs on the suite's one local cluster (tests/shared_ray.py)
STEPS, EVERY = 6, 2
DETERMINISTIC = {**CONFIG, "deterministic": True}
LEAVE = 256 << 10  # bytes the filler leaves free: less than a save's 1 MiB headroom, room for the metrics lines


@pytest.fixture(scope="module", autouse=True)
def ray_cluster():
    yield shared_ray.start()  # the suite's one cluster (tests/shared_ray.py)


class FillOnce:
    """A train_step that, on rank 0 at one step of the first attempt only, fills the storage volume with a file
    that leaves ``LEAVE`` bytes free (the checkpoints before it fit; the next one does not)."""

    def __init__(self, filler: str, step: int):
        self.filler, self.step = filler, step

    def __call__(self, engine, batch):
        import ray.train

        if (engine.global_steps == self.step and ray.train.get_context().get_world_rank() == 0
                and not os.path.exists(self.filler + ".done")):
            st = os.statvfs(os.path.dirname(self.filler))
            with open(self.filler, "wb") as f:
                f.write(b"\0" * (st.f_bavail * st.f_frsize - LEAVE))
            open(self.filler + ".done", "w").close()
        loss = mse(engine(batch[0]), batch)
        engine.backward(loss)
        engine.step()
        return loss


def _fit(storage: str, filler: str) -> rayzero.Result:
    return rayzero.fit(
        model_factory,
        {"workers": 2, "storage": storage, "name": "run", "checkpoint_every": EVERY, "keep_checkpoints": 3,
         "max_failures": 0, "progress": False},
        config=DETERMINISTIC,
        data=Regression(),
        train_step=FillOnce(filler, step=5),
        max_steps=STEPS,
    )


def _weights(checkpoint: str, out: str) -> dict[str, torch.Tensor]:
    from rayzero.checkpoint.tools import export

    export(checkpoint, out)
    return torch.load(out)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """The same training without any fault (ray_cases.cpu_fit, which tests/test_ray_fit.py checks against
    ``rayzero.fit`` bit for bit): its losses and final weights."""
    tmp = tmp_path_factory.mktemp("straight")
    losses = run_distributed(cpu_fit, 2, [{"name": "straight", "config": DETERMINISTIC}], STEPS, str(tmp))[0][0]
    return losses, _weights(str(tmp / "straight" / f"checkpoint_step{STEPS:08d}"), str(tmp / "straight.pt"))


@pytest.fixture(scope="module")
def volume(tmp_path_factory):
    """A 16 MB tmpfs for the run's storage (mounting needs root: skipped where it is not permitted)."""
    path = tmp_path_factory.mktemp("vol")
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=16m", "tmpfs", str(path)], capture_output=True, text=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({done.stderr.strip() or done.returncode}): needs root")
    yield str(path)
    subprocess.run(["umount", "-l", str(path)], check=False)


def _tag(step: int) -> str:
    return f"checkpoint_step{step:08d}"


def test_full_disk_then_a_bad_latest_the_same_call_resumes_from_the_newest_good_checkpoint(volume, uninterrupted,
                                                                                          tmp_path, capfd):
    """The volume fills after the checkpoints of steps 2 and 4: the save of step 6 fails fast with rayzero's
    error, leaving no staging directory.  Then, as the issue found them after a full disk, Ray Train's record is
    at 0 bytes, and step 4's checkpoint is corrupt: once space is freed, the same call skips step 4's checkpoint
    naming it, rebuilds Ray's record, resumes from step 2 and ends as the uninterrupted run, bit for bit."""
    losses, weights = uninterrupted
    filler = os.path.join(volume, "filler")
    run = os.path.join(volume, "run")
    with pytest.raises(CheckpointError) as e:
        _fit(volume, filler)
    text = str(e.value)
    assert f"not enough free space for checkpoint {_tag(6)!r} in {run}: the volume {volume} has" in text, text
    assert f"the last checkpoint kept is {_tag(4)!r}" in text, text
    assert sorted(n for n in os.listdir(run) if "checkpoint_step" in n) == [_tag(2), _tag(4)]  # no .tmp- staging
    open(os.path.join(run, "checkpoint_manager_snapshot.json"), "w").close()  # Ray's record at 0 bytes
    path = os.path.join(run, _tag(4), "rank_00001.arrow")
    with open(path, "r+b") as f:  # one bit of step 4's checkpoint flipped
        f.seek(os.path.getsize(path) // 2)
        b = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([b[0] ^ 0x10]))
    os.remove(filler)
    capfd.readouterr()
    result = _fit(volume, filler)  # the same call
    out = capfd.readouterr().out
    assert f"checkpoint {os.path.join(run, _tag(4))} fails verification and is skipped (rank_00001.arrow:" in out, out
    assert "could not be read (0 bytes" in out, out
    assert result.resumed_from == 2
    assert [r["step"] for r in result.history] == [1, 2, 3, 4, 5, 6, 3, 4, 5, 6]  # steps 3-6 were redone
    assert result.losses == losses
    fit_weights = _weights(result.checkpoint, str(tmp_path / "fit.pt"))
    assert list(fit_weights) == list(weights)
    for name, v in weights.items():
        assert torch.equal(fit_weights[name], v), name
    assert os.path.isdir(os.path.join(run, f".set-aside-{_tag(4)}"))  # kept for inspection, loaded by no one
