"""Elastic resize on a real multi-node Ray cluster (ray.cluster_utils.Cluster): grow, shrink, lose nothing."""

from __future__ import annotations

import json
import math
import os
import threading
import time

import pytest

import rayzero
from ray_cases import (
    WORKER_PYTHONPATH,
    CONFIG,
    MOE_CONFIG,
    Regression,
    expected_samples,
    final_samples,
    model_factory,
    moe_factory,
    mse,
)

ray = pytest.importorskip("ray")
from ray.cluster_utils import Cluster  # noqa: E402

TESTS = os.path.dirname(os.path.abspath(__file__))


class SlowWhileFlag:
    """A train step that takes a while as long as a flag file exists, so the test can resize mid-run."""

    def __init__(self, flag: str, delay_s: float):
        self.flag, self.delay_s = flag, delay_s

    def __call__(self, engine, batch):
        if os.path.exists(self.flag):
            time.sleep(self.delay_s)
        loss = mse(engine(batch[0]), batch)
        engine.backward(loss)
        engine.step()
        return loss


def _worlds(run_dir: str) -> list[int]:
    path = os.path.join(run_dir, "metrics.jsonl")
    if not os.path.exists(path):
        return []
    out = []
    for line in open(path):
        try:
            out.append(json.loads(line)["world_size"])
        except (ValueError, KeyError):
            pass
    return out


def _wait(pred, timeout: float, what: str, box: dict) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        if "error" in box:
            raise box["error"]
        assert "result" not in box, f"the run ended before {what}: give it more steps"
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.5)


def _grow_and_shrink(tmp_path, monkeypatch, *, workers, head_cpus, node_cpus, factory, config, name):
    """Start at ``workers[0]`` on the head, add a node (the run grows), remove it (it shrinks back)."""
    monkeypatch.setenv("PYTHONPATH", WORKER_PYTHONPATH)  # the workers import the test helpers
    monkeypatch.setenv("RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S", "15")  # shrink quickly after a node leaves
    cluster = Cluster(initialize_head=True, connect=True, head_node_args={"num_cpus": head_cpus})
    flag = str(tmp_path / "slow")
    open(flag, "w").close()
    # enough steps for both resizes while each step sleeps (they took 20 to 30 here: 3x that), not many more: after
    # the shrink the flag goes and the rest run at checkpoint speed (one every 5 steps, ~2 s each here)
    steps = 80
    small, large = workers
    run_dir = str(tmp_path / name)
    box: dict = {}

    def run():
        try:
            box["result"] = rayzero.fit(
                factory,
                {"workers": workers, "storage": str(tmp_path), "name": name, "checkpoint_every": 5,
                 "max_failures": 5, "elastic_check_interval_s": 2, "progress": False},
                config=config,
                data=Regression(),
                train_step=SlowWhileFlag(flag, 0.5),
                max_steps=steps,
                record_samples=True,
            )
        except BaseException as e:  # re-raised by the main thread
            box["error"] = e

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    try:
        _wait(lambda: len(_worlds(run_dir)) >= 3, 120, f"the first steps at world {small}", box)
        assert _worlds(run_dir)[0] == small
        node = cluster.add_node(num_cpus=node_cpus)
        _wait(lambda: large in _worlds(run_dir), 150, f"the run to grow to {large} workers", box)
        time.sleep(2)
        cluster.remove_node(node)
        _wait(lambda: _worlds(run_dir)[-1] == small and large in _worlds(run_dir), 150, "the run to shrink back", box)
        os.remove(flag)  # let the rest of the run go fast
        thread.join(timeout=240)
        assert not thread.is_alive(), "fit did not finish"
        if "error" in box:
            raise box["error"]
    finally:
        if os.path.exists(flag):
            os.remove(flag)
        thread.join(timeout=60)
        ray.shutdown()
        cluster.shutdown()

    result = box["result"]
    assert result.world_sizes[0] == small and large in result.world_sizes and result.world_sizes[-1] == small
    for r in result.history:  # the same global batch at every world size
        assert r["micro_batch"] * r["accumulation"] * r.get("dp", r["world_size"]) == config["train_batch_size"]
    # none repeated, none skipped: every step's samples are exactly the planned ones
    assert final_samples(os.path.join(run_dir, "samples.jsonl")) == expected_samples(steps, 12, 96)
    assert len(result.losses) == steps
    return result


def test_grow_and_shrink_keep_the_global_batch_and_every_sample(tmp_path, monkeypatch):
    _grow_and_shrink(tmp_path, monkeypatch, workers=(1, 3), head_cpus=1, node_cpus=2, factory=model_factory,
                     config=CONFIG, name="elastic")


def test_expert_parallel_run_grows_and_shrinks_resharding_experts(tmp_path, monkeypatch):
    """EP=2 from 2 workers (one EP group) to 4 (two EP groups, experts also data-parallel) and back: every
    resize reloads the experts from the universal checkpoint into the new expert-data-parallel layout."""
    result = _grow_and_shrink(tmp_path, monkeypatch, workers=(2, 4), head_cpus=2, node_cpus=2,
                              factory=moe_factory, config=MOE_CONFIG, name="elastic_ep")
    assert all(r["ep"] == 2 and r["dp"] == r["world_size"] for r in result.history)
    assert all(math.isfinite(loss) for loss in result.losses)
