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


def _records(run_dir: str) -> list[dict]:
    out = []
    for line in open(os.path.join(run_dir, "metrics.jsonl")):
        try:
            out.append(json.loads(line))
        except ValueError:
            pass
    return out


PREEMPT_DEADLINE_S = 12  # the notice's deadline (a cloud gives 30 s to 2 min; short here for the suite's time)


def _drain_for_preemption(cluster, node, deadline_s: float) -> None:
    """What a cloud provider's spot reclaim does through Ray (autoscaler v2, or ``ray drain-node --reason
    DRAIN_NODE_REASON_PREEMPTION --deadline-remaining-seconds N``): the node is draining, to be taken away at
    its deadline."""
    from ray.core.generated import autoscaler_pb2

    gcs = ray._raylet.GcsClient(address=cluster.gcs_address)
    accepted, why = gcs.drain_node(node.node_id, autoscaler_pb2.DrainNodeReason.Value("DRAIN_NODE_REASON_PREEMPTION"),
                                   "test: the node's spot instance is reclaimed", int((time.time() + deadline_s) * 1000))
    assert accepted, why


def _grow_and_shrink(tmp_path, monkeypatch, *, workers, head_cpus, node_cpus, factory, config, name,
                     preempt: bool = False):
    """Start at ``workers[0]`` on the head, add a node (the run grows), remove it (it shrinks back).  With
    ``preempt``, the node first gets a preemption notice (drained with a ``PREEMPT_DEADLINE_S`` deadline) and is
    removed at its deadline, as a provider takes a reclaimed node."""
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
                # a preemption is not a failure: with a notice, none is allowed
                {"workers": workers, "storage": str(tmp_path), "name": name, "checkpoint_every": 5,
                 "max_failures": 0 if preempt else 5, "elastic_check_interval_s": 2, "progress": False},
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
        if preempt:
            notice = time.time()
            _drain_for_preemption(cluster, node, deadline_s=PREEMPT_DEADLINE_S)
            _wait(lambda: any(r.get("preempted") for r in _records(run_dir)), 60, "the checkpoint at the notice", box)
            # the provider takes the node after its deadline, once Ray Train has moved the run off it (taken at
            # the deadline itself, its workers may die before Ray Train's teardown: a failure, not a preemption,
            # which would then resume from the same checkpoint)
            time.sleep(max(0.0, notice + PREEMPT_DEADLINE_S + 5 - time.time()))
            cluster.remove_node(node)
        else:
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
    if preempt:
        # the workers saved a checkpoint at the step the notice reached them, and the run went on from it on the
        # head alone: the next step trained is the one after it, nothing redone
        records = _records(run_dir)
        at = [i for i, r in enumerate(records) if r.get("preempted")]
        assert len(at) == 1, [r["step"] for r in records if r.get("preempted")]
        noticed, after = records[at[0]], records[at[0] + 1]
        assert noticed["world_size"] == large and after["world_size"] == small
        assert after["step"] == noticed["step"] + 1
        print(f"preemption notice to the checkpoint: {noticed['time'] - notice:.1f} s; to the first step on the "
              f"nodes that stay: {after['time'] - notice:.1f} s (deadline {PREEMPT_DEADLINE_S} s)")
    assert result.world_sizes[0] == small and large in result.world_sizes and result.world_sizes[-1] == small
    for r in result.history:  # the same global batch at every world size
        assert r["micro_batch"] * r["accumulation"] * r.get("dp", r["world_size"]) == config["train_batch_size"]
    # none repeated, none skipped: every step's samples are exactly the planned ones
    assert final_samples(os.path.join(run_dir, "samples.jsonl")) == expected_samples(steps, 12, 96)
    assert len(result.losses) == steps
    return result


def test_grow_and_shrink_keep_the_global_batch_and_every_sample(tmp_path, monkeypatch):
    """Grows onto a second node, which then gets a preemption notice: the run saves at once and goes on without
    it (the node lost without a notice: the expert-parallel test below)."""
    _grow_and_shrink(tmp_path, monkeypatch, workers=(1, 3), head_cpus=1, node_cpus=2, factory=model_factory,
                     config=CONFIG, name="elastic", preempt=True)


def test_expert_parallel_run_grows_and_shrinks_resharding_experts(tmp_path, monkeypatch):
    """EP=2 from 2 workers (one EP group) to 4 (two EP groups, experts also data-parallel) and back: every
    resize reloads the experts from the universal checkpoint into the new expert-data-parallel layout."""
    result = _grow_and_shrink(tmp_path, monkeypatch, workers=(2, 4), head_cpus=2, node_cpus=2,
                              factory=moe_factory, config=MOE_CONFIG, name="elastic_ep")
    assert all(r["ep"] == 2 and r["dp"] == r["world_size"] for r in result.history)
    assert all(math.isfinite(loss) for loss in result.losses)
