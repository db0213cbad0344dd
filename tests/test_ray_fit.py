"""rayzero.fit on a real local Ray cluster (one per module): results, bad input.  (A worker killed mid-run:
tests/test_ray_kill_bitwise.py.)"""

from __future__ import annotations

import os
import tarfile
import tempfile
import threading

import pytest
import torch

import rayzero
from distributed import run_distributed, run_once
from rayzero.capture.cache import kernel_archive_name
from ray_cases import CONFIG, Regression, cpu_fit, expected_samples, final_samples, model_factory, mse, plain_run
import shared_ray

ray = pytest.importorskip("ray")
SHARED_RAY = True  # runs on the suite's one local cluster (tests/shared_ray.py)
TESTS = os.path.dirname(os.path.abspath(__file__))


def _plain(steps: int) -> list[float]:
    """The engine alone (ray_cases.plain_run) for the first ``steps`` steps: one run of the longest, 6 steps,
    whose first steps are those of every shorter run."""
    assert steps <= 6
    return run_once(plain_run, 2, 6, 6)[0][:steps]


@pytest.fixture(scope="module", autouse=True)
def ray_cluster():
    yield shared_ray.start()  # the suite's one cluster (tests/shared_ray.py)


def test_fit_gives_the_losses_of_the_plain_engine(tmp_path):
    steps = 6
    result = rayzero.fit(
        model_factory,
        {"workers": 2, "storage": str(tmp_path), "name": "same", "checkpoint_every": 3, "progress": False},
        config=CONFIG,
        data=Regression(),
        loss_fn=mse,
        max_steps=steps,
        record_samples=True,
    )
    reference = _plain(steps)
    assert result.losses == pytest.approx(reference, rel=1e-6)
    # bit for bit, the worker's own step without Ray (ray_cases.cpu_fit: the CPU reference of
    # tests/test_device_fit.py and tests/test_ray_kill_bitwise.py), losses and final weights
    worker_losses = run_distributed(cpu_fit, 2, [{"name": "same", "config": CONFIG}], steps, str(tmp_path / "cpu"))
    assert result.losses == worker_losses[0][0]
    from rayzero.checkpoint.tools import export

    export(result.checkpoint, str(tmp_path / "fit.pt"))
    export(str(tmp_path / "cpu" / "same"), str(tmp_path / "cpu.pt"), tag=os.path.basename(result.checkpoint))
    fit_weights, cpu_weights = torch.load(tmp_path / "fit.pt"), torch.load(tmp_path / "cpu.pt")
    assert list(fit_weights) == list(cpu_weights)
    for name, v in cpu_weights.items():
        assert torch.equal(fit_weights[name], v), name
    assert result.world_sizes == [2]
    assert result.checkpoint.endswith("checkpoint_step00000006")
    assert final_samples(os.path.join(result.run_dir, "samples.jsonl")) == expected_samples(steps, 12, 96)
    # the run's metrics and plot
    assert [r["step"] for r in result.history] == list(range(1, steps + 1))
    from rayzero.train.metrics import plot_loss

    png = plot_loss(result.run_dir, str(tmp_path / "loss.png"))
    assert open(png, "rb").read(8) == b"\x89PNG\r\n\x1a\n"


@pytest.mark.skipif(not __import__("shutil").which("g++") and not __import__("shutil").which("c++"),
                    reason="inductor needs a C++ compiler on PATH")
def test_fit_with_graph_capture_keeps_the_compile_cache_in_the_run(tmp_path):
    steps = 4
    result = rayzero.fit(
        model_factory,
        {"workers": 2, "storage": str(tmp_path), "name": "captured", "checkpoint_every": 4, "progress": False},
        config={**CONFIG, "graph_capture": {"enabled": True}},
        data=Regression(),
        loss_fn=mse,
        max_steps=steps,
    )
    reference = _plain(steps)  # the eager engine
    assert result.losses == pytest.approx(reference, rel=1e-5)
    # the node agents lived for the node table only: none is left on the cluster
    from ray._private.state import actors

    # nor any node's compile cache owner, which uploaded what its node compiled and removed its directory
    alive = {a["ActorClassName"] for a in actors(actor_state_name="ALIVE").values()}
    assert "NodeAgent" not in alive and "CompileCacheOwner" not in alive, alive
    assert not os.path.exists(os.path.join(tempfile.gettempdir(), "rayzero-compile", "captured"))
    cache = os.path.join(result.run_dir, "compile_cache")
    kernels, artifacts = sorted(os.listdir(cache))  # the node's built kernels, the torch.compiler artifacts
    assert artifacts.endswith("-cpu.bin") and os.path.getsize(os.path.join(cache, artifacts)) > 0
    assert kernels == kernel_archive_name("cpu")
    with tarfile.open(os.path.join(cache, kernels)) as tar:
        assert any(name.endswith(".so") for name in tar.getnames())


