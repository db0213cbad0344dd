"""Copies between host and device that do not stall the host, and memory decisions from the device's memory.

The stand-in accelerators (tests/device_cases.py) record which stream is current when a copy runs, every
event, every device-side wait (``stream.wait_event``) and every host wait (``event.synchronize()``,
``stream.synchronize()``, ``synchronize()``); their events count as finished only once the host waited for
them, so every wait the code would need on a slow device shows up here.  Values are checked against the
CPU run, bit for bit.
"""

from __future__ import annotations

import hashlib
import os

import pytest
import torch

import device_cases
from device_cases import CopyLog, StandInAccelerator
from distributed import run_distributed, run_once
from rayzero.offload.staging import HostStaging


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16) if t.element_size() == 2 else t.view(torch.int32)


def test_staging_copies_on_its_stream_through_two_buffers_in_turn():
    """Each host shard is cast into one of two pinned buffers in turn and copied on the staging's own stream;
    the compute stream waits on each copy's event, and the host waits only before refilling a buffer, on
    the copy two sends back."""
    acc = StandInAccelerator()
    staging = HostStaging("cpu", torch.bfloat16, acc, through_buffer=True)
    shards = [torch.randn(100 + 10 * i, generator=torch.Generator().manual_seed(i)) for i in range(5)]
    log = CopyLog(acc, cpu_device=True)
    with log:
        outs = [staging.to_device(s) for s in shards]
    for out, s in zip(outs, shards):
        assert torch.equal(_bits(out), _bits(s.to(torch.bfloat16)))
    assert len(staging.buffers) == 2 and all(acc.is_pinned(b) for b in staging.buffers)
    assert staging.buffers[0].data_ptr() != staging.buffers[1].data_ptr()
    copy_stream = staging.copy_stream.name
    assert copy_stream != "compute"
    # the copies themselves (host buffer -> "device"): on the copy stream, non_blocking, from pinned memory
    sends = [c for c in log.copies if c["stream"] == copy_stream]
    assert len(sends) == 5 and all(c["non_blocking"] and c["pinned"] for c in sends), log.copies
    records = [e for e in acc.log if e[0] == "record"]
    assert [r[1] for r in records] == [copy_stream] * 5
    ids = [r[2] for r in records]
    # the compute stream waits on every copy's event; the host waits on the third, fourth and fifth fill
    # for the copy two before (the buffer it reuses), never for the latest one
    assert [e[2] for e in acc.log if e[0] == "wait_event" and e[1] == "compute"] == ids
    assert [e[2] for e in acc.log if e[0] == "host_wait"] == ids[:3]
    assert acc.host_waits == 3 and staging.host_waits == 3
    # a compute-stream user is recorded for every tensor the copy stream allocated
    assert sum(1 for e in acc.log if e[0] == "record_stream" and e[1] == "compute") == 5
    # before the host rewrites partitions: one wait, on the newest copy
    staging.synchronize()
    assert acc.log[-1] == ("host_wait", copy_stream, ids[-1]) and acc.host_waits == 4
    staging.synchronize()  # nothing left in flight: no wait
    assert acc.host_waits == 4


def test_staging_sends_a_pinned_partition_straight_from_it():
    acc = StandInAccelerator()
    staging = HostStaging("cpu", torch.float32, acc, through_buffer=True)
    part = torch.randn(300)
    acc.mark_pinned(part)
    out = staging.to_device(part[100:200])
    assert staging.direct.records == 1 and staging.grown == 0 and torch.equal(out, part[100:200])
    staging.synchronize()
    assert acc.host_waits == 1


@pytest.mark.parametrize("mode,bf16", [("pinned", False), ("unpinned", False), ("unpinned", True)],
                         ids=["pinned-fp32", "unpinned-fp32", "unpinned-bf16"])
