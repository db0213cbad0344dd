"""NVMe swap under Ray on a real local cluster (one per module): the per-node NodeSwapStore, the driver's
refusal of a swap that cannot fit the disk, and a fit with NVMe offload whose SIGKILLed worker leaves nothing."""

from __future__ import annotations

import functools
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch

import rayzero
from ray_cases import CONFIG, Regression, model_factory, mse
import shared_ray

ray = pytest.importorskip("ray")
SHARED_RAY = True  # runs on the suite's one local cluster (tests/shared_ray.py)
TESTS = os.path.dirname(os.path.abspath(__file__))


@pytest.fixture(scope="module", autouse=True)
def ray_cluster():
    yield shared_ray.start()  # the suite's one cluster (tests/shared_ray.py)


def _sleeper() -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])


def test_node_swap_store_leases_sweeps_dead_ranks_and_reports_capacity(tmp_path):
    from rayzero.offload.swap_dirs import OWNER_FILE, hostname
    from rayzero.train.swap_actor import node_swap_store, shutdown_stores

    root = tmp_path / "rayzero-swap"
    # a run whose store was SIGKILLed with the node's processes: its directory names an owner that is gone
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    (root / "old-run" / "rank0-pid1").mkdir(parents=True)
    (root / "old-run" / OWNER_FILE).write_text(json.dumps({"hostname": hostname(), "pid": gone.pid}))

    store = node_swap_store(str(tmp_path), "unit")
    worker = _sleeper()
    try:
        path0 = ray.get(store.lease.remote(0, worker.pid))
        assert path0 == str(root / "unit" / f"rank0-pid{worker.pid}")
        assert not (root / "old-run").exists()  # removed when this node's store started
        (root / "unit" / f"rank0-pid{worker.pid}" / "group0.master.swap").write_bytes(b"x" * (1 << 20))
        path1 = ray.get(store.lease.remote(1, os.getpid()))
        assert ray.get(store.alive.remote()) == {0: worker.pid, 1: os.getpid()}
        cap = ray.get(store.capacity.remote())
        assert cap["path"] == str(root / "unit") and cap["error"] is None
        assert cap["used_bytes"] >= 1 << 20 and cap["free_bytes"] == pytest.approx(shutil.disk_usage(tmp_path).free,
                                                                                    rel=0.01)
        worker.send_signal(signal.SIGKILL)  # rank 0 dies with its swap files in place
        worker.wait()
        again = ray.get(store.lease.remote(1, os.getpid()))  # any lease sweeps: the dead rank's files go
        assert again == path1 and not os.path.exists(path0)
        assert ray.get(store.alive.remote()) == {1: os.getpid()}
        # a rank leased again by another process (an elastic restart) loses its previous holder's directory
        other = _sleeper()
        try:
            moved = ray.get(store.lease.remote(1, other.pid))
            assert moved != path1 and os.path.isdir(moved) and not os.path.exists(path1)
            ray.get(store.release.remote(1, os.getpid()))  # not the holder any more: nothing happens
            assert os.path.isdir(moved)
            ray.get(store.release.remote(1))  # finished
            assert not os.path.exists(moved) and ray.get(store.alive.remote()) == {}
        finally:
            other.kill()
            other.wait()
        with pytest.raises(ray.exceptions.RayTaskError, match="not running on node"):
            ray.get(store.lease.remote(2, gone.pid))
    finally:
        worker.kill()
        worker.wait()
        assert shutdown_stores("unit") == 1
    assert not root.exists()  # the run's directory, and rayzero-swap with it

    a_file = tmp_path / "a-file"
    a_file.write_text("x")
    bad = node_swap_store(str(a_file), "bad")
    try:
        assert "is not a directory" in ray.get(bad.capacity.remote())["error"]
        with pytest.raises(ray.exceptions.RayTaskError, match="cannot be used on node"):
            ray.get(bad.lease.remote(0, os.getpid()))
    finally:
        shutdown_stores("bad")


NVME_BIG = {
    "train_batch_size": 12,
    "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "nvme"}, "offload_param": {"device": "nvme"}},
    "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "amsgrad": True}},
}


