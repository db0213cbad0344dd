"""rayzero.fit on a real local Ray cluster: an error that no retry gets past ends the run at once with that
error, and a Hugging Face model trains on its own loss.  (The driver's checks before launch, and which errors
are fatal: tests/test_fit_validation.py.)"""

from __future__ import annotations

import os
import time

import pytest
import torch

import rayzero
from moe_cases import tiny_qwen3
from ray_cases import CONFIG, Regression, model_factory, mse
import shared_ray

ray = pytest.importorskip("ray")
SHARED_RAY = True  # runs on the suite's one local cluster (tests/shared_ray.py)


@pytest.fixture(scope="module", autouse=True)
def ray_cluster():
    yield shared_ray.start()  # the suite's one cluster (tests/shared_ray.py)


class CountingFactory:
    """``model_factory``, writing one line to ``path`` each time a worker builds the model (not the driver's
    meta-device build): the number of worker groups the run started, times its workers."""

    def __init__(self, path: str):
        self.path = path

    def __call__(self):
        if torch.empty(0).device.type != "meta":
            with open(self.path, "a") as f:
                f.write(f"{os.getpid()}\n")
        return model_factory()


class NaNTargets(Regression):
    def __getitem__(self, i):
        x, y = super().__getitem__(i)
        return x, torch.full_like(y, float("nan"))


def test_a_nan_loss_ends_the_run_at_once_with_its_own_error(tmp_path):
    builds = tmp_path / "builds.txt"
    start = time.monotonic()
    with pytest.raises(rayzero.NonFiniteGradientError, match="global gradient norm is nan at step 1") as info:
        rayzero.fit(
            CountingFactory(str(builds)),
            {"workers": 2, "storage": str(tmp_path), "name": "nan", "max_failures": 3, "progress": False},
            config=CONFIG, data=NaNTargets(), loss_fn=mse, max_steps=4,
        )
    elapsed = time.monotonic() - start
    # one worker group of 2 (max_failures=3 would have built it 4 times), and the worker's error itself, once:
    # not Ray Train's WorkerGroupError holding every rank's traceback
    assert len(builds.read_text().split()) == 2
    assert type(info.value) is rayzero.NonFiniteGradientError
    assert info.value.__suppress_context__ and info.value.__cause__ is None
    assert any("stopped at once without a retry" in note for note in info.value.__notes__)
    assert "Training failed due to worker errors" not in str(info.value)
    print(f"nan loss: fit raised after {elapsed:.1f} s")


def _tokens(n: int = 24, length: int = 8):
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(0, 64, (n, length), generator=g)
    return [{"input_ids": ids[i], "labels": ids[i]} for i in range(n)]


def test_a_hugging_face_model_trains_on_its_own_loss(tmp_path):
    from rayzero.train.data import GlobalOrder

    data = _tokens()
    config = {**CONFIG, "train_batch_size": 4}
    result = rayzero.fit(
        tiny_qwen3, {"workers": 1, "storage": str(tmp_path), "name": "hf", "checkpoint_every": 0, "progress": False},
        config=config, data=data, max_steps=2,
    )
    # step 1's loss is the model's own loss (labels in the batch) on step 1's samples, before any update
    model = tiny_qwen3()
    ids = GlobalOrder(len(data), seed=0, shuffle=True).step_indices(0, 4)
    batch = torch.utils.data.default_collate([data[i] for i in ids])
    with torch.no_grad():
        expected = model(**batch).loss.item()
    assert len(result.losses) == 2
    assert result.losses[0] == pytest.approx(expected, rel=1e-6)
    assert result.losses[1] != result.losses[0]
