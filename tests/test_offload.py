"""Optimizer offload to CPU and NVMe trains like the same run without offload (real gloo processes)."""

from __future__ import annotations

import pytest
import torch

from distributed import run_distributed
from offload_cases import accumulate_run, resume_run, run_offload_cases, run_param_offload_cases
from zero_cases import reference_run

STEPS, BATCH = 3, 12


def _assert_state_close(got: dict, expected: dict, what) -> None:
    assert list(got) == list(expected)
    for name in expected:
        torch.testing.assert_close(got[name], expected[name], rtol=1e-5, atol=1e-5, msg=lambda m: f"{what}: {name}: {m}")


def _pairs(world: int, devices: tuple[str, ...], swap_root: str | None = None, **common) -> list:
    """For every stage 1-3 and case, the run without offload and the same run with each device."""
    variants = [dict(gas=2, unused=True), dict(gas=2, unused=True, manual="after")]
    cases = []
    for stage in (1, 2, 3):
        for v in variants:
            for device in ("none", *devices):
                cases.append(dict(stage=stage, device=device, steps=STEPS, global_batch=BATCH, swap_root=swap_root,
                                  **v, **common))
    return cases


def _check_parity(cases: list, results: list, bitwise: bool = False) -> None:
    ref = reference_run(STEPS, BATCH, unused=True)
    plain = {}
    for case, got in zip(cases, results):
        key = (case["stage"], case.get("manual"))
        if case["device"] == "none":
            plain[key] = got
            continue
        base = plain[key]
        if bitwise:
            for name in base["state"]:
                assert torch.equal(got["state"][name], base["state"][name]), (case, name)
            assert got["losses"] == base["losses"] and got["norms"] == base["norms"], case
        else:
            _assert_state_close(got["state"], base["state"], case)
            assert got["losses"] == pytest.approx(base["losses"], rel=1e-5), case
            assert got["norms"] == pytest.approx(base["norms"], rel=1e-5), case
        # and both still train like single-process torch
        for name in ref["state"]:
            torch.testing.assert_close(got["state"][name], ref["state"][name], rtol=1e-4, atol=5e-5)


@pytest.mark.parametrize("world", [2, 3])
def test_cpu_offload_matches_no_offload(world):
    cases = _pairs(world, ("cpu",))
    _check_parity(cases, run_distributed(run_offload_cases, world, cases)[0])


def _accumulate_all(rank: int, world: int, swap_root: str | None, devices: tuple) -> list:
    return [accumulate_run(rank, world, stage, device, swap_root) for stage in (1, 2, 3) for device in devices]


def test_backward_calls_between_steps_accumulate_with_offload(tmp_path):
    """Gradients 1, 2 and 4 over three backward calls give 7 at the step (gradient_accumulation_steps 1);
    a parameter with no gradient in some of them gets only what the others gave."""
    devices = ("cpu", "nvme")
    for state in run_distributed(_accumulate_all, 2, str(tmp_path / "swap"), devices)[0]:
        assert torch.equal(state["a"], torch.full((37,), -7.0))
        assert torch.equal(state["b"], torch.full((11,), -3.0))


@pytest.mark.parametrize("stage", [1, 3])
def test_checkpoint_resume_with_cpu_offload_keeps_fp32_state(tmp_path, stage):
    """bf16 compute, optimizer offloaded to the CPU: after a load the masters and moments are fp32 on the
    host, and training continues exactly as if it had not stopped."""
    out = run_distributed(resume_run, 2, stage, "cpu", str(tmp_path / "ckpt"))[0]
    assert out["second"] == out["first"]
    for name in out["straight"]:
        assert torch.equal(out["resumed"][name], out["straight"][name]), name
    assert out["states"] and set(out["states"]) == {("torch.float32", "cpu")}
    assert set(out["masters"]) == {("torch.float32", "cpu")}


