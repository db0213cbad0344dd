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
        assert busy["gpu_ids"] == [] and busy["note"] == "its GPUs were busy for 2 s: not probed"
        assert "its GPUs were busy" in format_node_table([busy])
        ray.kill(holder)
        assert [a for a in actors(actor_state_name="ALIVE").values() if a["ActorClassName"] == "NodeAgent"] == []
    finally:
        ray.shutdown()
