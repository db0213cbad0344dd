"""No leaks: over 1,000 steps, and over 20 initialize/destroy cycles, a rank's resident memory and its count
of live tensors stay flat after warm-up (real gloo processes, every ZeRO stage, CPU and NVMe offload)."""

from __future__ import annotations

import ctypes
import gc
import weakref

import psutil
import pytest
import torch
import torch.nn.functional as F

import rayzero
from distributed import run_distributed

STEPS, WARMUP = 1000, 100


def settled() -> tuple[int, int]:
    """(RSS, live tensors) with freed memory handed back: what is still held, not what glibc keeps cached."""
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except OSError:
        pass
    tensors = sum(1 for o in gc.get_objects() if isinstance(o, torch.Tensor))
    return psutil.Process().memory_info().rss, tensors


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 256),
                               torch.nn.GELU(), torch.nn.Linear(256, 16))


def _config(stage: int, offload: str, swap_root: str) -> dict:
    zero = {"stage": stage, "reduce_bucket_size": 20_000, "allgather_bucket_size": 20_000,
            "stage3_param_persistence_threshold": 300}
    if offload != "none":
        zero["offload_optimizer"] = {"device": offload, **({"nvme_path": swap_root} if offload == "nvme" else {})}
        if offload == "nvme":
            zero["sub_group_size"] = 30_000
    return {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2, "gradient_clipping": 1.0,
            "zero_optimization": zero, "bf16": {"enabled": stage in (1, 3)},
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}}}


def long_run(rank: int, world: int, cases: list[tuple[int, str]], swap_root: str) -> list[dict]:
    g = torch.Generator().manual_seed(rank)
    data = [(torch.randn(4, 64, generator=g), torch.randn(4, 16, generator=g)) for _ in range(8)]
    out = []
    for stage, offload in cases:
        engine = rayzero.initialize(_model(), _config(stage, offload, swap_root))
        marks = {}
        for step in range(STEPS):
            for k in range(2):
                x, y = data[(2 * step + k) % len(data)]
                engine.backward(F.mse_loss(engine(x).float(), y))
                engine.step()
            if step + 1 in (WARMUP, STEPS):
                if engine.swap is not None:  # writes still in flight hold views of the pool's buffers
                    engine.swap.flush()
                marks[step + 1] = settled()
        out.append({"case": (stage, offload), "marks": marks, "steps": engine.global_steps})
        engine.destroy()
    return out


CASES = [(0, "none"), (1, "none"), (2, "none"), (3, "none"), (2, "cpu"), (3, "nvme")]


@pytest.mark.parametrize("cases", [CASES[:3], CASES[3:]], ids=["stages0-2", "stage3-offload"])
def test_rss_and_live_tensors_stay_flat_over_1000_steps(tmp_path, cases):
    for rank_result in run_distributed(long_run, 2, cases, str(tmp_path / "swap"), timeout=900):
        for r in rank_result:
            assert r["steps"] == STEPS
            (rss0, tensors0), (rss1, tensors1) = r["marks"][WARMUP], r["marks"][STEPS]
            growth = (rss1 - rss0) / rss0
            assert growth < 0.01, f"{r['case']}: RSS grew {growth:.2%} from step {WARMUP} to {STEPS} ({rss0} -> {rss1})"
            assert tensors1 <= tensors0, f"{r['case']}: live tensors {tensors0} -> {tensors1}"
    assert not list((tmp_path / "swap").rglob("*.swap"))


def test_repeated_initialize_and_destroy_keeps_memory_and_tensors_flat():
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(512, 512) for _ in range(8)])  # 2.1M params, ~8 MB
    x = torch.randn(4, 512)
    alive = []

    def cycle(stage):
        engine = rayzero.initialize(model, {"zero_optimization": {"stage": stage}, "bf16": {"enabled": stage == 1}})
        alive.append(weakref.ref(engine))
        for _ in range(2):
            engine.backward(engine(x).float().pow(2).mean())
            engine.step()
        # stage 3's destroy leaves the partitioned parameters freed (it gathers nothing): take them first
        state = engine.full_state_dict() if stage == 3 else None
        engine.destroy()
        if state is not None:
            model.load_state_dict(state, assign=True)
        model.float()

    for i in range(4):  # warm up allocator pools and lazy imports, once per stage
        cycle(i % 4)
    rss0, tensors0 = settled()
    for i in range(20):
        cycle(i % 4)
    rss1, tensors1 = settled()
    assert not [r for r in alive if r() is not None], "destroyed engines are still referenced"
    growth = (rss1 - rss0) / rss0
    assert growth < 0.01, f"RSS grew {growth:.2%} over 20 initialize/destroy cycles ({rss0} -> {rss1} bytes)"
    assert tensors1 <= tensors0, f"live tensors {tensors0} -> {tensors1} over 20 initialize/destroy cycles"
