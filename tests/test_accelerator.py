"""Accelerator protocol, registry, and container-aware memory limits."""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from rayzero.accelerator import (
    ACCELERATOR_ENV_VAR,
    Accelerator,
    get_accelerator,
    register_accelerator,
    registered_accelerators,
)
from rayzero.accelerator import memory_limits as ml
from rayzero.accelerator.cpu import CpuAccelerator, CpuEvent, CpuStream

GiB = 1024**3
MiB = 1024**2
REPO_ROOT = Path(__file__).resolve().parents[1]


# ---- fake cgroup trees --------------------------------------------------------------


def write_files(directory: Path, files: dict[str, object]) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    for name, value in files.items():
        (directory / name).write_text(f"{value}\n")


def proc_cgroup_file(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "proc_self_cgroup"
    path.write_text(textwrap.dedent(text).lstrip())
    return path


def test_parse_proc_cgroup_v2_v1_and_hybrid() -> None:
    assert ml.parse_proc_cgroup("0::/user.slice/job\n") == ("/user.slice/job", None)
    v1 = "12:cpu,cpuacct:/docker/abc\n5:memory:/docker/abc\n1:name=systemd:/docker/abc\n"
    assert ml.parse_proc_cgroup(v1) == (None, "/docker/abc")
    hybrid = "4:memory:/a/b\n0::/\n"
    assert ml.parse_proc_cgroup(hybrid) == ("/", "/a/b")
    # A path may itself contain ':'; only the first two separators split.
    assert ml.parse_proc_cgroup("0::/odd:name\n").v2_path == "/odd:name"


def test_cgroup_v2_limit_at_leaf(tmp_path: Path) -> None:
    root = tmp_path / "cgroup"
    write_files(root, {"cgroup.controllers": "memory"})
    write_files(root / "kubepods", {"memory.max": "max", "memory.current": 5 * GiB})
    leaf = root / "kubepods" / "pod1"
    write_files(leaf, {"memory.max": 2 * GiB, "memory.current": 512 * MiB})
    proc = proc_cgroup_file(tmp_path, "0::/kubepods/pod1\n")

    found = ml.cgroup_v2_limit(root, proc)
    assert found is not None
    assert found.source == ml.SOURCE_CGROUP_V2
    assert found.total_bytes == 2 * GiB
    assert found.available_bytes == 2 * GiB - 512 * MiB
    assert found.detail == str(leaf)


def test_cgroup_v2_smaller_ancestor_wins_and_inactive_cache_is_reclaimable(tmp_path: Path) -> None:
    root = tmp_path / "cgroup"
    parent = root / "slice"
    leaf = parent / "job"
    write_files(parent, {"memory.max": 1 * GiB, "memory.current": 900 * MiB,
                         "memory.stat": f"anon 1\ninactive_file {100 * MiB}\n"})
    write_files(leaf, {"memory.max": 4 * GiB, "memory.current": 300 * MiB})
    proc = proc_cgroup_file(tmp_path, "0::/slice/job\n")

    found = ml.cgroup_v2_limit(root, proc)
    assert found is not None
    assert found.total_bytes == 1 * GiB
    assert found.detail == str(parent)
    # The parent's working set (900 MiB - 100 MiB inactive file cache) bounds the headroom.
    assert found.available_bytes == 1 * GiB - 800 * MiB


def test_cgroup_v2_max_everywhere_falls_back_to_host(tmp_path: Path) -> None:
    root = tmp_path / "cgroup"
    write_files(root / "a", {"memory.max": "max", "memory.current": 1})
    write_files(root / "a" / "b", {"memory.max": "max", "memory.current": 1})
    proc = proc_cgroup_file(tmp_path, "0::/a/b\n")
    assert ml.cgroup_v2_limit(root, proc) is None

    host = ml.LimitCandidate(ml.SOURCE_HOST, 64 * GiB, 60 * GiB)
    found = [c for c in (ml.cgroup_v2_limit(root, proc), ml.cgroup_v1_limit(root, proc)) if c]
    assert ml.combine_limits([host, *found]) == ml.MemoryLimit(64 * GiB, 60 * GiB, "host", "host")


def test_cgroup_v2_namespaced_root_is_the_container(tmp_path: Path) -> None:
    # With a cgroup namespace /proc says "0::/" and the mount root carries the limit.
    root = tmp_path / "cgroup"
    write_files(root, {"memory.max": 3 * GiB, "memory.current": 1 * GiB})
    proc = proc_cgroup_file(tmp_path, "0::/\n")
    found = ml.cgroup_v2_limit(root, proc)
    assert found is not None and (found.total_bytes, found.available_bytes) == (3 * GiB, 2 * GiB)

    # A path that does not exist under the mount (host path without a namespace) also
    # falls back to the mount root rather than reporting no limit.
    proc_missing = proc_cgroup_file(tmp_path, "0::/system.slice/docker-abc.scope\n")
    found = ml.cgroup_v2_limit(root, proc_missing)
    assert found is not None and found.total_bytes == 3 * GiB


def test_cgroup_v1_limit_with_ancestor_walk(tmp_path: Path) -> None:
    root = tmp_path / "cgroup"
    mount = root / "memory"
    write_files(mount, {"memory.limit_in_bytes": ml.CGROUP_V1_PAGE_ROUNDED_MAX,
                        "memory.usage_in_bytes": 10 * GiB, "memory.use_hierarchy": 1})
    write_files(mount / "docker", {"memory.limit_in_bytes": 8 * GiB,
                                   "memory.usage_in_bytes": 7 * GiB, "memory.use_hierarchy": 1})
    leaf = mount / "docker" / "abc"
    write_files(leaf, {"memory.limit_in_bytes": 6 * GiB, "memory.usage_in_bytes": 1 * GiB,
                       "memory.stat": f"cache 1\ninactive_file 7\ntotal_inactive_file {256 * MiB}\n"})
    proc = proc_cgroup_file(tmp_path, "12:cpu,cpuacct:/docker/abc\n5:memory:/docker/abc\n")

    found = ml.cgroup_v1_limit(root, proc)
    assert found is not None
    assert found.source == ml.SOURCE_CGROUP_V1
    assert found.total_bytes == 6 * GiB
    assert found.detail == str(leaf)
    # The leaf leaves 6 GiB - (1 GiB - 256 MiB); the parent only 8 - 7 = 1 GiB.
    assert found.available_bytes == 1 * GiB


def test_cgroup_v1_unlimited_values(tmp_path: Path) -> None:
    root = tmp_path / "cgroup"
    leaf = root / "memory" / "job"
    write_files(root / "memory", {"memory.limit_in_bytes": 2**63 - 1})
    write_files(leaf, {"memory.limit_in_bytes": ml.CGROUP_V1_PAGE_ROUNDED_MAX,
                       "memory.usage_in_bytes": 1 * GiB})
    proc = proc_cgroup_file(tmp_path, "4:memory:/job\n")
    assert ml.cgroup_v1_limit(root, proc) is None

    write_files(leaf, {"memory.limit_in_bytes": 2**62})
    assert ml.cgroup_v1_limit(root, proc) is None


def test_cgroup_v1_container_root_layout(tmp_path: Path) -> None:
    # Docker mounts only the container's own cgroup at /sys/fs/cgroup/memory while
    # /proc/self/cgroup still shows the host path, which does not exist inside.
    root = tmp_path / "cgroup"
    write_files(root / "memory", {"memory.limit_in_bytes": 512 * MiB,
                                  "memory.usage_in_bytes": 128 * MiB})
    proc = proc_cgroup_file(tmp_path, "5:memory:/docker/0123456789abcdef\n")
    found = ml.cgroup_v1_limit(root, proc)
    assert found is not None
    assert (found.total_bytes, found.available_bytes) == (512 * MiB, 384 * MiB)
    assert found.detail == str(root / "memory")


def test_cgroup_v1_ancestor_without_hierarchy_does_not_apply(tmp_path: Path) -> None:
    root = tmp_path / "cgroup"
    mount = root / "memory"
    write_files(mount / "p", {"memory.limit_in_bytes": 1 * GiB, "memory.use_hierarchy": 0})
    write_files(mount / "p" / "c", {"memory.limit_in_bytes": 4 * GiB, "memory.usage_in_bytes": 0})
    proc = proc_cgroup_file(tmp_path, "5:memory:/p/c\n")
    found = ml.cgroup_v1_limit(root, proc)
    assert found is not None and found.total_bytes == 4 * GiB


def test_missing_cgroup_files_mean_no_limit(tmp_path: Path) -> None:
    proc = tmp_path / "does-not-exist"
    assert ml.cgroup_v2_limit(tmp_path, proc) is None
    assert ml.cgroup_v1_limit(tmp_path, proc) is None


def test_rlimit_candidates_from_injected_getrlimit() -> None:
    limits = {resource.RLIMIT_AS: (8 * GiB, resource.RLIM_INFINITY),
              resource.RLIMIT_DATA: (resource.RLIM_INFINITY, resource.RLIM_INFINITY)}
    usage = ml.ProcessMemoryUsage(virtual_bytes=3 * GiB, data_bytes=1 * GiB)
    found = ml.rlimit_limits(limits.__getitem__, usage)
    assert found == [ml.LimitCandidate(ml.SOURCE_RLIMIT_AS, 8 * GiB, 5 * GiB)]

    limits[resource.RLIMIT_DATA] = (2 * GiB, 4 * GiB)
    found = ml.rlimit_limits(limits.__getitem__, usage)
    assert ml.LimitCandidate(ml.SOURCE_RLIMIT_DATA, 2 * GiB, 1 * GiB) in found

    unlimited = {k: (resource.RLIM_INFINITY, resource.RLIM_INFINITY) for k in limits}
    assert ml.rlimit_limits(unlimited.__getitem__, usage) == []


def test_combine_limits_takes_the_minimum_of_everything() -> None:
    host = ml.LimitCandidate(ml.SOURCE_HOST, 64 * GiB, 50 * GiB)
    v2 = ml.LimitCandidate(ml.SOURCE_CGROUP_V2, 16 * GiB, 15 * GiB)
    v1 = ml.LimitCandidate(ml.SOURCE_CGROUP_V1, 32 * GiB, 2 * GiB)  # roomy but nearly full
    rl_as = ml.LimitCandidate(ml.SOURCE_RLIMIT_AS, 12 * GiB, 9 * GiB)
    rl_data = ml.LimitCandidate(ml.SOURCE_RLIMIT_DATA, 20 * GiB, 18 * GiB)

    result = ml.combine_limits([host, v2, v1, rl_as, rl_data])
    assert result == ml.MemoryLimit(12 * GiB, 2 * GiB, ml.SOURCE_RLIMIT_AS, ml.SOURCE_CGROUP_V1)
    assert ml.combine_limits([host]).source == "host"
    # A cgroup limit equal to host RAM is reported as host (earlier candidate wins ties).
    same = ml.LimitCandidate(ml.SOURCE_CGROUP_V2, 64 * GiB, 64 * GiB)
    assert ml.combine_limits([host, same]).source == "host"
    # Headroom never exceeds the total.
    weird = ml.LimitCandidate(ml.SOURCE_HOST, 4 * GiB, 8 * GiB)
    assert ml.combine_limits([weird]).available_bytes == 4 * GiB
    with pytest.raises(ValueError, match="host_limit"):
        ml.combine_limits([])


def test_detect_memory_limit_uses_fake_cgroup_tree(tmp_path: Path) -> None:
    root = tmp_path / "cgroup"
    write_files(root / "job", {"memory.max": 64 * MiB, "memory.current": 16 * MiB})
    proc = proc_cgroup_file(tmp_path, "0::/job\n")
    limit = ml.detect_memory_limit(root, proc)
    assert limit.total_bytes == 64 * MiB
    assert limit.source == ml.SOURCE_CGROUP_V2
    assert 0 <= limit.available_bytes <= 48 * MiB

    accel = CpuAccelerator(cgroup_root=str(root), proc_cgroup=str(proc))
    assert accel.total_memory() == 64 * MiB
    assert accel.available_memory() <= 48 * MiB


RLIMIT_PROBE = textwrap.dedent(
    """
    import json, resource, sys
    from rayzero.accelerator import memory_limits as ml
    from rayzero.accelerator.cpu import CpuAccelerator

    which = getattr(resource, sys.argv[1])
    accel = CpuAccelerator()
    host_total = ml.host_limit().total_bytes
    used = ml.process_memory_usage()
    base = used.virtual_bytes if sys.argv[1] == "RLIMIT_AS" else used.data_bytes
    # Headroom of 256 MiB above what is mapped now, rounded to a page.
    limit = (base + 256 * 2**20) // 4096 * 4096
    resource.setrlimit(which, (limit, resource.getrlimit(which)[1]))
    info = accel.memory_limit()
    print(json.dumps({"limit": limit, "host_total": host_total, "total": accel.total_memory(),
                      "available": accel.available_memory(), "source": info.source}))
    """
)


@pytest.mark.parametrize("which", ["RLIMIT_AS", "RLIMIT_DATA"])
def test_real_rlimit_bounds_cpu_memory(which: str) -> None:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")])))
    proc = subprocess.run(
        [sys.executable, "-c", RLIMIT_PROBE, which],
        capture_output=True, text=True, env=env, timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    limit = report["limit"]
    if limit >= report["host_total"]:
        pytest.skip(f"process already maps {limit} bytes, more than host RAM; an rlimit cannot win")
    # If a cgroup limit is even smaller it wins; either way the rlimit is an upper bound.
    assert report["total"] <= limit
    if report["source"] == which:
        assert report["total"] == limit
    assert 0 < report["available"] <= 256 * MiB


# ---- CPU accelerator protocol ---------------------------------------------------------


def test_cpu_accelerator_devices_and_capabilities() -> None:
    accel = CpuAccelerator()
    assert isinstance(accel, Accelerator)
    assert accel.name == "cpu"
    assert accel.device() == torch.device("cpu")
    assert accel.device(3) == torch.device("cpu")
    assert accel.device_count() == 1
    assert accel.current_device_index() == 0
    accel.set_device(2)  # any local rank is accepted on CPU
    with pytest.raises(ValueError, match="-1"):
        accel.set_device(-1)
    accel.synchronize()
    assert accel.communication_backend() == "gloo"
    assert accel.is_bf16_supported() and accel.is_fp16_supported()
    assert accel.supports_fused_optimizer()
    from rayzero.accelerator.graphs import cpu_compiler_available

    assert accel.supports_graph_capture() is cpu_compiler_available()  # inductor compiles C++


def test_cpu_fused_optimizer_claim_holds() -> None:
    param = torch.nn.Parameter(torch.ones(4))
    param.grad = torch.ones(4)
    torch.optim.AdamW([param], lr=0.1, fused=CpuAccelerator().supports_fused_optimizer()).step()
    assert torch.all(param < 1)


def test_cpu_streams_and_events_are_sane_no_ops() -> None:
    accel = CpuAccelerator()
    side = accel.stream()
    assert isinstance(side, CpuStream)
    current = accel.current_stream()
    with accel.stream_context(side) as entered:
        assert entered is side
        x = torch.arange(4.0) * 2
    side.wait_stream(current)
    current.wait_stream(side)
    assert side.query()
    side.synchronize()

    start, end = accel.Event(enable_timing=True), accel.Event(enable_timing=True)
    assert isinstance(start, CpuEvent)
    start.record(current)
    x = x + 1
    end.record()
    end.wait(side)
    side.wait_event(end)
    end.synchronize()
    assert end.query()
    assert start.elapsed_time(end) >= 0.0
    recorded = side.record_event()
    assert recorded.query()
    with pytest.raises(RuntimeError, match="enable_timing"):
        accel.Event().elapsed_time(accel.Event())
    with pytest.raises(RuntimeError, match="record"):
        accel.Event(enable_timing=True).elapsed_time(accel.Event(enable_timing=True))
    assert x.tolist() == [1.0, 3.0, 5.0, 7.0]
    with accel.stream_context(None):
        pass


def test_cpu_pin_memory_without_cuda_returns_the_tensor() -> None:
    tensor = torch.ones(3)
    pinned = CpuAccelerator().pin_memory(tensor)
    if torch.cuda.is_available():
        assert pinned.is_pinned()
    else:
        assert pinned is tensor


def test_cpu_memory_figures() -> None:
    accel = CpuAccelerator()
    total, available = accel.total_memory(), accel.available_memory()
    assert 0 < available <= total
    rss = accel.memory_allocated()
    assert rss > 0
    accel.reset_peak_memory_stats()
    block = torch.ones(64 * MiB // 4)  # touch 64 MiB so RSS really grows
    block.add_(1)
    peak = accel.max_memory_allocated()
    assert peak >= accel.memory_allocated() >= rss
    del block


def test_cpu_rng_state_round_trip() -> None:
    accel = CpuAccelerator()
    accel.manual_seed(1234)
    state = accel.get_rng_state()
    first = torch.rand(5)
    accel.set_rng_state(state)
    assert torch.equal(torch.rand(5), first)
    accel.manual_seed(1234)
    assert torch.equal(torch.rand(5), first)


def test_cpu_set_deterministic_toggles_torch_flag() -> None:
    accel = CpuAccelerator()
    before = torch.are_deterministic_algorithms_enabled()
    try:
        accel.set_deterministic(True)
        assert torch.are_deterministic_algorithms_enabled()
        accel.set_deterministic(False)
        assert not torch.are_deterministic_algorithms_enabled()
    finally:
        torch.use_deterministic_algorithms(before)


# ---- registry -------------------------------------------------------------------------


def test_get_accelerator_auto_env_and_cache(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ACCELERATOR_ENV_VAR, raising=False)
    auto = get_accelerator()
    assert auto.name == ("cuda" if torch.cuda.is_available() else "cpu")
    assert get_accelerator() is auto

    monkeypatch.setenv(ACCELERATOR_ENV_VAR, " CPU ")
    cpu = get_accelerator()
    assert cpu.name == "cpu" and cpu is get_accelerator("cpu")
    assert {"cpu", "cuda"} <= set(registered_accelerators())


def test_get_accelerator_unknown_name_lists_registered(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ValueError, match=r"'tpu'.*registered: .*cpu.*cuda"):
        get_accelerator("tpu")
    monkeypatch.setenv(ACCELERATOR_ENV_VAR, "npu")
    with pytest.raises(ValueError, match=ACCELERATOR_ENV_VAR):
        get_accelerator()


def test_register_accelerator_plugin() -> None:
    class HostClone(CpuAccelerator):
        name = "test-host-clone"

    register_accelerator("test-host-clone", HostClone)
    first = get_accelerator("test-host-clone")
    assert isinstance(first, HostClone) and first is get_accelerator("test-host-clone")
    with pytest.raises(ValueError, match="replace=True"):
        register_accelerator("test-host-clone", HostClone)
    register_accelerator("test-host-clone", HostClone, replace=True)
    assert get_accelerator("test-host-clone") is not first

    register_accelerator("test-not-an-accelerator", object)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="object"):
        get_accelerator("test-not-an-accelerator")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error raised without CUDA")
def test_cuda_accelerator_without_cuda_explains() -> None:
    from rayzero.accelerator.cuda import CudaAccelerator  # importing must work without CUDA

    with pytest.raises(RuntimeError, match="RAYZERO_ACCELERATOR=cpu"):
        CudaAccelerator()


# ---- CUDA accelerator (needs a GPU) ---------------------------------------------------

requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@requires_cuda
def test_cuda_accelerator_protocol() -> None:
    from rayzero.accelerator.cuda import CudaAccelerator

    accel = CudaAccelerator()
    assert accel.name == "cuda" and accel.communication_backend() == "nccl"
    accel.set_device(0)
    assert accel.device() == torch.device("cuda", 0)
    assert accel.device_count() >= 1
    with pytest.raises(ValueError, match="out of range"):
        accel.set_device(accel.device_count())
    side = accel.stream()
    start, end = accel.Event(enable_timing=True), accel.Event(enable_timing=True)
    start.record()
    side.wait_stream(accel.current_stream())  # side work starts after queued default-stream work
    with accel.stream_context(side):
        assert accel.current_stream() == side
        y = torch.ones(1024, device=accel.device()) * 3
    accel.current_stream().wait_stream(side)
    end.record()
    accel.synchronize()
    assert start.elapsed_time(end) >= 0
    assert float(y.sum()) == 3 * 1024
    assert accel.pin_memory(torch.ones(4)).is_pinned()
    assert accel.supports_graph_capture() is True  # CUDA graphs


@requires_cuda
def test_cuda_memory_and_rng() -> None:
    from rayzero.accelerator.cuda import CudaAccelerator

    accel = CudaAccelerator()
    total = accel.total_memory()
    assert 0 < accel.available_memory() <= total
    accel.reset_peak_memory_stats()
    before = accel.memory_allocated()
    block = torch.empty(32 * MiB, dtype=torch.uint8, device=accel.device())
    assert accel.memory_allocated() >= before + 32 * MiB
    assert accel.max_memory_allocated() >= accel.memory_allocated()
    del block

    accel.manual_seed(7)
    state = accel.get_rng_state()
    first = torch.rand(8, device=accel.device())
    accel.set_rng_state(state)
    assert torch.equal(torch.rand(8, device=accel.device()), first)

    previous = torch.are_deterministic_algorithms_enabled()
    try:
        accel.set_deterministic(True)
        assert os.environ["CUBLAS_WORKSPACE_CONFIG"] in (":4096:8", ":16:8")
        assert torch.backends.cudnn.deterministic and not torch.backends.cudnn.benchmark
    finally:
        accel.set_deterministic(False)
        torch.use_deterministic_algorithms(previous)
