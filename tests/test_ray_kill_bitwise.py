"""Deterministic mode survives a SIGKILL: one worker killed at a random step (three seeds), `fit` restarts it
from the latest checkpoint, and the run ends with the same weights, bit for bit, as an uninterrupted run,
having trained on every sample of every step exactly once (real Ray cluster, real SIGKILL)."""

from __future__ import annotations

import os
import random

import pytest
import torch

import rayzero
from distributed import run_distributed
from ray_cases import CONFIG, KillOnce, Regression, cpu_fit, expected_samples, final_samples, model_factory, mse
import shared_ray

ray = pytest.importorskip("ray")
SHARED_RAY = True  # runs on the suite's one local cluster (tests/shared_ray.py)
TESTS = os.path.dirname(os.path.abspath(__file__))
STEPS = 9
EVERY = 2  # checkpoint_every
DETERMINISTIC = {**CONFIG, "deterministic": True}


@pytest.fixture(scope="module", autouse=True)
def ray_cluster():
    yield shared_ray.start()  # the suite's one cluster (tests/shared_ray.py)


def _fit(tmp_path, name: str, train_step=None) -> rayzero.Result:
    return rayzero.fit(
        model_factory,
        {"workers": 2, "storage": str(tmp_path), "name": name, "checkpoint_every": EVERY, "max_failures": 2,
         "progress": False},
        config=DETERMINISTIC,
        data=Regression(),
        loss_fn=mse if train_step is None else None,
        train_step=train_step,
        max_steps=STEPS,
        record_samples=True,
    )


def _weights(result: rayzero.Result, out: str) -> dict[str, torch.Tensor]:
    from rayzero.checkpoint.tools import export

    assert result.checkpoint.endswith(f"checkpoint_step{STEPS:08d}"), result.checkpoint
    export(result.checkpoint, out)
    return torch.load(out)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """The run without a kill: the worker's own steps without Ray (ray_cases.cpu_fit, which
    tests/test_ray_fit.py checks against ``rayzero.fit`` bit for bit), its losses and final weights."""
    from rayzero.checkpoint.tools import export

    tmp = tmp_path_factory.mktemp("straight")
    losses = run_distributed(cpu_fit, 2, [{"name": "straight", "config": DETERMINISTIC}], STEPS, str(tmp))[0][0]
    export(str(tmp / "straight"), str(tmp / "straight.pt"), tag=f"checkpoint_step{STEPS:08d}")
    return losses, torch.load(tmp / "straight.pt")


@pytest.mark.parametrize("seed", [5, 7])  # rank 1 at step 5, rank 0 at step 3 (a kill of either rank, mid-run)
def test_sigkill_at_a_random_step_ends_bitwise_like_an_uninterrupted_run(tmp_path, uninterrupted, seed):
    straight_losses, weights = uninterrupted
    rng = random.Random(seed)
    step, rank = rng.randrange(1, STEPS - 1), rng.randrange(2)
    marker = str(tmp_path / "killed-once")
    result = _fit(tmp_path, f"kill{seed}", KillOnce(marker, rank=rank, step=step))
    assert os.path.exists(marker), f"rank {rank} was never killed at step {step}"
    # killed while computing step ``step + 1``; the restart resumed from the latest checkpoint Ray had
    # committed by then (``step`` rounded down to a checkpoint, or the one before it when the kill beat that
    # one's report) and redid the steps after it
    history = [r["step"] for r in result.history]
    latest = step - step % EVERY
    assert history[:step] == list(range(1, step + 1)), history
    resumed = [list(range(start + 1, STEPS + 1)) for start in (latest, max(latest - EVERY, 0))]
    assert history[step:] in resumed, history
    # the steps that counted (a restart's later records win) read every sample of every step exactly once
    assert final_samples(os.path.join(result.run_dir, "samples.jsonl")) == expected_samples(STEPS, 12, 96)
    # every step's loss, and the final weights, as the run without a kill
    assert result.losses == straight_losses
    got = _weights(result, str(tmp_path / "killed.pt"))
    assert list(got) == list(weights)
    for name in weights:
        assert torch.equal(got[name], weights[name]), f"seed {seed} (rank {rank} killed at step {step}): {name}"