def test_stage3_offload_through_the_copy_stream_trains_bitwise_like_the_cpu(mode, bf16):
    """Stage 3, optimizer offloaded to the CPU, two micro-batches per step: gathers whose host shards go
    through the staging's buffers and copy stream (or, pinned in fp32, straight from the partitions) train
    exactly as the CPU accelerator's plain casts; the compute stream waits on every copy's event and the
    host's waits per step do not grow from step to step."""
    staged = run_distributed(device_cases.stage3_staged_training, 2, mode, bf16)
    plain = run_once(device_cases.stage3_staged_training, 2, "cpu", bf16)  # shared by the two fp32 cases
    for s, p in zip(staged, plain):
        assert s["losses"] == p["losses"] and s["norms"] == p["norms"]
        for name in p["state"]:
            assert torch.equal(s["state"][name], p["state"][name]), name
        assert s["sends"] > 0 and all(s["buffers_pinned"])
        assert (s["direct"] > 0) == (mode == "pinned")
        # every send ran on the staging's stream, from pinned memory, non_blocking (the other copies out of
        # pinned masters here are host-to-host: this stand-in's "device" is the CPU)
        sent = [c for c in s["copies"] if c["stream"] == s["copy_stream"]]
        assert s["copy_stream"] != "compute" and len(sent) == s["sends"]
        assert all(c["non_blocking"] and c["pinned"] for c in sent)
        records = [e[2] for e in s["log"] if e[0] == "record" and e[1] == s["copy_stream"]]
        waited = [e[2] for e in s["log"] if e[0] == "wait_event" and e[1] == "compute"]
        assert set(records) <= set(waited) and len(records) == s["sends"]
        # (the first step records the gather order, without prefetch: its count differs)
        assert len(set(s["waits_per_step"][1:])) == 1, s["waits_per_step"]


def _reducer_and_publish_copies(step: dict) -> tuple[list, list]:
    to_host = [c for c in step["copies"] if c["to"] == "cpu"]
    to_device = [c for c in step["copies"] if c["to"] != "cpu"]
    return to_host, to_device