@pytest.mark.parametrize("world", [2, 3])
def test_nvme_offload_matches_no_offload(tmp_path, world):
    """Masters and moments in O_DIRECT swap files (sub-groups of 300 elements, so every step reads and
    writes several), against the same runs without offload."""
    cases = _pairs(world, ("nvme",), swap_root=str(tmp_path / "swap"))
    _check_parity(cases, run_distributed(run_offload_cases, world, cases)[0])
    assert not list((tmp_path / "swap").rglob("*.*")), "destroy() leaves no swap files"


@pytest.mark.parametrize("stage, saved_with, loaded_with", [(2, "nvme", "nvme"), (3, "nvme", "none"), (1, "none", "nvme")])
def test_checkpoint_resume_across_nvme_offload(tmp_path, stage, saved_with, loaded_with):
    """A save from swapped state and a load into it: the run continues bitwise, moments stay fp32."""
    out = run_distributed(resume_run, 2, stage, saved_with, str(tmp_path / "ckpt"), str(tmp_path / "swap"),
                          loaded_with)[0]
    assert out["second"] == out["first"]
    for name in out["straight"]:
        assert torch.equal(out["resumed"][name], out["straight"][name]), name
    assert out["states"] and set(out["states"]) == {("torch.float32", "cpu")}
    assert not list((tmp_path / "swap").rglob("*.swap"))


def test_offload_is_bitwise_under_deterministic(tmp_path):
    """deterministic: true, the same config: offloaded runs equal the plain run bit for bit (stage 1 with
    one backward per step, where its reduction is the same as without offload; stages 2 and 3 with
    accumulation and manual boundaries)."""
    root = str(tmp_path / "swap")
    cases = []
    for stage, gas in ((1, 1), (2, 2), (3, 2)):
        for device in ("none", "cpu", "nvme"):
            cases.append(dict(stage=stage, device=device, steps=STEPS, global_batch=BATCH, gas=gas, unused=True,
                              swap_root=root, deterministic=True))
    results = run_distributed(run_offload_cases, 2, cases)[0]
    _check_parity(cases, results, bitwise=True)


def _rank_under_rlimit(device: str, swap_root: str, budget_mb: int) -> dict:
    import json
    import os
    import subprocess
    import sys

    # one malloc arena and a fixed mmap threshold: the address space then tracks what is allocated
    env = dict(os.environ, MALLOC_ARENA_MAX="1", MALLOC_MMAP_THRESHOLD_="65536", OMP_NUM_THREADS="1")
    script = os.path.join(os.path.dirname(__file__), "rlimit_rank.py")
    out = subprocess.run([sys.executable, script, device, swap_root, str(budget_mb)], env=env,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_nvme_offload_trains_where_ram_cannot_hold_the_model_states(tmp_path):
    """16.8M parameters at stage 3 on one rank need 16 bytes each (268 MiB) in memory; RLIMIT_AS leaves
    200 MiB.  Without offload set-up refuses with the fix; with the optimizer on NVMe it trains."""
    refused = _rank_under_rlimit("none", str(tmp_path), 200)
    assert "error" in refused and "RLIMIT_AS" in refused["error"] and "nvme" in refused["error"], refused
    trained = _rank_under_rlimit("nvme", str(tmp_path / "swap"), 200)
    assert "losses" in trained, trained
    assert trained["losses"][2] < trained["losses"][0]
    assert not list((tmp_path / "swap").rglob("*.swap"))
    # "auto" finds the same: the states do not fit under the limit, so the optimizer goes to NVMe ...
    auto = _rank_under_rlimit("auto", str(tmp_path / "swap"), 200)
    assert auto.get("offload") == "nvme" and auto["losses"] == trained["losses"], auto
    # ... and with room to spare it stays in memory, training the same
    roomy = _rank_under_rlimit("auto", str(tmp_path / "swap"), 1200)
    assert roomy.get("offload") == "none" and roomy["losses"] == trained["losses"], roomy


def test_parameter_offload_matches_no_offload(tmp_path):
    """Stage 3 with offload_param on the CPU or NVMe (max_in_cpu small enough that shards are read again),
    alone and with the optimizer offloaded too: bitwise the plain stage-3 run."""
    root = str(tmp_path / "swap")
    common = dict(steps=STEPS, global_batch=BATCH, gas=2, unused=True, swap_root=root)
    cases = [dict(device="none", **common), dict(device="cpu", **common), dict(device="nvme", **common),
             dict(device="nvme", optimizer_device="nvme", **common), dict(device="cpu", optimizer_device="cpu", **common),
             dict(device="cpu", optimizer_device="nvme", **common)]
    results = run_distributed(run_param_offload_cases, 2, cases)[0]
    for case, got in zip(cases[1:], results[1:]):
        for name in results[0]["state"]:
            assert torch.equal(got["state"][name], results[0]["state"][name]), (case, name)
        assert got["losses"] == results[0]["losses"], case
    assert not list((tmp_path / "swap").rglob("*.swap"))


def test_docs_offload_example_runs_and_cleans_up():
    """docs/offload.md's example, run as written: it trains, and destroy() leaves no swap directory."""
    from pathlib import Path

    import re

    from test_docs_examples import run

    doc = Path(__file__).resolve().parent.parent / "docs" / "offload.md"
    marker = re.escape("<!-- tested: tests/test_offload.py -->")
    (code,) = re.findall(marker + r"[ \t]*\n```python[ \t]*\n(.*?)^```", doc.read_text(), re.S | re.M)
    ns = run(code, "docs/offload.md")
    assert len(ns["losses"]) == 5 and ns["losses"][-1] < ns["losses"][0]
    assert not list(Path(ns["swap_root"]).iterdir())
    Path(ns["swap_root"]).rmdir()


@pytest.fixture
def small_filesystem(tmp_path):
    """A real 8 MiB filesystem (tmpfs; mounting needs root): a disk that can fill up."""
    import subprocess

    where = tmp_path / "small_fs"
    where.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8m", "tmpfs", str(where)], capture_output=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a small filesystem here: {done.stderr.decode().strip()}")
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], check=False)


