"""Swap directories without Ray (rayzero/offload/swap_dirs.py) and the offload arithmetic (rayzero/offload/plan.py)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest

import rayzero
from rayzero.offload import swap_dirs
from rayzero.memory import ram_bytes_per_param, swap_bytes_per_rank
from rayzero.offload.plan import resolve_auto_offload
from rayzero.offload.swap_dirs import SWAP_DIR_ENV, acquire_swap_dir, hostname, pid_alive, write_owner

MIB = 1 << 20


@pytest.fixture(autouse=True)
def _no_leased_dir(monkeypatch):
    monkeypatch.delenv(SWAP_DIR_ENV, raising=False)


def _dead_pid() -> int:
    """The pid of a process that ran and was reaped: a real dead pid (until the kernel hands it out again)."""
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    assert not pid_alive(proc.pid)
    return proc.pid


def test_local_lease_is_a_fresh_directory_that_release_removes(tmp_path):
    lease = acquire_swap_dir(tmp_path, rank=3)
    assert lease.owned_by_engine
    assert lease.path == tmp_path / "rayzero-swap" / f"{hostname()}-{os.getpid()}-rank3"
    owner = json.loads((lease.path / swap_dirs.OWNER_FILE).read_text())
    assert owner["pid"] == os.getpid() and owner["hostname"] == hostname() and owner["rank"] == 3
    (lease.path / "master.0").write_bytes(b"x" * 4096)
    lease.release()
    lease.release()  # idempotent
    assert list(tmp_path.iterdir()) == []  # the directory and the then-empty rayzero-swap are gone


def test_two_engines_of_one_rank_in_one_process_get_two_directories(tmp_path):
    a, b = acquire_swap_dir(tmp_path, 0), acquire_swap_dir(tmp_path, 0)
    assert a.path != b.path and a.path.is_dir() and b.path.is_dir()
    a.release()
    assert b.path.is_dir()
    b.release()


def test_dead_owners_directories_are_removed_when_the_next_run_starts(tmp_path):
    root = tmp_path / "rayzero-swap"
    dead = _dead_pid()
    stale = root / f"{hostname()}-{dead}-rank0"  # a SIGKILLed run's directory, marker and all
    stale.mkdir(parents=True)
    (stale / "master.0").write_bytes(b"x")
    (stale / swap_dirs.OWNER_FILE).write_text(json.dumps({"hostname": hostname(), "pid": dead, "create_time": 1.0}))
    no_marker = root / f"{hostname()}-{dead}-rank1"  # killed between mkdir and the marker
    no_marker.mkdir()
    # a live pid whose start time is not the recorded one: the pid was reused, the owner is gone
    reused = root / f"{hostname()}-{os.getpid()}-rank7"
    reused.mkdir()
    (reused / swap_dirs.OWNER_FILE).write_text(json.dumps({"hostname": hostname(), "pid": os.getpid(),
                                                           "create_time": 12345.0}))
    # kept: another host's directory (nvme_path may be shared), a live owner's, and anything not ours
    other_host = root / f"not-{hostname()}-{dead}-rank0"
    other_host.mkdir()
    (other_host / swap_dirs.OWNER_FILE).write_text(json.dumps({"hostname": "not-" + hostname(), "pid": dead}))
    live = root / "some-run"
    live.mkdir()
    write_owner(live, os.getppid())
    unrelated = root / "notes"
    unrelated.mkdir()

    lease = acquire_swap_dir(tmp_path, 0)
    left = sorted(p.name for p in root.iterdir())
    assert left == sorted([lease.path.name, other_host.name, live.name, unrelated.name])
    lease.release()


def test_a_sigkilled_run_leaves_nothing_once_the_next_starts(tmp_path):
    code = ("import sys, time; from rayzero.offload.swap_dirs import acquire_swap_dir; "
            "l = acquire_swap_dir(sys.argv[1], 0); (l.path / 'optim.0').write_bytes(b'x' * 8192); "
            "print(l.path, flush=True); time.sleep(60)")
    proc = subprocess.Popen([sys.executable, "-c", code, str(tmp_path)], stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": os.path.dirname(os.path.dirname(rayzero.__file__))})
    path = proc.stdout.readline().strip()
    assert os.path.isdir(path)
    # while it runs, a new run keeps its files
    lease = acquire_swap_dir(tmp_path, 0)
    assert os.path.isdir(path)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    lease.release()
    lease = acquire_swap_dir(tmp_path, 0)
    assert not os.path.exists(path)
    lease.release()
    assert list(tmp_path.iterdir()) == []


def test_leased_directory_from_the_environment_is_used_as_is(tmp_path, monkeypatch):
    given = tmp_path / "run" / "rank0-pid1"
    monkeypatch.setenv(SWAP_DIR_ENV, str(given))
    lease = acquire_swap_dir(tmp_path / "ignored", 0)
    assert lease.path == given and not lease.owned_by_engine and given.is_dir()
    (given / "a").write_bytes(b"x")
    (given / "sub").mkdir()
    (given / "sub" / "b").write_bytes(b"y")
    lease.release()
    assert given.is_dir() and list(given.iterdir()) == []  # emptied; the directory is the actor's
    assert not (tmp_path / "ignored").exists()


def test_bad_nvme_paths_name_the_path_and_the_fix(tmp_path):
    a_file = tmp_path / "a-file"
    a_file.write_text("x")
    with pytest.raises(rayzero.ConfigError, match=r"nvme_path '.*a-file' is not a directory; set .*nvme_path"):
        acquire_swap_dir(a_file, 0)
    with pytest.raises(PermissionError, match=r"cannot create the swap directory '.*a-file/x/rayzero-swap'.*point "
                                              r"nvme_path at a directory"):
        acquire_swap_dir(a_file / "x", 0)
    if os.getuid() != 0:  # root writes anywhere
        locked = tmp_path / "locked"
        locked.mkdir(mode=0o500)
        with pytest.raises(PermissionError, match="locked"):
            acquire_swap_dir(locked, 0)


def test_pid_alive_checks_the_start_time():
    from rayzero.offload.swap_dirs import process_start_time

    me = process_start_time(os.getpid())
    assert pid_alive(os.getpid()) and pid_alive(os.getpid(), me)
    assert not pid_alive(os.getpid(), me - 100)  # the same pid, a different (earlier) process
    assert not pid_alive(_dead_pid())
    assert not pid_alive(0)


# ---- plan.py ------------------------------------------------------------------------------------------
def test_swap_bytes_per_rank():
    # 8M parameters over 4 ranks: 2M elements each; master, gradient and 2 AdamW moments, 8 MiB each (whole blocks)
    assert swap_bytes_per_rank(8 * MIB, 2, 4) == 4 * 8 * MIB
    assert swap_bytes_per_rank(8 * MIB, 2, 4, optimizer_bytes=12) == 5 * 8 * MIB  # amsgrad: 3 states
    assert swap_bytes_per_rank(8 * MIB, 2, 4, optimizer_bytes=0) == 2 * 8 * MIB  # SGD: the master and gradient
    # each sub-group's file rounds up to the block: 10 elements in sub-groups of 4 -> 4, 4, 2 -> 3 blocks
    assert swap_bytes_per_rank(10, 1, 1, block=4096, sub_group_size=4) == 4 * 3 * 4096
    assert swap_bytes_per_rank(10, 1, 1, block=1, sub_group_size=4) == 4 * 10 * 4
    # stage 0 is not partitioned; the parameter partition in the compute dtype with offload_param
    assert swap_bytes_per_rank(100, 0, 4, block=1) == 4 * 100 * 4
    assert swap_bytes_per_rank(100, 3, 4, block=1, param_bytes=2) == 4 * 25 * 4 + 25 * 2
    assert swap_bytes_per_rank(100, 3, 4, block=1, param_bytes=2, offload_optimizer=False) == 25 * 2
    assert swap_bytes_per_rank(0, 3, 4) == 0


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
@pytest.mark.parametrize("mixed", [False, True])
def test_ram_bytes_without_offload_and_with_cpu_are_the_memory_table(stage, mixed):
    from rayzero.memory import model_state_bytes_per_param

    for world in (1, 2, 4, 7):
        for opt in (0, 8, 12):
            expected = model_state_bytes_per_param(stage, world, mixed, opt)
            assert ram_bytes_per_param(stage, world, mixed, opt, "none") == pytest.approx(expected)
            # offloaded stage 1 reduces every backward into its partition: no full-size gradient buffer
            cpu = model_state_bytes_per_param(2, world, mixed, opt) if stage == 1 else expected
            assert ram_bytes_per_param(stage, world, mixed, opt, "cpu") == pytest.approx(cpu)


def test_ram_bytes_with_nvme_keep_a_compute_dtype_weight_partition():
    """With the optimizer on NVMe the master, its state and the gradient partition are on disk (the pools
    that hold the sub-groups in use are counted apart: swap_pool_bytes)."""
    W = 4
    assert ram_bytes_per_param(1, W, False, 8, "nvme") == pytest.approx(4 + 4 / W)
    assert ram_bytes_per_param(2, W, False, 8, "nvme") == pytest.approx(4 + 4 / W)
    assert ram_bytes_per_param(2, W, True, 8, "nvme") == pytest.approx(2 + 2 / W)
    assert ram_bytes_per_param(3, W, False, 8, "nvme") == pytest.approx(4 / W)
    assert ram_bytes_per_param(3, W, True, 12, "nvme") == pytest.approx(2 / W)  # moments are on disk
    assert ram_bytes_per_param(3, W, True, 8, "nvme", offload_param="nvme") == 0
    for stage in (1, 2, 3):
        assert ram_bytes_per_param(stage, W, False, 8, "nvme") < ram_bytes_per_param(stage, W, False, 8, "none")
    with pytest.raises(ValueError):
        ram_bytes_per_param(0, W, False, 8, "nvme")


def test_resolve_auto_offload():
    assert resolve_auto_offload(100, 40, 100, None) == "none"
    assert resolve_auto_offload(101, 40, 100, "/nvme") == "nvme"
    with pytest.raises(rayzero.ConfigError) as e:
        resolve_auto_offload(101, 40, 100, None, limit_source="cgroup v2 memory.max")
    msg = str(e.value)
    assert "101 bytes" in msg and "40 bytes" in msg and "100 bytes, cgroup v2 memory.max" in msg
    assert "'nvme_path' is not set; set zero_optimization.offload_optimizer.nvme_path" in msg
    with pytest.raises(rayzero.ConfigError) as e:
        resolve_auto_offload(3 << 30, 2 << 30, 1 << 30, "/nvme")
    msg = str(e.value)
    assert "cannot fit even with NVMe offload" in msg and "3.00 GiB" in msg and "2.00 GiB" in msg
    assert "limit is 1.00 GiB" in msg and "the memory limit the accelerator reports" in msg
    assert "more workers" in msg


# ---- the driver's offload planning (rayzero/train/offload_check.py), on node reports as fit gets them ------
GIB = 1 << 30


def _nodes(*gib, source="cgroup v2 memory.max"):
    return [{"hostname": f"n{i}", "memory_total": int(g * GIB), "devices": 1, "memory_source": source}
            for i, g in enumerate(gib)]


def _gib_model():
    import torch

    with torch.device("meta"):  # 2**30 parameters in 16 layers (an NVMe sub-group never splits a parameter)
        return torch.nn.Sequential(*[torch.nn.Linear(2**13, 2**13, bias=False) for _ in range(16)])


def _cfg(device, stage=3, path="/nvme"):
    from rayzero.config import Config

    return Config.from_any({"zero_optimization": {"stage": stage, "offload_optimizer": {"device": device,
                                                                                        "nvme_path": path}}})


def test_auto_offload_is_decided_on_the_node_reports():
    from rayzero.train.cluster_config import ClusterConfig
    from rayzero.train.state_memory import _check_fits
    from rayzero.train.offload_check import resolve_auto

    two = ClusterConfig.from_any({"workers": (2, 4)})
    # stage 3 on 2 workers: 8 GiB of model state each in memory; with the optimizer on NVMe 2 GiB (the
    # weight partition copy), plus a swap pool of 2 sub-groups (buffer_count 4 tensor buffers, 3 per
    # sub-group, at least 2) of 2**25 elements (one layer's partition) x 12 bytes (master, 2 moments) and the
    # gradient pool's 3 x 2**25 elements x 4 bytes
    cfg = _cfg("auto")
    note = resolve_auto(_gib_model(), cfg, two, _nodes(10, 10))
    assert cfg.zero_optimization.offload_optimizer.device == "none"
    assert note.startswith("offload_optimizer.device auto -> none: 1,073,741,824 parameters on 2 worker(s) need "
                           "8.00 GiB of model state per worker, which fit (limit 10.00 GiB, node n0's usable memory: "
                           "cgroup v2 memory.max)")
    cfg = _cfg("auto")
    note = resolve_auto(_gib_model(), cfg, two, _nodes(6, 6))
    assert cfg.zero_optimization.offload_optimizer.device == "nvme"
    assert "auto -> nvme" in note and "which do not fit; with the optimizer on NVMe they need 3.12 GiB" in note
    _check_fits(_gib_model(), cfg, two, _nodes(6, 6))  # fits only because of NVMe, and passes
    with pytest.raises(rayzero.ConfigError, match="or offload the optimizer to NVMe"):
        _check_fits(_gib_model(), _cfg("none"), two, _nodes(6, 6))
    # one node shared by both workers: the limit is half of it, and says so
    with pytest.raises(rayzero.ConfigError) as e:
        resolve_auto(_gib_model(), _cfg("auto"), two, _nodes(6))
    msg = str(e.value)
    assert "cannot fit even with NVMe offload" in msg and "limit is 3.00 GiB" in msg
    assert "the 1 node(s)' usable memory, 6.0 GiB in all, shared by 2 worker(s); node n0: cgroup v2 memory.max" in msg
    with pytest.raises(rayzero.ConfigError, match="'nvme_path' is not set"):
        resolve_auto(_gib_model(), _cfg("auto", path=None), two, _nodes(6, 6))
    cfg = _cfg("auto")
    assert "left to each worker's engine" in resolve_auto(None, cfg, two, _nodes(6, 6))
    assert cfg.zero_optimization.offload_optimizer.device == "auto"
    assert resolve_auto(_gib_model(), _cfg("nvme"), two, _nodes(6, 6)) is None


def test_swap_that_cannot_fit_a_nodes_disk_is_refused():
    from rayzero.memory import swap_bytes
    from rayzero.train.offload_check import check_swap_fits

    model, cfg = _gib_model(), _cfg("nvme")
    per_rank = swap_bytes(model, cfg, 2)
    assert per_rank == swap_bytes_per_rank(2**30, 3, 2)  # 4 x 2 GiB: master, gradient and AdamW's two moments
    assert per_rank == 8 * GIB
    cap = {"a" * 20: {"hostname": "n0", "path": "/nvme/rayzero-swap/run", "free_bytes": 13 * GIB, "error": None},
           "b" * 20: {"hostname": "n1", "path": "/nvme/rayzero-swap/run", "free_bytes": 11 * GIB, "error": None}}
    slots = {"a" * 20: ("10.0.0.1", 1), "b" * 20: ("10.0.0.2", 2)}
    with pytest.raises(rayzero.ConfigError) as e:
        check_swap_fits(model, cfg, [2, 4], slots, cap)  # n1 hosts 2 ranks of world 2: 16 GiB > 11 GiB
    msg = str(e.value)
    assert msg.startswith("the NVMe swap does not fit on node n1 (bbbbbbbbbbbb): 2 rank(s) there at world size 2 "
                          f"keep {8 * GIB:,} bytes each")
    assert f"16.00 GiB ({16 * GIB:,} bytes) under /nvme/rayzero-swap/run, and that disk has 11.00 GiB" in msg
    assert "point nvme_path at a bigger local disk" in msg
    check_swap_fits(model, cfg, [2, 4], {**slots, "b" * 20: ("10.0.0.2", 1)}, cap)  # one rank each: fits
    cap["a" * 20]["error"] = "PermissionError: no"
    with pytest.raises(rayzero.ConfigError, match=r"nvme_path cannot be used on node n0 \(aaaaaaaaaaaa\): Perm"):
        check_swap_fits(model, cfg, [2], slots, cap)


def test_nvme_paths_become_absolute_and_must_agree():
    from rayzero.config import Config
    from rayzero.train.offload_check import absolute_nvme_paths

    cfg = _cfg("nvme", path="rel/dir")
    absolute_nvme_paths(cfg)
    assert cfg.zero_optimization.offload_optimizer.nvme_path == os.path.abspath("rel/dir")
    with pytest.raises(rayzero.ConfigError, match="set both to the same path"):
        Config.from_any({"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "nvme", "nvme_path": "/a"},
                                               "offload_param": {"device": "nvme", "nvme_path": "/b"}}})
    # the same directory written two ways is one path
    same = Config.from_any({"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "nvme", "nvme_path": "rel/dir"},
                                                  "offload_param": {"device": "nvme", "nvme_path": os.path.abspath("rel/dir")}}})
    absolute_nvme_paths(same)
    assert same.zero_optimization.offload_param.nvme_path == same.zero_optimization.offload_optimizer.nvme_path


def test_swap_pool_bytes_counts_the_slots_a_step_keeps_in_memory():
    from rayzero.memory import swap_pool_bytes

    # 4 slots of a 1e6-element sub-group, each with the fp32 master and AdamW's two moments, and the gradient
    # pool's 3 buffers of a sub-group's fp32 gradient
    # buffer_count counts tensor buffers (DeepSpeed's meaning): a slot takes the master and each state tensor
    grads = 3 * 1_000_000 * 4
    assert swap_pool_bytes(16_000_000, 1_000_000, 4, 8) == 2 * 1_000_000 * 3 * 4 + grads  # 4 // 3 -> 2 slots
    assert swap_pool_bytes(16_000_000, 1_000_000, 12, 8) == 4 * 1_000_000 * 3 * 4 + grads
    assert swap_pool_bytes(16_000_000, 1_000_000, 24, 12) == 6 * 1_000_000 * 4 * 4 + grads  # amsgrad: a third state
    assert swap_pool_bytes(16_000_000, 1_000_000, 1, 0) == 2 * 1_000_000 * 4 + grads  # never fewer than 2 slots
    # no more slots, and no more gradient buffers, than sub-groups
    assert swap_pool_bytes(2_500_000, 1_000_000, 12, 8) == 3 * 1_000_000 * 12 + grads
    assert swap_pool_bytes(1_500_000, 1_000_000, 12, 8) == 2 * 1_000_000 * 12 + 2 * 1_000_000 * 4
    assert swap_pool_bytes(500, 1_000_000, 4, 8) == 500 * 16  # one sub-group smaller than sub_group_size
    assert swap_pool_bytes(0, 1_000_000, 4, 8) == 0


def test_nvme_start_up_check_counts_the_swap_pool():
    """The pool is what NVMe offload keeps in memory beside the per-parameter bytes: the engine's start-up
    check and ``auto`` count it."""
    import torch

    from rayzero.config import Config
    from rayzero.memory import pool_bytes, sub_group_size, swap_pool_bytes

    cfg = Config.from_any({"zero_optimization": {"stage": 3, "offload_optimizer": {
        "device": "nvme", "nvme_path": "/nvme", "buffer_count": 15}}})
    params = [torch.empty(4000, 1000, device="meta") for _ in range(8)]  # 32M elements, 8M per rank of 4
    sub = sub_group_size(cfg, 8_000_000, nvme=True)
    assert sub == 1_000_000  # at least 1e6 (the pools' 1/8 of the partition, over 5 x 3 + 3 sub-groups, is less)
    # 400M elements per rank: the pools (18 sub-groups' worth) hold 1/8 of the partition
    assert sub_group_size(cfg, 400_000_000, nvme=True) == -(-400_000_000 // (8 * 18))
    # a parameter's partition (1M) is one sub-group: 15 buffers make 5 slots of 1M elements x 12 bytes, and
    # the gradient pool 3 x 1M x 4 bytes
    assert pool_bytes(cfg, params, lambda p: 4) == swap_pool_bytes(8_000_000, 1_000_000, 15, 8) == \
        5 * 12_000_000 + 3 * 4_000_000
    big = [torch.empty(32_000_000, device="meta")]  # one parameter: its whole partition is one sub-group
    assert pool_bytes(cfg, big, lambda p: 4) == 8_000_000 * 16
