"""keep_checkpoints under rayzero.fit on a real local Ray cluster: a rerun of the same call leaves exactly
keep_checkpoints checkpoint folders, also when a crash left folders that no record holds.  (The cases one by
one, on disk without Ray: tests/test_checkpoint_integrity.py.)"""

from __future__ import annotations

import os
import shutil

import pytest

import rayzero
from ray_cases import CONFIG, Regression, model_factory, mse
import shared_ray

ray = pytest.importorskip("ray")
SHARED_RAY = True  # runs on the suite's one local cluster (tests/shared_ray.py)


@pytest.fixture(scope="module", autouse=True)
def ray_cluster():
    yield shared_ray.start()  # the suite's one cluster (tests/shared_ray.py)


def _tag(step: int) -> str:
    return f"checkpoint_step{step:08d}"


def _folders(run_dir: str) -> list[str]:
    return sorted(n for n in os.listdir(run_dir) if n.startswith(("checkpoint_step", ".tmp-", ".old-")))


def test_a_rerun_removes_the_folders_a_crash_left_in_no_record(tmp_path):
    cluster = {"workers": 2, "storage": str(tmp_path), "name": "keep", "checkpoint_every": 1,
               "keep_checkpoints": 2, "progress": False}
    first = rayzero.fit(model_factory, cluster, config=CONFIG, data=Regression(), loss_fn=mse, max_steps=3)
    run = first.run_dir
    assert _folders(run) == [_tag(2), _tag(3)]
    # what crashes leave: a committed checkpoint in no record (Ray Train died between writing its record and
    # deleting the folder) and the staging folder of a save that died before its manifest
    shutil.copytree(os.path.join(run, _tag(2)), os.path.join(run, _tag(1)))
    os.makedirs(os.path.join(run, ".tmp-" + _tag(4)))
    with open(os.path.join(run, ".tmp-" + _tag(4), "rank_00000.arrow.partial"), "wb") as f:
        f.write(b"\0" * 1000)
    second = rayzero.fit(model_factory, cluster, config=CONFIG, data=Regression(), loss_fn=mse, max_steps=5)
    assert second.resumed_from == 3
    assert _folders(run) == [_tag(4), _tag(5)]