def _fill(directory) -> None:
    import errno
    import os

    with open(os.path.join(directory, "filler"), "wb") as f:
        chunk = b"\0" * (64 << 10)
        try:
            while True:
                f.write(chunk)
                f.flush()
        except OSError as e:
            assert e.errno == errno.ENOSPC


def test_disk_full_mid_run_is_a_clear_error_and_the_checkpoint_survives(tmp_path, small_filesystem):
    import rayzero
    from rayzero.offload.swap_store import SwapFullError

    def build(offload: bool):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.Linear(256, 256))
        zero = {"stage": 2}
        if offload:
            zero["offload_optimizer"] = {"device": "nvme", "nvme_path": str(small_filesystem)}
        return rayzero.initialize(model, {"train_micro_batch_size_per_gpu": 2, "zero_optimization": zero,
                                          "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}}})

    x = torch.randn(2, 256)
    engine = build(True)
    engine.save_checkpoint(str(tmp_path / "ckpt"), tag="start")
    saved = {k: v.clone() for k, v in engine.full_state_dict().items()}
    _fill(small_filesystem)  # something else takes the rest of the disk
    engine.backward(engine(x).pow(2).mean())
    with pytest.raises(SwapFullError) as e:
        engine.step()  # the optimizer state's first write has no room
    assert str(small_filesystem) in str(e.value) and "free space" in str(e.value)
    engine.destroy()
    fresh = build(False)
    fresh.load_checkpoint(str(tmp_path / "ckpt"), tag="start")
    for name, t in fresh.full_state_dict().items():
        assert torch.equal(t, saved[name]), name
    fresh.destroy()


def test_not_enough_disk_at_start_is_refused_before_training(small_filesystem):
    import rayzero
    from rayzero.offload.swap_store import SwapFullError

    model = torch.nn.Linear(1024, 1024)  # 4 MiB master + 8 MiB of AdamW moments > 8 MiB of disk
    with pytest.raises(SwapFullError, match="free space"):
        rayzero.initialize(model, {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {
            "stage": 1, "offload_optimizer": {"device": "nvme", "nvme_path": str(small_filesystem)}}})
    assert not any(small_filesystem.rglob("*.swap"))
