"""The node's accelerator actor on a real Ray cluster whose node declares two GPUs: it holds them while it
probes, gives them back, and reports without them when another actor holds them."""

from __future__ import annotations

import time

import pytest

ray = pytest.importorskip("ray")


@ray.remote(num_cpus=0)
class GpuHolder:
    def gpu_ids(self) -> list:
        return ray.get_gpu_ids()


def _free_gpus(expected: float, within_s: float = 10.0) -> float:
    deadline = time.monotonic() + within_s
    while True:
        free = ray.available_resources().get("GPU", 0.0)
        if free == expected or time.monotonic() > deadline:
            return free
        time.sleep(0.2)


def test_the_agent_holds_the_nodes_gpus_while_it_probes_and_reports_without_them_when_busy():
    from ray._private.state import actors

    from rayzero.train.agent import format_node_table, node_table

    ray.init(num_cpus=2, num_gpus=2, include_dashboard=False)
    try:
        [row] = node_table()
        assert sorted(row["gpu_ids"]) == ["0", "1"] and row["note"] == ""  # Ray showed it both devices
        assert row["probe"]["bf16"] and row["probe"]["fp16"] and row["probe"]["fused_optimizer"]
        assert row["probe"]["errors"] == {}
        assert _free_gpus(2.0) == 2.0  # given back before any worker would start

        holder = GpuHolder.options(num_gpus=2).remote()
        assert len(ray.get(holder.gpu_ids.remote())) == 2
        start = time.monotonic()
        [busy] = node_table(device_wait_s=2)
        assert time.monotonic() - start < 30
        assert busy["gpu_ids"] == []
        assert busy["note"] == "its GPUs were not granted within 2 s (in use by another job?): not probed"
        assert "its GPUs were not granted" in format_node_table([busy])
        ray.kill(holder)
        assert [a for a in actors(actor_state_name="ALIVE").values() if a["ActorClassName"] == "NodeAgent"] == []
    finally:
        ray.shutdown()


def test_a_node_whose_agent_does_not_answer_is_left_out_with_a_warning(caplog):
    """Two nodes; the second one's raylet is frozen (SIGSTOP), so the cluster still lists it alive but its agent
    never starts: the table has the first node, and the warning names the second."""
    import logging
    import os
    import signal

    from ray.cluster_utils import Cluster

    from rayzero.train.agent import node_table

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1})
    try:
        worker = cluster.add_node(num_cpus=1)
        ray.init(address=cluster.address)
        cluster.wait_for_nodes()
        frozen = next(n["NodeID"] for n in ray.nodes() if n["Alive"] and n["NodeID"] == worker.node_id)
        raylet = worker.all_processes["raylet"][0].process
        os.kill(raylet.pid, signal.SIGSTOP)
        try:
            with caplog.at_level(logging.WARNING, logger="rayzero"):
                rows = node_table(timeout_s=8)
        finally:
            os.kill(raylet.pid, signal.SIGCONT)
        assert [r["node_id"] for r in rows] == [cluster.head_node.node_id]
        assert f"nodes left out of the node table: {frozen[:12]}" in caplog.text
        assert "TimeoutError: no report within 8 s" in caplog.text
    finally:
        ray.shutdown()
        cluster.shutdown()
