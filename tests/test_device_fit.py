"""GPU readiness without a GPU: the rank's device binding, rayzero's groups over a gloo default group, the
worker's batches and loss on the device, and ``rayzero.fit`` end to end on the stand-in device
(tests/standin_device.py), each against the same run on the CPU."""

from __future__ import annotations

import os

import pytest
import torch

import device_fit_cases
import rayzero
from distributed import run_distributed, run_once
from ray_cases import Regression, cpu_fit, model_factory, mse
import shared_ray

TESTS = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(TESTS)


# ---- without Ray ---------------------------------------------------------------------------------------


def test_zero_init_puts_the_shards_on_the_rank_device():
    """LOCAL_RANK=1 binds device 1 before zero_init makes its shards (and its group: a gloo default group
    here, so on the device rayzero's own group of the device backend carries them); the stand-in accelerator
    with host storage records the binding too.  The shards are those of the plain CPU build."""
    plain = run_distributed(device_fit_cases.zero_init_on_the_rank_device, 2, False, "cpu")
    for accelerator in ("device", "host-storage"):
        bound = run_distributed(device_fit_cases.zero_init_on_the_rank_device, 2, accelerator == "device", "standin")
        for rank, (b, p) in enumerate(zip(bound, plain)):
            assert b["set_devices"] == [rank], accelerator
            assert b["devices"] == ([f"standin:{rank}"] if accelerator == "device" else ["cpu"])
            assert p["devices"] == ["cpu"] and p["set_devices"] is None
            for name, shard in p["shards"].items():
                assert torch.equal(b["shards"][name], shard), name


def test_two_ranks_bound_to_one_device_stop_at_set_up():
    # (whichever rank reports first)
    with pytest.raises(AssertionError, match=r"rank [01] and rank\(s\) \[[01]\] of the same host are bound to "
                                             r"one standin device \(standin:0: LOCAL_RANK=[02].*resources_per_worker"):
        run_distributed(device_fit_cases.two_ranks_on_one_device, 2, init_pg=False)


def test_groups_over_a_gloo_default_group_carry_device_tensors():
    for r in run_distributed(device_fit_cases.a_gloo_group_given_for_device_tensors, 2):
        assert (r["default"], r["world"]) == ("gloo", "standin")
        assert torch.equal(r["total"], torch.tensor([3.0]))
        assert "does not carry standin tensors" in r["refused"]
        assert "new_group(ranks, backend='standin')" in r["refused"]