@pytest.mark.parametrize("pin", [True, False], ids=["pinned", "unpinned"])
def test_offloaded_reductions_and_publishing_copy_on_side_streams(pin):
    """Stage 2 with the optimizer offloaded, on the stand-in device, two micro-batches per step: each reduced
    bucket goes to the host on a side stream into a pinned buffer (non_blocking), the host waits for them
    once per reducing backward at most (not per bucket), and publishing sends every host shard to the device
    in one pinned copy per step; training equals the CPU run (to the stand-in backend's summation order)."""
    on_device = run_distributed(device_cases.offload_copies, 2, True, pin, init_pg=False)
    # pinning changes no value: both cases compare with one CPU run
    on_cpu = run_once(device_cases.offload_copies, 2, False, True)
    for d, c in zip(on_device, on_cpu):
        # as tests/test_device_backend.py: the same arithmetic, but the stand-in backend sums in its own order
        torch.testing.assert_close(d["losses"], c["losses"], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(d["norms"], c["norms"], rtol=1e-5, atol=1e-6)
        for name in c["state"]:
            torch.testing.assert_close(d["state"][name], c["state"][name], rtol=1e-5, atol=1e-6)
        assert all(d["masters_pinned"]) == pin
        assert d["buckets"] > 2
        for step in d["steps"]:
            to_host, to_device = _reducer_and_publish_copies(step)
            # reduced buckets (two backwards per step) plus the loss reads (.item(), two per step)
            buckets = [x for x in to_host if x["pinned"]]
            assert len(buckets) == 2 * d["buckets"], to_host
            assert all(x["non_blocking"] and x["stream"] != "compute" for x in buckets)
            # publishing: one copy of every shard at once, from a pinned buffer, on the staging's stream
            published = [x for x in to_device if x["stream"] != "compute"]
            assert len(published) == 1 and published[0]["non_blocking"] and published[0]["pinned"], to_device
            # at most one host wait per backward for the reductions' copies, whatever the number of buckets
            assert step["reducer_waits"] <= 2
        # the other host waits: publishing's, only once its two buffers come round (the third step), on the
        # copy of two steps before (on a real device long finished: then no wait at all)
        assert [s["host_waits"] - s["reducer_waits"] for s in d["steps"]] == [0, 0, 1], d["steps"]


def test_reducer_host_waits_do_not_grow_with_the_buckets():
    few = run_distributed(device_cases.offload_copies, 2, True, True, 4000, init_pg=False)[0]
    many = run_distributed(device_cases.offload_copies, 2, True, True, 300, init_pg=False)[0]
    assert many["buckets"] > few["buckets"]
    assert [s["reducer_waits"] for s in many["steps"]] == [s["reducer_waits"] for s in few["steps"]]
    assert [s["host_waits"] for s in many["steps"]] == [s["host_waits"] for s in few["steps"]]


def _sha(path: str) -> str:
    return hashlib.sha256(open(path, "rb").read()).hexdigest()


def test_async_save_from_device_copies_on_a_side_stream_and_equals_the_sync_save(tmp_path):
    """The async save of device tensors copies them into pinned buffers on a side stream (non_blocking,
    after an event on the compute stream), without a host wait in save_checkpoint; its files equal the sync
    save's bit for bit although training goes on while its thread (held back) copies and writes."""
    sync_dir, async_dir = str(tmp_path / "sync"), str(tmp_path / "async")
    results = run_distributed(device_cases.async_save_on_device, 2, sync_dir, async_dir, 0.5, init_pg=False)
    for r, out in enumerate(results):
        name = f"rank_{r:05d}.arrow"
        assert _sha(os.path.join(sync_dir, "t", name)) == _sha(os.path.join(async_dir, "t", name))
        from_device = [c for c in out["copies"] if c["to"] == "cpu" and c["stream"] != "compute"]
        assert from_device and all(c["non_blocking"] and c["pinned"] for c in from_device), out["copies"]
        kinds = [e[0] for e in out["order"]]
        assert "host_wait" not in kinds, out["order"]
        side = from_device[0]["stream"]
        assert ("wait_event", side) in [(e[0], e[1]) for e in out["order"]]  # after the compute stream's event


def test_auto_offload_decides_from_the_device_memory():
    """``offload_optimizer: "auto"`` on an accelerator: the model states (20 bytes per parameter at stage 2
    in fp32 on one rank) fit 100 bytes per parameter of free device memory: no offload; 10 bytes per
    parameter hold only the weights (4): the optimizer goes to the CPU, training the same; 2 bytes per
    parameter hold not even the weights: a clear error."""
    roomy = run_distributed(device_cases.auto_offload_choice, 1, 100.0)[0]
    tight = run_distributed(device_cases.auto_offload_choice, 1, 10.0)[0]
    tiny = run_distributed(device_cases.auto_offload_choice, 1, 2.0)[0]
    assert roomy["offload"] == "none", roomy
    assert tight["offload"] == "cpu", tight
    assert tight["losses"] == roomy["losses"]
    assert "cannot fit even with offload" in tiny["error"] and "available_memory" in tiny["error"], tiny


def test_fit_check_counts_the_device_and_the_host():
    """The start-up check on an accelerator: without offload the model states must fit the device's free
    memory (the error names the CPU offload as the fix); offloaded, only the weights must."""
    from rayzero.config import Config, ConfigError
    from rayzero.offload.optimizer import check_model_states_fit

    acc = StandInAccelerator()
    params = [torch.nn.Parameter(torch.zeros(1000))]
    cfg = Config.from_dict({"train_batch_size": 1, "zero_optimization": {"stage": 2}})
    acc.free_memory = 10 * 1000
    with pytest.raises(ConfigError, match="device memory.*offload the optimizer to the CPU"):
        check_model_states_fit(cfg, params, lambda p: 1, 2, "standin", "none", 0, accelerator=acc)
    check_model_states_fit(cfg, params, lambda p: 1, 2, "standin", "cpu", 0, accelerator=acc)
    acc.free_memory = 1000
    with pytest.raises(ConfigError, match="device memory"):
        check_model_states_fit(cfg, params, lambda p: 1, 2, "standin", "cpu", 0, accelerator=acc)
    # the weights the model already holds on the device count as allocated
    check_model_states_fit(cfg, params, lambda p: 1, 2, "standin", "cpu", 4000, accelerator=acc)


def test_stage3_gathers_run_on_a_second_group_of_the_same_ranks():
    """With the second group (forced here on gloo, where it is normally left out), stage 3's parameter
    gathers run on it and the bucket reductions on the domain's own group; training is bit for bit the same."""
    separate = run_distributed(device_cases.stage3_gather_group, 2, True)
    shared = run_distributed(device_cases.stage3_gather_group, 2, None)
    for s, p in zip(separate, shared):
        assert s["separate"] and s["same_ranks"] and not s["same_group"]
        assert not p["separate"]  # gloo: one group, as before
        assert s["counts"]["gather"]["all_gather"] > 0 and s["counts"]["gather"]["reduce_scatter"] == 0
        assert s["counts"]["reduce"]["reduce_scatter"] > 0
        assert s["counts"]["reduce"]["all_gather"] < p["counts"]["reduce"]["all_gather"]
        assert s["losses"] == p["losses"] and s["norms"] == p["norms"]
        for name in p["state"]:
            assert torch.equal(s["state"][name], p["state"][name]), name


def test_a_device_backend_gets_the_second_group():
    for rank, out in enumerate(run_distributed(device_cases.gather_group_on_device_backend, 2, init_pg=False)):
        assert out["has_twin"] and out["distinct"] and out["ranks"] == [0, 1] and out["backend"] == "standin"
        assert torch.equal(out["rows"], torch.tensor([[0.0] * 3, [1.0] * 3]))


def test_the_driver_decides_auto_offload_from_the_devices_memory():
    """``rayzero.fit``'s planning on GPU nodes (their reports give the device's memory, and the host's):
    stage 3 on 2 workers needs 8 GiB of model state each; 10 GiB devices hold it, 6 GiB devices do not, and
    then the optimizer goes to the CPU (8 GiB of host memory per worker), not to NVMe; the pre-launch check
    counts the device part against the device and the host part against the host."""
    import rayzero
    from rayzero.config import Config
    from rayzero.train.cluster_config import ClusterConfig
    from rayzero.train.offload_check import resolve_auto
    from rayzero.train.state_memory import _check_fits

    gib = 1 << 30

    def nodes(device_gib, host_gib):
        return [{"hostname": f"g{i}", "memory_total": int(device_gib * gib), "devices": 1, "accelerator": "cuda",
                 "memory_source": "cuda device memory", "host_memory_total": int(host_gib * gib)} for i in range(2)]

    def model():
        with torch.device("meta"):
            return torch.nn.Sequential(*[torch.nn.Linear(2**13, 2**13, bias=False) for _ in range(16)])

    def cfg(device):
        return Config.from_any({"zero_optimization": {"stage": 3, "offload_optimizer": {"device": device,
                                                                                         "nvme_path": "/nvme"}}})

    two = ClusterConfig.from_any({"workers": 2})
    roomy = cfg("auto")
    assert "auto -> none" in resolve_auto(model(), roomy, two, nodes(10, 64))
    tight = cfg("auto")
    note = resolve_auto(model(), tight, two, nodes(6, 64))
    assert tight.zero_optimization.offload_optimizer.device == "cpu", note
    assert "do not fit the device" in note
    _check_fits(model(), tight, two, nodes(6, 64))  # offloaded: nothing but activations left on the device
    with pytest.raises(rayzero.ConfigError, match="offload the optimizer to the CPU"):
        _check_fits(model(), cfg("none"), two, nodes(6, 64))
    with pytest.raises(rayzero.ConfigError, match="GiB of host memory per worker"):
        _check_fits(model(), cfg("cpu"), two, nodes(6, 4))
    small_hosts = cfg("auto")  # the host cannot take the optimizer either: NVMe
    resolve_auto(model(), small_hosts, two, nodes(6, 7))
    assert small_hosts.zero_optimization.offload_optimizer.device == "nvme"