def test_driver_refuses_a_swap_that_does_not_fit_the_disk_before_any_worker_starts(tmp_path):
    from rayzero.accelerator.memory_limits import detect_memory_limit
    from rayzero.config import Config
    from rayzero.memory import model_state_bytes

    nvme = tmp_path / "nvme"
    nvme.mkdir()
    config = json.loads(json.dumps(NVME_BIG))
    for key in ("offload_optimizer", "offload_param"):
        config["zero_optimization"][key]["nvme_path"] = str(nvme)
    # Two ranks on this node keep (4 master + 12 amsgrad state + 4 weights) / 2 bytes per parameter each on
    # disk: 20 bytes per parameter in all.  Ask for 1.3x the disk's free space, on the meta device.
    cols = int(shutil.disk_usage(nvme).free * 1.3 / 20) // 2**16 + 1
    factory = functools.partial(torch.nn.Linear, 2**16, cols, bias=False, device="meta")
    ram, n = model_state_bytes(factory(), Config.from_any(config), 2)
    if 2 * ram > detect_memory_limit().total_bytes:
        pytest.skip(f"this disk is too big for the test: {n:,} parameters need {2 * ram:,} bytes of memory")
    started = time.monotonic()
    with pytest.raises(rayzero.ConfigError) as e:
        rayzero.fit(factory, {"workers": 2, "storage": str(tmp_path / "runs"), "name": "too-big", "progress": False},
                    config=config, data=Regression(), loss_fn=mse, max_steps=1)
    msg = str(e.value)
    assert msg.startswith(f"the NVMe swap does not fit on node {os.uname().nodename}")
    assert "2 rank(s) there at world size 2" in msg
    assert f"under {nvme}/rayzero-swap/too-big" in msg and "free; free space there" in msg
    assert "point nvme_path at a bigger local disk" in msg
    assert time.monotonic() - started < 30
    assert not os.path.exists(tmp_path / "runs" / "too-big" / "metrics.jsonl")  # no worker ran
    assert list(nvme.iterdir()) == []  # the stores were shut down and took their directories with them
    from rayzero.train.swap_actor import store_name, store_namespace

    with pytest.raises(ValueError):
        ray.get_actor(store_name(ray.get_runtime_context().get_node_id()), namespace=store_namespace("too-big"))


class SwapProbe:
    """A train_step that logs each rank's swap directory and its siblings, and SIGKILLs one rank once."""

    def __init__(self, log: str, marker: str, rank: int, step: int):
        self.log, self.marker, self.rank, self.step = log, marker, rank, step

    def __call__(self, engine, batch):
        import ray.train

        from rayzero.offload.swap_dirs import SWAP_DIR_ENV

        rank = ray.train.get_context().get_world_rank()
        path = os.environ[SWAP_DIR_ENV]
        record = {"rank": rank, "pid": os.getpid(), "step": engine.global_steps, "dir": path,
                  "siblings": sorted(os.listdir(os.path.dirname(path))), "files": sorted(os.listdir(path))}
        with open(self.log, "a") as f:
            f.write(json.dumps(record) + "\n")
        if engine.global_steps == self.step and rank == self.rank and not os.path.exists(self.marker):
            open(self.marker, "w").close()
            os.kill(os.getpid(), signal.SIGKILL)
        loss = mse(engine(batch[0]), batch)
        engine.backward(loss)
        engine.step()
        return loss


def test_fit_with_nvme_offload_restarts_after_sigkill_and_leaves_no_swap_files(tmp_path):
    nvme = tmp_path / "nvme"
    config = {**CONFIG, "zero_optimization": {**CONFIG["zero_optimization"],
                                              "offload_optimizer": {"device": "nvme", "nvme_path": str(nvme)}}}
    log, marker = str(tmp_path / "swap.jsonl"), str(tmp_path / "killed-once")
    result = rayzero.fit(
        model_factory,
        {"workers": 2, "storage": str(tmp_path / "runs"), "name": "swap", "checkpoint_every": 2, "max_failures": 2,
         "progress": False},
        config=config, data=Regression(), train_step=SwapProbe(log, marker, rank=1, step=3), max_steps=6,
    )
    assert os.path.exists(marker), "the worker was never killed"
    assert len(result.losses) == 6 and all(l == l for l in result.losses)
    records = [json.loads(line) for line in open(log)]
    run_dir = str(nvme / "rayzero-swap" / "swap")
    for r in records:  # each rank trains in the directory its node's store leased it
        assert r["dir"] == f"{run_dir}/rank{r['rank']}-pid{r['pid']}"
        assert r["files"], "the engine keeps its optimizer state in the leased directory"
    killed = next(r["pid"] for r in records if r["rank"] == 1 and r["step"] == 3)
    last_of_killed = max(i for i, r in enumerate(records) if r["pid"] == killed)
    first = {}
    for i, r in enumerate(records):
        first.setdefault(r["pid"], i)
    restarted = {pid for pid, i in first.items() if i > last_of_killed}
    assert len(restarted) == 2, records
    for r in records:  # after the restart only the new group's directories exist: the dead ranks' are gone
        if r["pid"] in restarted:
            ranks = [s for s in r["siblings"] if s.startswith("rank")]  # (and the store's .rayzero-owner)
            assert {int(re.search(r"pid(\d+)$", s)[1]) for s in ranks} == restarted, r
    assert not os.path.exists(nvme / "rayzero-swap")  # fit shut the stores down: no swap file is left