def test_expert_parallel_over_a_gloo_default_group():
    """The MoE all-to-all (and the TP regions) call torch directly on the EP / TP groups: over a gloo default
    group those are rayzero's groups of the device backend, and AutoEP 2 trains as on the CPU.  (The TP
    group comes from the same place; tests/test_device_backend.py runs AutoTP on the device.)"""
    import device_cases

    model, ep, tp = "qwen3_moe_noaux", 2, 1
    on_device = run_distributed(device_cases.parallel_on_device, 2, True, model, ep, tp)  # gloo default group
    on_cpu = run_once(device_cases.parallel_on_device, 2, False, model, ep, tp)  # tests/test_device_backend.py's too
    for d, c in zip(on_device, on_cpu):
        torch.testing.assert_close(d["losses"], c["losses"], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(d["norms"], c["norms"], rtol=1e-5, atol=1e-6)
        for k, v in c["weights"].items():
            torch.testing.assert_close(d["weights"][k], v, rtol=1e-5, atol=1e-6)


def test_batches_reach_the_device_whatever_their_nesting():
    r = run_distributed(device_fit_cases.nested_batch_to_device, 1, init_pg=False)[0]
    assert r["devices"] == ["standin:0"] * 4
    assert r["types"] == ["Pair", "list", "tuple"] and r["others"] == ["text", 3]
    assert torch.equal(r["values"][0], torch.ones(2)) and torch.equal(r["values"][1], torch.arange(4))


def test_the_worker_reads_the_loss_once_a_step_whatever_the_micro_batches():
    r = run_distributed(device_fit_cases.loss_reads_per_step, 2, init_pg=False)
    for rank in r:
        # one read a step, whatever the accumulation: the clipping norm's (the loss is read after the step)
        assert rank["reads"] == {1: 1, 4: 1}
        assert all(device == "standin:0" for device, _ in rank["losses"].values())


def test_fractional_gpus_are_refused_before_launch():
    with pytest.raises(rayzero.ConfigError, match=r"'GPU': 0.5.*two ranks cannot share one device.*'GPU': 1"):
        rayzero.ClusterConfig(workers=2, use_gpu=True, resources_per_worker={"CPU": 1, "GPU": 0.5}).validate()
    rayzero.ClusterConfig(workers=2, use_gpu=True, resources_per_worker={"CPU": 1, "GPU": 1}).validate()


def test_an_accelerator_named_by_its_factory_loads_in_any_process(monkeypatch):
    from rayzero.accelerator import ACCELERATOR_ENV_VAR, _factories, _instances, get_accelerator

    key = "device_cases:standinaccelerator"
    monkeypatch.setenv(ACCELERATOR_ENV_VAR, "device_cases:StandInAccelerator")
    try:
        acc = get_accelerator()
        assert type(acc).__name__ == "StandInAccelerator" and get_accelerator() is acc
    finally:
        _factories.pop(key, None)
        _instances.pop(key, None)
    monkeypatch.setenv(ACCELERATOR_ENV_VAR, "device_cases:NoSuchFactory")
    with pytest.raises(ValueError, match="cannot be loaded.*AttributeError.*PYTHONPATH"):
        get_accelerator()
    _factories.pop("device_cases:nosuchfactory", None)


# ---- rayzero.fit on a local Ray cluster ----------------------------------------------------------------

ray = pytest.importorskip("ray")
SHARED_RAY = True  # runs on the suite's one local cluster (tests/shared_ray.py)

CONFIG = {
    "train_batch_size": 12,
    "train_micro_batch_size_per_gpu": 3,  # two micro-batches a step on each of the two workers
    "zero_optimization": {"stage": 0, "reduce_bucket_size": 40, "stage3_param_persistence_threshold": 20},
    "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
    "gradient_clipping": 1.0,
}
STEPS = 3


@pytest.fixture(scope="module")
def ray_cluster():
    # the suite's one cluster (tests/shared_ray.py), whose workers import this checkout's rayzero and the
    # tests' modules (the stand-in's factory among them)
    yield shared_ray.start()


def _zero(stage: int, offload: bool) -> dict:
    zero = {**CONFIG["zero_optimization"], "stage": stage}
    if offload:
        zero["offload_optimizer"] = {"device": "cpu"}
    return zero


def _weights(run_dir: str, out) -> dict:
    from rayzero.checkpoint.tools import export

    export(run_dir, str(out), tag=f"checkpoint_step{STEPS:08d}")
    return torch.load(out)


def _fit(tmp_path, name: str, stage: int, offload: bool, accelerator: str, monkeypatch):
    from rayzero.accelerator import ACCELERATOR_ENV_VAR

    monkeypatch.setenv(ACCELERATOR_ENV_VAR, accelerator)  # fit hands it to its workers
    result = rayzero.fit(
        model_factory,
        {"workers": 2, "storage": str(tmp_path), "name": name, "checkpoint_every": 0, "progress": False},
        config={**CONFIG, "zero_optimization": _zero(stage, offload)},
        data=Regression(),
        loss_fn=mse,
        max_steps=STEPS,
    )
    assert os.path.basename(result.checkpoint) == f"checkpoint_step{STEPS:08d}"
    return result.losses, _weights(result.run_dir, tmp_path / f"{name}.pt")


# stage 3 resizes parameter storages, which the stand-in device cannot: it runs on the stand-in accelerator
# whose tensors are host tensors (device binding and the worker path, not device placement)
ON_DEVICE = "device_fit_cases:OwnDeviceAccelerator"
HOST_STORAGE = "device_cases:StandInAccelerator"

# Stages 0-2 differ from each other only inside the engine, which tests/test_device_backend.py trains on the
# device at each of them; each fit here costs ~20-40 s of Ray Train start-up, so the worker path runs twice: at
# stage 3 with the host-storage accelerator, and at stage 2 with offload on the rank's own device.
CASES = {"stage3": (3, False, HOST_STORAGE), "stage2-offload": (2, True, ON_DEVICE)}


@pytest.fixture(scope="module")
def cpu_reference(tmp_path_factory):
    """Every case's CPU run, once, without Ray: the worker's own step, samples, model build and loss read on
    two gloo processes (ray_cases.cpu_fit); per case its losses and exported weights."""
    root = tmp_path_factory.mktemp("cpu")
    cases = [{"name": name, "config": {**CONFIG, "zero_optimization": _zero(stage, offload)}}
             for name, (stage, offload, _) in CASES.items()]
    losses = run_distributed(cpu_fit, 2, cases, STEPS, str(root))[0]
    return {case["name"]: (case_losses, _weights(str(root / case["name"]), root / f"{case['name']}.pt"))
            for case, case_losses in zip(cases, losses)}


@pytest.mark.parametrize("name", list(CASES))
def test_fit_on_the_device_equals_fit_on_the_cpu(ray_cluster, cpu_reference, tmp_path, monkeypatch, name):
    """Two workers under Ray Train's gloo default group (no GPUs asked for): the batches, the loss and every
    collective of the engine run on the stand-in device, through rayzero's group of the stand-in backend.
    The reference is the same training on the CPU (the worker's step without Ray, which
    tests/test_ray_fit.py checks ``rayzero.fit`` against)."""
    stage, offload, accelerator = CASES[name]
    losses, weights = _fit(tmp_path, "device", stage, offload, accelerator, monkeypatch)
    cpu_losses, cpu_weights = cpu_reference[name]
    # Bitwise: the stand-in computes each operator on the CPU, and with two ranks every sum across them has
    # two addends, which any backend adds to the same value.
    assert losses == cpu_losses and len(losses) == STEPS
    assert weights.keys() == cpu_weights.keys()
    for k, v in cpu_weights.items():
        assert torch.equal(weights[k], v), k
