"""Graph capture: the accelerator API, and captured training equal to eager training on 2 gloo ranks.

Captured runs compile with inductor (a C++ compiler on this machine); every comparison is against the
same run with capture off, which tests/test_zero.py checks against single-process torch.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from distributed import run_distributed

import capture_cases

pytestmark = pytest.mark.skipif(
    not __import__("rayzero.accelerator.graphs", fromlist=["x"]).cpu_compiler_available(),
    reason="inductor needs a C++ compiler on PATH",
)


def _close(eager: dict, captured: dict, tol: float = 1e-5) -> None:
    assert len(eager["norms"]) == len(captured["norms"])
    for a, b in zip(eager["norms"], captured["norms"]):
        assert a == pytest.approx(b, rel=tol, abs=tol, nan_ok=True)  # an overflowed step's norm is nan or inf
    for a, b in zip(eager["losses"], captured["losses"]):
        assert a == pytest.approx(b, rel=tol, abs=tol)
    assert eager["state"].keys() == captured["state"].keys()
    for k in eager["state"]:
        torch.testing.assert_close(captured["state"][k], eager["state"][k], rtol=tol, atol=tol)
    assert eager["skipped"] == captured["skipped"] and eager["scale"] == captured["scale"]
    assert eager["lr"] == pytest.approx(captured["lr"])


def test_cpu_graph_api_records_then_replays_static_tensors():
    (r,) = run_distributed(capture_cases.graph_api, 1, "cpu", init_pg=False)
    assert torch.equal(r["after_record"], torch.zeros(4))  # recording runs nothing
    torch.testing.assert_close(r["first"], r["expect_first"])
    torch.testing.assert_close(r["second"], r["expect_second"])  # a replay reads the inputs' new values
    assert len(r["errors"]) == 3
    assert "only valid inside capture_to_graph" in r["errors"][0]
    assert "inside capture_to_graph() of the same graph" in r["errors"][1]
    assert "recorded nothing" in r["errors"][2]


def test_graph_capture_doc_example_runs():
    text = (Path(__file__).resolve().parent.parent / "docs" / "graph_capture.md").read_text()
    block = text.split("<!-- tested: tests/test_graph_capture.py -->", 1)[1]
    code = block.split("```python\n", 1)[1].split("```", 1)[0]
    (printed,) = run_distributed(capture_cases.run_code, 1, code, init_pg=False)
    assert printed.strip() == "[3.0, 5.0, 7.0, 9.0]"


def test_capture_is_an_error_where_it_is_off():
    from rayzero.accelerator.graphs import capture_support

    assert capture_support("cpu").enabled and capture_support("cuda").enabled
    for name in ("npu", "xpu", "hpu"):
        s = capture_support(name)
        assert not s.enabled and s.mechanism  # declared, with how, but off
    (msg,) = run_distributed(capture_cases.refused, 1, {}, "npu")
    assert msg.startswith("ConfigError") and "'npu'" in msg and "NPUGraph" in msg and '"enabled": false' in msg


def test_capture_refuses_offload_and_model_at_stage3():
    assert run_distributed(capture_cases.refused, 1, {}) == ["no error"]  # the same config, no offload
    (off,) = run_distributed(
        capture_cases.refused, 1, {"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}}
    )
    assert off.startswith("ConfigError") and "offload_optimizer" in off
    (model3,) = run_distributed(
        capture_cases.refused, 1, {"zero_optimization": {"stage": 3}, "graph_capture": {"enabled": True, "targets": ["model"]}}
    )
    assert model3.startswith("ConfigError") and "stage 3" in model3


def test_captured_step_equals_eager_at_every_stage():
    """ZeRO 0-3 in fp32 and bf16, clipping, an lr schedule, 2 micro-steps per step: within 1e-5."""
    cases = [dict(stage=s, steps=4, gas=2) for s in (0, 1, 2, 3)]
    cases += [dict(stage=s, steps=4, dtype="bf16") for s in (1, 3)]
    results = run_distributed(capture_cases.pairs, 2, cases, timeout=600)
    for per_rank in results:
        for case, (eager, captured) in zip(cases, per_rank):
            _close(eager, captured)
            # step 1 is eager (warm-up); the norm and the update are recorded once, at step 2
            assert captured["captures"] == [0, 2, 2, 2], case
            assert captured["replays"] == 2 * 3, case


def test_fp16_overflow_still_skips_and_reload_records_again(tmp_path):
    cases = [
        # step 3 overflows: the captured norm is not finite, the update is not replayed
        dict(stage=2, steps=5, dtype="fp16", inf_at=2),
        # save after step 2, load it back after step 4: the load replaces the optimizer's state
        # tensors, so the graphs are recorded again before the next replay
        dict(stage=1, steps=6, ckpt=str(tmp_path), save_at=1, reload_at=3),
        # the model's forward and backward compiled as well
        dict(stage=2, steps=4, capture={"enabled": True, "targets": ["model"]}),
    ]
    results = run_distributed(capture_cases.pairs, 2, cases, timeout=600)
    for per_rank in results:
        (e16, c16), (e_re, c_re), (e_model, c_model) = per_rank
        _close(e16, c16)
        assert c16["skipped"] == 1  # and the loss scale followed eager's (checked in _close)
        assert c16["replays"] == 2 * 4 - 1  # four captured steps, one of them only the norm
        _close(e_re, c_re)
        assert c_re["captures"] == [0, 2, 2, 2, 4, 4]
        _close(e_model, c_model)


def test_compile_cache_lets_a_new_process_skip_inductor(tmp_path):
    """A first run compiles: rank 0 writes the torch.compiler artifacts, and inductor's built kernels land
    in the cache directory too.  A second run, in processes with an empty inductor cache of their own
    (TORCHINDUCTOR_CACHE_DIR set, so rayzero leaves it alone), loads the artifacts and compiles no graph
    again."""
    cache = tmp_path / "cache"
    first = run_distributed(capture_cases.cached, 2, str(cache), timeout=600)
    files = sorted(p.name for p in cache.iterdir())
    assert len(files) == 2 and files[0].startswith("inductor-torch") and files[1].endswith("-cpu.bin")
    assert any((cache / files[0]).rglob("*.so")) or any((cache / files[0]).rglob("*.py"))  # built kernels
    assert first[0]["cache_saved"] == (cache / files[1]).stat().st_size > 0 and first[1]["cache_saved"] == 0
    assert all(r["cache_loaded"] == 0 and r["misses"] > 0 for r in first)
    second = run_distributed(capture_cases.cached, 2, str(cache), env={"TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "own")},
                             timeout=600)
    for a, b in zip(first, second):
        assert b["cache_loaded"] > 0 and b["misses"] == 0 and b["hits"] >= a["misses"]
        assert a["norms"] == b["norms"] and a["losses"] == b["losses"]


def test_sgd_under_cuda_capture_runs_fused_and_reads_nothing_back():
    """On CUDA the captured step's lr is a device tensor, and a CUDA graph cannot replay a read of it:
    rayzero runs SGD's fused kernel (which takes the tensor lr), and refuses the foreach / per-tensor
    kernels (which read it with .item()) at initialize.  Checked on a CPU stand-in named "cuda", counting
    host syncs (tests/sync_count.py) in an eager step with the tensor lr: only the norm's read; and
    get_lr() reads no device tensor."""
    (fused,) = run_distributed(capture_cases.sgd_under_capture, 1, {}, "cuda")
    assert fused["error"] is None and fused["fused"] is True and fused["tensor_lr"]
    assert fused["step_count"] == 1 and "rayzero/optim/clip.py" in fused["step_syncs"], fused["step_syncs"]
    assert fused["lr_syncs"] == "no host syncs"
    # the schedule's value after two steps (lr(1) of its 3-step log warm-up, as DeepSpeed steps it), not the
    # config's 0.1; the device tensor holds it in fp32
    want = 0.01 * math.log(2) / math.log(3)
    assert fused["lr"] == [pytest.approx(want, rel=1e-12)] and fused["lr_on_device"] == pytest.approx([want], rel=1e-6)
    for bad in ({"foreach": True}, {"fused": False}):
        (refused,) = run_distributed(capture_cases.sgd_under_capture, 1, bad, "cuda")
        key = next(iter(bad))
        assert refused["error"].startswith("ConfigError") and f"optimizer.params.{key}" in refused["error"]
        assert "fused SGD" in refused["error"] and "graph_capture" in refused["error"]
    adam_cfg = {"optimizer": {"type": "AdamW", "params": {"capturable": False}}}
    (adam,) = run_distributed(capture_cases.refused, 1, adam_cfg, "cuda")
    assert adam.startswith("ConfigError") and "capturable" in adam