def test_a_node_without_a_compile_cache_actor_is_left_out_not_fatal(tmp_path, caplog):
    from rayzero.train.compile_actor import shutdown_compile_caches, start_compile_caches

    here = ray.get_runtime_context().get_node_id()
    gone = "ab" * (len(here) // 2)  # a node that is not in the cluster (one that died before launch)
    handles: dict = {}
    with caplog.at_level("WARNING", logger="rayzero"):
        start_compile_caches(str(tmp_path / "compile_cache"), "left-out", [here, gone], handles, timeout_s=10)
    assert list(handles) == [here]
    assert any(gone in r.getMessage() and "compile for themselves" in r.getMessage() for r in caplog.records)
    node_dir = ray.get(handles[here].lease.remote("cpu"))
    assert os.path.isdir(node_dir)
    assert shutdown_compile_caches("left-out", handles) == 1
    assert not os.path.exists(node_dir)


class Unpicklable(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(2, 2)
        self.lock = threading.Lock()


def test_bad_input_fails_before_training_with_clear_errors(tmp_path):
    with pytest.raises(TypeError, match="factory"):
        rayzero.fit(Unpicklable(), {"workers": 1, "storage": str(tmp_path)}, config=CONFIG, data=Regression())
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    with pytest.raises(PermissionError, match="cannot write to the run storage"):
        rayzero.fit(model_factory, {"workers": 1, "storage": str(blocker / "runs")}, config=CONFIG, data=Regression())
    with pytest.raises(RuntimeError, match="too small for 5 worker"):
        rayzero.fit(
            model_factory,
            {"workers": 5, "storage": str(tmp_path), "start_timeout_s": 2},
            config={**CONFIG, "train_batch_size": 10},
            data=Regression(),
        )
    with pytest.raises(rayzero.ConfigError, match="cannot be kept at every world size"):
        rayzero.fit(model_factory, {"workers": (1, 3), "storage": str(tmp_path)}, config={**CONFIG, "train_batch_size": 8},
                    data=Regression())


def test_plan_that_cannot_fit_in_node_memory_is_rejected(tmp_path):
    from rayzero.memory import model_state_bytes_per_worker

    assert model_state_bytes_per_worker(1000, 0, 2, False) == 16_000
    assert model_state_bytes_per_worker(1000, 2, 2, False) == 4_000 + 8_000
    assert model_state_bytes_per_worker(1000, 3, 4, False) == 4_000
    # a model whose parameters are stand-ins (no memory) but claim 2**36 elements: 1 TiB of state
    big = torch.nn.Linear(1, 1)
    big.weight = torch.nn.Parameter(torch.zeros(1).expand(2**18, 2**18))
    with pytest.raises(rayzero.ConfigError, match="the plan cannot fit"):
        rayzero.fit(big, {"workers": 1, "storage": str(tmp_path)}, config=CONFIG, data=Regression())


def _stream(rank, world, micro):
    g = torch.Generator().manual_seed(rank)
    while True:
        x = torch.randn(micro, 7, generator=g)
        yield x, x[:, :5] * 2


def test_iterable_factory_and_ray_dataset_inputs(tmp_path):
    result = rayzero.fit(
        model_factory, {"workers": 2, "storage": str(tmp_path), "name": "stream", "progress": False},
        config=CONFIG, data=_stream, loss_fn=mse, max_steps=4,
    )
    assert len(result.losses) == 4 and all(l == l for l in result.losses)

    items = [{"x": [float(i % 7)] * 7, "y": [float(i % 5)] * 5} for i in range(48)]
    dataset = ray.data.from_items(items)

    def step(engine, batch):
        out = engine(batch["x"].float())
        loss = torch.nn.functional.mse_loss(out.float(), batch["y"].float())
        engine.backward(loss)
        engine.step()
        return loss

    result = rayzero.fit(
        model_factory, {"workers": 2, "storage": str(tmp_path), "name": "raydata", "progress": False},
        config=CONFIG, data=dataset, train_step=step, max_steps=3,
    )
    assert len(result.losses) == 3 and result.world_sizes == [2]
