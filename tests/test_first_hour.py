"""The first hour with rayzero.fit: start-up phases, refusing a cluster too small at once, a quiet console, the node
table, what a run resumed from, and train_moe.py's command line.

The pure parts (ETA, lr, the workers' output filter, slots, the autoscaler signal, the node table) are checked
directly.  The rest runs real Ray: ``examples/train.py`` in a subprocess (starting its own local cluster, or
connected to this module's cluster), and ``rayzero.fit`` in this process.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import tempfile
import time

import pytest
import torch

import rayzero
from ray_cases import WORKER_PYTHONPATH, CONFIG, Regression, model_factory, mse, stop_head
from rayzero.train.agent import (
    autoscaler_node_types,
    can_autoscale,
    describe_slots,
    format_node_table,
    slots,
    worker_bundle,
)
from rayzero.train.metrics import WorkerOutputFilter, eta_seconds, format_duration, lr_value, progress_line, step_rate

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TESTS = os.path.join(ROOT, "tests")
TRAIN = os.path.join(ROOT, "examples", "train.py")
MOE = os.path.join(ROOT, "examples", "train_moe.py")


# ---- pure functions ---------------------------------------------------------------------------------------------


def _records(steps, t0=1000.0, dt=0.5, first=1):
    return [{"step": s, "loss": 1.0, "time": t0 + i * dt, "world_size": 2, "samples_per_s": 10.0, "lr": 1e-3}
            for i, s in enumerate(range(first, first + steps))]


def test_eta_comes_from_the_recent_step_rate():
    assert eta_seconds(_records(3), 100) is None  # 2 step intervals: too few to say
    assert step_rate(_records(4)) == pytest.approx(2.0)  # 3 intervals of 0.5 s
    assert eta_seconds(_records(4), 100) == pytest.approx((100 - 4) / 2.0)
    # a resumed run (steps 51..60 in this fit) or a slow start-up does not skew it: only step intervals count
    assert eta_seconds(_records(10, first=51, t0=5000.0), 100) == pytest.approx(40 / 2.0)
    # the rate follows the last 10 intervals: the run sped up from 1 to 4 steps/s
    slow = _records(20, dt=1.0)
    fast = _records(11, t0=slow[-1]["time"] + 0.25, dt=0.25, first=21)
    assert step_rate(slow + fast) == pytest.approx(4.0)
    # a restart that redoes steps starts a new run of consecutive steps
    redo = _records(6) + _records(2, t0=2000.0, first=5)
    assert step_rate(redo) is None
    assert [format_duration(s) for s in (9.4, 65, 3725)] == ["9s", "1m05s", "1h02m"]


@pytest.mark.parametrize("lr", [0.003, [0.003], (0.003, 0.1), "tensor(0.0030)", torch.tensor(0.003), [torch.tensor(0.003)]])
def test_progress_line_prints_lr_as_a_number(lr):
    assert lr_value(lr) == pytest.approx(0.003)
    record = {"step": 40, "loss": 2.34123, "lr": lr, "samples_per_s": 5310.2, "world_size": 2}
    line = progress_line(record, 60, 9.2)
    assert line == "[rayzero] step 40/60  loss 2.3412  lr 3.00e-03  5310 samples/s  world 2  ETA 9s"
    assert progress_line(record, 60, None).endswith("world 2")  # no ETA before a few steps have run


def _batch(pid, *lines, **kw):
    return {"ip": "10.0.0.1", "pid": pid, "lines": list(lines), "actor_name": "RayTrainWorker", **kw}


def test_worker_output_filter_drops_ray_noise_and_prints_each_warning_once():
    f = WorkerOutputFilter()
    core = "[2026-12-03 16:13:41,121 E 19049 19088] core_worker.cc:2465: Actor with class name: 'PreemptionWatcher'"
    report = "Reporting training result 1: TrainingReport(checkpoint=None, metrics={'lr': 0.1}) from rank 0"
    assert f.filter(_batch(1, core, report)) is None
    warn = "/x/engine.py:12: UserWarning: rank 0 saw 3 stale buckets"
    assert f.filter(_batch(1, warn, "hello from 1"))["lines"] == [warn, "hello from 1"]
    # the same warning from another rank, or after a restart, with other numbers: not again
    assert f.filter(_batch(2, "/x/engine.py:12: UserWarning: rank 1 saw 5 stale buckets")) is None
    assert f.filter(_batch(3, warn)) is None
    # a plain line: once across processes, but every time from the process that printed it first
    assert f.filter(_batch(2, "hello from 1")) is None
    assert f.filter(_batch(1, "hello from 1"))["lines"] == ["hello from 1"]
    # Ray's node messages (out-of-memory kills, ...) pass untouched; Ray Train's housekeeping actor is not heard
    oom = _batch("raylet", "Task was killed due to the node running low on memory.")
    assert f.filter(oom) == oom and f.filter(oom) == oom
    assert f.filter(_batch(4, "Failed to query Ray Train Controller actor state.", actor_name="PlacementGroupCleaner")) is None
    # a restarted worker group's processes are heard again (a repeated traceback shows), warnings stay once
    f.new_group()
    assert f.filter(_batch(5, "hello from 1", warn))["lines"] == ["hello from 1"]
    # what it remembers is bounded: the least recently seen lines are forgotten first
    for i in range(f.REMEMBERED + 10):
        f.filter(_batch(6, f"line {i}"))
    assert len(f.lines) == f.REMEMBERED and "line 0" not in f.lines and f"line {f.REMEMBERED + 9}" in f.lines


def test_node_table_says_free_disk_and_counts_gpus_and_cpus():
    gib = 1 << 30
    busy = "its GPUs were not granted within 30 s (in use by another job?): not probed"
    all_ok = {"bf16": True, "fp16": True, "fused_optimizer": True, "graph_capture": True, "errors": {}}
    rows = [
        {"hostname": "gpu-node-1", "accelerator": "cuda", "devices": 8, "graph_capture": True, "probe": all_ok,
         "memory_total": 80 * gib, "memory_available": 79 * gib, "swap_free": 500 * gib,
         "ray_resources": {"CPU": 96.0, "GPU": 8.0}, "note": ""},
        {"hostname": "cpu-node-1", "accelerator": "cpu", "devices": 1, "graph_capture": False,
         "probe": {**all_ok, "fp16": False, "graph_capture": False, "errors": {"fp16": "RuntimeError: no half"}},
         "memory_total": 32 * gib, "memory_available": 30 * gib, "swap_free": 100 * gib,
         "ray_resources": {"CPU": 16.0}, "note": ""},
        # a GPU node whose GPUs another run held: its agent reported without them, so Ray hid them
        {"hostname": "gpu-node-2", "accelerator": "cpu", "devices": 1, "graph_capture": False, "probe": all_ok,
         "memory_total": 64 * gib, "memory_available": 60 * gib, "swap_free": 10 * gib,
         "ray_resources": {"CPU": 32.0, "GPU": 4.0}, "note": busy},
    ]
    header, gpu, cpu, hidden, *notes = format_node_table(rows).splitlines()
    assert hidden.split()[:5] == ["gpu-node-2", "gpu", "4", "GPU", "?"]
    assert "free disk GiB" in header and "swap" not in header and "works (probed)" in header
    assert gpu.split()[:5] == ["gpu-node-1", "cuda", "8", "GPU", "bf16,fp16,fused,capture"]
    assert cpu.split()[:5] == ["cpu-node-1", "cpu", "16", "CPU", "bf16,fused"]
    assert gpu.split()[-1] == "500.0" and cpu.split()[-1] == "100.0"
    assert notes == ["  cpu-node-1: fp16: RuntimeError: no half", f"  gpu-node-2: {busy}"]


def test_a_config_that_a_node_failed_the_probe_for_is_refused_before_workers_start():
    from rayzero.config import Config, ConfigError
    from rayzero.train.agent import check_probes

    ok = {"bf16": True, "fp16": True, "fused_optimizer": True, "graph_capture": True, "errors": {}}
    bad = {**ok, "bf16": False, "errors": {"bf16": "AssertionError: bf16 matmul off by 3.0"}}
    rows = [{"hostname": "a", "accelerator": "cuda", "probe": ok, "note": ""},
            {"hostname": "b", "accelerator": "cuda", "probe": bad, "note": ""}]
    bf16 = Config.from_any({"train_batch_size": 4, "bf16": {"enabled": True}})
    with pytest.raises(ConfigError, match=r"node b's cuda device failed the bf16 probe \(AssertionError: bf16 matmul "
                                          r"off by 3.0\); set bf16.enabled to false"):
        check_probes(bf16, rows)
    check_probes(Config.from_any({"train_batch_size": 4}), rows)  # fp32 asks nothing of it
    check_probes(bf16, [rows[0], {**rows[1], "note": "its GPUs were not granted within 30 s: not probed"}])  # not judged


def test_the_probe_runs_on_the_device_and_finds_what_it_cannot_do():
    from rayzero.accelerator.cpu import CpuAccelerator
    from rayzero.accelerator.probe import probe

    found = probe(CpuAccelerator())
    assert {k: found[k] for k in ("bf16", "fp16", "fused_optimizer")} == dict.fromkeys(("bf16", "fp16", "fused_optimizer"), True)

    class BrokenHalf(CpuAccelerator):
        def device(self, index=None):
            return torch.device("meta")  # every kernel "runs", but nothing comes back to compare

        def is_bf16_supported(self):
            return False

    broken = probe(BrokenHalf())
    assert broken["bf16"] is False and "bf16" not in broken["errors"]  # declared off: not tried
    assert broken["fp16"] is False and "fp16" in broken["errors"]  # tried: no result
    assert broken["fused_optimizer"] is False and "fused_optimizer" in broken["errors"]


def test_worker_slots_and_what_is_missing():
    bundle = worker_bundle({"CPU": 2}, use_gpu=False)
    nodes = [("a", {"CPU": 3.0}, {"CPU": 1.0}), ("b", {"CPU": 1.0}, {"CPU": 1.0})]
    assert [slots(total, bundle) for _, total, _ in nodes] == [1, 0]
    assert describe_slots(bundle, nodes, 2) == (
        "have 1 of 2 worker slots: each worker needs 2 CPU; node a has 3 CPU (1 slot); node b has 1 CPU (0 slots)")
    assert describe_slots(bundle, nodes, 2, free=True) == (
        "have 0 of 2 worker slots free: each worker needs 2 CPU; node a has 1 of 3 CPU free (0 slots); "
        "node b has 1 of 1 CPU free (0 slots)")
    gpu = worker_bundle({"CPU": 1}, use_gpu=True)
    assert gpu == {"CPU": 1.0, "GPU": 1.0} and slots({"CPU": 8.0, "GPU": 2.0}, gpu) == 2
    assert "each worker needs 1 CPU + 1 GPU; node g has 8 CPU, 0 GPU (0 slots)" in describe_slots(
        gpu, [("g", {"CPU": 8.0}, {"CPU": 8.0})], 1)
    assert slots({"CPU": 0.9}, {"CPU": 0.3}) == 3  # no float shortfall


def test_the_autoscaler_signal():
    node = "160232c4d83c34a85e446add4d4daae69fdf7775c3301cebd595f66a"
    # what the monitor of a cluster started by hand (`ray start`, ray.init) writes: the read-only provider
    hand = {"autoscaler_report": {"active_nodes": {f"node_{node}": 1}, "idle_nodes": None, "pending_launches": {},
                                  "pending_nodes": [], "node_type_mapping": {node: f"node_{node}"}}}
    assert autoscaler_node_types(hand) == {f"node_{node}"} and not can_autoscale(autoscaler_node_types(hand))
    # a cluster launcher / KubeRay autoscaler names its config's node types
    launcher = {"autoscaler_report": {"active_nodes": {"ray.head.default": 1}, "pending_launches": {"cpu_worker": 2},
                                      "pending_nodes": [["10.0.0.5", "cpu_worker", "setting-up"]]}}
    assert autoscaler_node_types(launcher) == {"ray.head.default", "cpu_worker"}
    assert can_autoscale(autoscaler_node_types(launcher))
    assert autoscaler_node_types({"load_metrics_report": {}}) is None and not can_autoscale(None)


# ---- examples/train_moe.py's command line -----------------------------------------------------------------------

MOE_FLAGS = ["--max-steps", "--workers", "--ep", "--tp", "--stage", "--storage", "--name", "--global-batch",
             "--context", "--lr", "--checkpoint-every", "--cpus-per-worker", "--no-eval", "--verbose"]


def _load_moe():
    spec = importlib.util.spec_from_file_location("train_moe_cli", MOE)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def test_moe_help_gives_every_flag_its_default_and_meaning():
    out = subprocess.run([sys.executable, MOE, "--help"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    options = out.stdout.split("options:")[1]
    for flag in MOE_FLAGS:
        assert flag in options
    assert options.count("(default:") == len(MOE_FLAGS)
    blocks = options.split("\n  --")[1:]  # one per flag: its meaning, then its default
    assert len(blocks) == len(MOE_FLAGS)
    for block in blocks:
        meaning = " ".join(block.split("(default:")[0].split()[1:])
        assert len(meaning) > 8, block


@pytest.mark.parametrize("argv, flag", [
    (["--max-steps", "0"], "--max-steps"),
    (["--max-steps", "ten"], "--max-steps"),
    (["--workers", "3,1"], "--workers"),
    (["--ep", "0"], "--ep"),
    (["--ep", "3"], "--ep"),
    (["--tp", "-1"], "--tp"),
    (["--stage", "3"], "--stage"),
    (["--global-batch", "0"], "--global-batch"),
    (["--context", "x"], "--context"),
    (["--lr", "nan"], "--lr"),
    (["--checkpoint-every", "-1"], "--checkpoint-every"),
    (["--cpus-per-worker", "0"], "--cpus-per-worker"),
    (["--name", "a/b"], "--name"),
    (["--tp", "2", "--workers", "3"], "--workers/--tp/--ep/--global-batch"),
    (["--global-batch", "7"], "--workers/--tp/--ep/--global-batch"),
])
def test_moe_bad_value_is_a_one_line_error(argv, flag, capsys, tmp_path):
    moe = _load_moe()
    with pytest.raises(SystemExit) as e:
        moe.parse_args([*argv, "--storage", str(tmp_path)])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert ": error: argument" in err[-1] and flag in err[-1]  # argparse's usage, then the one-line error
    assert "Traceback" not in "\n".join(err)


def test_moe_bad_value_ends_the_script_without_a_traceback(tmp_path):
    out = subprocess.run([sys.executable, MOE, "--ep", "3", "--storage", str(tmp_path)], capture_output=True,
                         text=True, timeout=120, env={k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"})
    assert out.returncode == 2 and "Traceback" not in out.stdout + out.stderr
    assert out.stderr.strip().splitlines()[-1] == (
        "train_moe.py: error: argument --ep: 3 does not divide the model's 4 experts (use 1, 2 or 4)")
    assert os.listdir(tmp_path) == []


# ---- real Ray ---------------------------------------------------------------------------------------------------


def _train(*argv, address=None, tmpdir=None, timeout=300):
    """examples/train.py in a subprocess: (return code, stdout + stderr, seconds)."""
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    if address:
        env["RAY_ADDRESS"] = address
    if tmpdir:
        env["RAY_TMPDIR"] = tmpdir  # its own Ray session: nothing on this machine to join
    start = time.monotonic()
    out = subprocess.run([sys.executable, TRAIN, *argv], capture_output=True, text=True, timeout=timeout, env=env)
    return out.returncode, out.stdout + out.stderr, time.monotonic() - start


def _in_order(text: str, *parts: str) -> None:
    at = 0
    for part in parts:
        found = text.find(part, at)
        assert found >= 0, f"{part!r} missing (after position {at}) in:\n{text[-6000:]}"
        at = found + len(part)


def test_a_cluster_fit_started_itself_is_refused_at_once(tmp_path):
    """No Ray to join: fit starts a local cluster, which cannot grow, so asking for more is refused right away,
    not after start_timeout_s (120 s) of silence."""
    tmpdir = tempfile.mkdtemp(prefix="rzfh", dir="/tmp")  # short: Ray's socket paths must stay < 108 bytes
    try:
        code, out, took = _train("--workers", "2", "--cpus-per-worker", "4096", "--max-steps", "2",
                                 "--storage", str(tmp_path), tmpdir=tmpdir)
    finally:
        import shutil

        shutil.rmtree(tmpdir, ignore_errors=True)
    assert code == 1, out[-4000:]
    assert "Traceback" not in out
    last = out.strip().splitlines()[-1]
    assert last.startswith("train.py: error: the Ray cluster is too small for 2 workers and cannot grow: "
                           "have 0 of 2 worker slots: each worker needs 4096 CPU; node "), last
    assert "this process started it as a local cluster, which has no autoscaler" in last
    _in_order(out, "[rayzero] starting a local Ray cluster", "[rayzero] started a local Ray cluster: 1 node, ")
    assert took < 90, took  # Ray's start-up and the refusal; the old check waited 120 s before failing


@pytest.fixture(scope="module")
def ray_cluster():
    ray = pytest.importorskip("ray")
    ray.init(num_cpus=3, include_dashboard=False, runtime_env={"env_vars": {"PYTHONPATH": WORKER_PYTHONPATH}})
    yield ray.get_runtime_context().gcs_address
    ray.shutdown()


def test_a_connected_cluster_without_autoscaler_is_refused_at_once(ray_cluster, tmp_path):
    """Also train.py's --verbose reaching fit: Ray's own line on connecting shows (the quiet console run has none;
    what verbose shows of a running fit is checked with the resumed fit below)."""
    code, out, took = _train("--workers", "2", "--cpus-per-worker", "4096", "--storage", str(tmp_path), "--verbose",
                             address=ray_cluster)
    assert code == 1 and "Traceback" not in out, out[-4000:]
    last = out.strip().splitlines()[-1]
    assert last.startswith("train.py: error: the Ray cluster is too small for 2 workers and cannot grow: "
                           "have 0 of 2 worker slots: each worker needs 4096 CPU; node "), last
    assert "(1 node); it has no autoscaler" in last and last.endswith("No node can host one worker: lower "
                                                                      "resources_per_worker, or add nodes that have them")
    _in_order(out, f"[rayzero] connecting to the Ray cluster at {ray_cluster}", "[rayzero] connected: 1 node, 3 CPU")
    assert "Connecting to existing Ray cluster" in out  # Ray's INFO line (its stderr, after rayzero's stdout here)
    assert took < 60, took


def test_asking_more_workers_than_slots_names_the_numbers(ray_cluster, tmp_path):
    from rayzero.train.fit import ClusterTooSmallError

    start = time.monotonic()
    with pytest.raises(ClusterTooSmallError) as e:  # a RuntimeError
        rayzero.fit(model_factory, {"workers": 5, "storage": str(tmp_path), "progress": False},
                    config={**CONFIG, "train_batch_size": 10}, data=Regression(), loss_fn=mse)
    assert time.monotonic() - start < 10  # not start_timeout_s (120 s)
    assert str(e.value).startswith(
        "the Ray cluster is too small for 5 workers and cannot grow: have 3 of 5 worker slots: each worker needs "
        "1 CPU; node ")
    assert " has 3 CPU (3 slots) (1 node); this process started it as a local cluster, which has no autoscaler. Ask " \
           "for at most 3 worker(s) (an elastic range like workers=(1, 3) grows when nodes join)" in str(e.value)


def test_quiet_console_phases_and_progress(ray_cluster, tmp_path):
    code, out, _ = _train("--workers", "2", "--max-steps", "3", "--checkpoint-every", "1", "--storage",
                          str(tmp_path), address=ray_cluster)
    assert code == 0, out[-6000:]
    _in_order(
        out,
        f"[rayzero] connecting to the Ray cluster at {ray_cluster}",
        "[rayzero] connected: 1 node, 3 CPU",
        "[rayzero] 2 workers wanted, the cluster has 3 worker slots: each worker needs 1 CPU; node ",
        "free disk GiB",
        " cpu ",
        " 3 CPU ",
        "[rayzero] launching 2 workers with Ray Train (run tiny-gpt-",
        "[rayzero] 2 workers up: building the model and engine",
        "[rayzero] derived reduce_bucket_size ",  # the config sets no bucket: rank 0's choice, once
        "[rayzero] step 3/3  loss ",
        "loss: first ",
    )
    assert out.count("derived reduce_bucket_size") == 1
    for noise in ("TrainingReport", "Reporting training result", "(RayTrainWorker", "(TrainController",
                  "core_worker.cc", "Started a local Ray instance", "Connecting to existing Ray cluster"):
        assert noise not in out, noise
    assert all(" lr " in line and "[" not in line.split(" lr ")[1] for line in out.splitlines()
               if line.startswith("[rayzero] step "))


def test_result_says_what_it_resumed_from_and_verbose_shows_ray_s_lines(ray_cluster, tmp_path, capfd):
    """The resumed fit is also the verbose one (ClusterConfig.verbose, what train.py's --verbose sets): Ray's own
    lines show, next to the start-up phases and progress lines, which the quiet first fit leaves out."""
    cluster = {"workers": 2, "storage": str(tmp_path), "name": "resume", "checkpoint_every": 1}
    first = rayzero.fit(model_factory, cluster, config=CONFIG, data=Regression(), loss_fn=mse, max_steps=2)
    assert first.resumed_from is None
    captured = capfd.readouterr()
    out = captured.out
    assert "resuming" not in out and "loading checkpoint" not in out
    for noise in ("TrainingReport", "Reporting training result", "(RayTrainWorker", "(TrainController"):
        assert noise not in out + captured.err, noise
    _in_order(out, "[rayzero] 2 workers up: building the model and engine", "[rayzero] first step: step 1 of 2")
    second = rayzero.fit(model_factory, {**cluster, "verbose": True}, config=CONFIG, data=Regression(),
                         loss_fn=mse, max_steps=4)
    assert second.resumed_from == 2
    assert [r["step"] for r in second.history] == [1, 2, 3, 4] and len(second.losses) == 4
    captured = capfd.readouterr()
    out = captured.out
    _in_order(out, "[rayzero] using the Ray cluster this process is connected to (1 node, 3 CPU)",
              "[rayzero] resuming run resume from step 2 (checkpoint checkpoint_step00000002)",
              "[rayzero] 2 workers up: building the model and engine",
              "[rayzero] loading checkpoint checkpoint_step00000002 (step 2)",
              "[rayzero] first step: step 3 of 4",
              "[rayzero] step 4/4")
    assert "[rayzero] step 2/4" not in out  # the earlier fit's records are not this fit's progress
    ray_lines = out + captured.err
    assert "TrainingReport" in ray_lines and "Reporting training result" in ray_lines
    assert "(RayTrainWorker" in ray_lines and "(TrainController" in ray_lines


# ---- a cluster with an autoscaler: fit asks it for the workers and waits ----------------------------------------


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def autoscaling_head():
    """A head node this module owns, with a real autoscaler: Ray's fake multi-node provider, which starts each new
    node as processes on this machine.  A 1-CPU head, and one more 1-CPU node type (at most one such node).
    Token auth, its own ports and session directory; stopped by the PID of its process group."""
    import json
    import socket

    bin_dir = os.path.dirname(sys.executable)
    if not os.path.exists(os.path.join(bin_dir, "ray")):
        pytest.skip("the ray command is not installed next to this Python")
    import ray._private.services as services

    root = tempfile.mkdtemp(prefix="rzas", dir="/tmp")  # short: Ray's socket paths must stay < 108 bytes
    env = dict(os.environ, HOME=os.path.join(root, "home"), RAY_TMPDIR=os.path.join(root, "rt"),
               PATH=bin_dir + os.pathsep + os.environ.get("PATH", ""), RAY_USAGE_STATS_ENABLED="0",
               RAY_FAKE_CLUSTER="1", AUTOSCALER_UPDATE_INTERVAL_S="1", PYTHONPATH=WORKER_PYTHONPATH,
               RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S="0")
    env.pop("RAY_ADDRESS", None)
    os.makedirs(env["HOME"])
    os.makedirs(env["RAY_TMPDIR"])
    subprocess.run([os.path.join(bin_dir, "ray"), "get-auth-token", "--generate"], env=env, check=True,
                   capture_output=True, timeout=60)
    env["RAY_AUTH_MODE"] = "token"
    port = _free_port()
    address = f"{services.get_node_ip_address()}:{port}"
    config = {
        "cluster_name": "rayzero-fake", "max_workers": 1, "upscaling_speed": 1.0, "idle_timeout_minutes": 5,
        "provider": {"type": "fake_multinode", "gcs_address": address, "disable_launch_config_check": True,
                     "disable_node_updaters": True},
        "auth": {}, "docker": {}, "head_node_type": "ray.head.default",
        "available_node_types": {
            "ray.head.default": {"resources": {"CPU": 1}, "node_config": {}, "max_workers": 0},
            "cpu_node": {"resources": {"CPU": 1}, "node_config": {}, "min_workers": 0, "max_workers": 1},
        },
        "file_mounts": {}, "cluster_synced_files": [], "file_mounts_sync_continuously": False,
        "rsync_exclude": [], "rsync_filter": [], "initialization_commands": [], "setup_commands": [],
        "head_setup_commands": [], "worker_setup_commands": [], "head_start_ray_commands": [],
        "worker_start_ray_commands": [],
    }
    config_file = os.path.join(root, "autoscaling.json")
    with open(config_file, "w") as f:
        json.dump(config, f)
    head = subprocess.Popen(
        [os.path.join(bin_dir, "ray"), "start", "--head", f"--port={port}", "--num-cpus=1",
         f"--autoscaling-config={config_file}", "--include-dashboard=false",
         f"--dashboard-agent-listen-port={_free_port()}", f"--dashboard-agent-grpc-port={_free_port()}",
         f"--metrics-export-port={_free_port()}", f"--runtime-env-agent-port={_free_port()}",
         "--disable-usage-stats", "--block"],
        env=env, stdout=open(os.path.join(root, "head.log"), "w"), stderr=subprocess.STDOUT,
        start_new_session=True,  # its own process group (the fake nodes too): stopping it touches nothing else
    )
    try:
        deadline = time.monotonic() + 90
        while True:
            try:
                socket.create_connection(("127.0.0.1" if address.startswith("127.") else address.split(":")[0],
                                          port), timeout=2).close()
                break
            except OSError:
                assert head.poll() is None, open(os.path.join(root, "head.log")).read()[-2000:]
                assert time.monotonic() < deadline, "the Ray head did not come up"
                time.sleep(0.5)
        yield address, env
    finally:
        stop_head(head, root, 40)


def test_with_an_autoscaler_fit_asks_for_the_workers_and_waits(autoscaling_head, tmp_path):
    address, env = autoscaling_head
    env = {**env, "RAY_ADDRESS": address}
    out = subprocess.run([sys.executable, TRAIN, "--workers", "2", "--max-steps", "2", "--storage", str(tmp_path)],
                         capture_output=True, text=True, timeout=400, env=env)
    text = out.stdout + out.stderr
    assert out.returncode == 0, text[-6000:]
    _in_order(
        text,
        f"[rayzero] connecting to the Ray cluster at {address}",
        "[rayzero] connected: 1 node, 1 CPU",
        "[rayzero] waiting for 2 workers: have 1 of 2 worker slots: each worker needs 1 CPU; node ",
        " has 1 CPU (1 slot); the autoscaler was asked for them (an autoscaler runs with node types "
        "['ray.head.default']); ",
        "[rayzero] the cluster has grown to 2 worker slots (after ",
        "[rayzero] launching 2 workers with Ray Train",
        "[rayzero] step 2/2",
    )
    assert "world sizes [2]" in text
    assert "PlacementGroupCleaner" not in text  # Ray Train's housekeeping, polling in vain without a dashboard


def test_with_an_autoscaler_that_cannot_deliver_the_wait_ends_in_a_clear_error(autoscaling_head, tmp_path):
    address, env = autoscaling_head
    script = (
        "import rayzero\n"
        "from ray_cases import CONFIG, Regression, model_factory, mse\n"
        f"rayzero.fit(model_factory, {{'workers': 3, 'storage': {str(tmp_path)!r}, 'start_timeout_s': 8}},\n"
        "            config=CONFIG, data=Regression(), loss_fn=mse, max_steps=1)\n"
    )
    start = time.monotonic()
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=200,
                         env={**env, "RAY_ADDRESS": address})
    took = time.monotonic() - start
    text = out.stdout + out.stderr
    assert out.returncode == 1, text[-4000:]
    assert "waiting for 3 workers: have " in text
    last = text.strip().splitlines()[-1]
    assert last.startswith("rayzero.train.fit.ClusterTooSmallError: the Ray cluster is still too small for 3 "
                           "workers after waiting 8 s for its autoscaler (an autoscaler runs with node types "), last
    assert "`ray status` shows what the autoscaler is doing" in last
    assert took < 120, took
