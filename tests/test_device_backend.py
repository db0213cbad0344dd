"""The engine on a second device kind, through a backend that refuses host tensors (tests/standin_device.py).

On a CPU-only machine every tensor is a host tensor, so a flag, norm or loss that the engine built on the
host and handed to a collective would pass unnoticed here and fail first on a GPU node with NCCL.  On the
``standin`` device and backend it fails here.
"""

from __future__ import annotations

import pytest
import torch

import device_cases
from distributed import run_distributed, run_once


def test_the_standin_backend_refuses_host_tensors():
    for rank, r in enumerate(run_distributed(device_cases.backend_refuses_host_tensors, 2, init_pg=False)):
        assert r["device"] == "standin:0"
        assert torch.equal(r["summed"], torch.full((3,), 3.0))
        assert "all_reduce was given a tensor on cpu" in r["refused"]["collective"]
        assert "a host tensor of shape (3,) met a standin tensor" in r["refused"]["operator"]


@pytest.mark.parametrize("stage,offload", [(0, False), (1, False), (2, False), (2, True), (2, "nvme")],
                         ids=["stage0", "stage1", "stage2", "stage2-optimizer-offload", "stage2-nvme-offload"])
def test_the_engine_trains_on_the_device_as_on_the_cpu(stage, offload, tmp_path):
    on_device = run_distributed(device_cases.device_training, 2, stage, True, str(tmp_path / "d"), offload,
                                init_pg=False)
    on_cpu = run_distributed(device_cases.device_training, 2, stage, False, str(tmp_path / "c"), offload)
    for d, c in zip(on_device, on_cpu):
        assert d["devices"] == ["standin:0"] and c["devices"] == ["cpu"]
        # the same arithmetic; only the order in which the backends sum gradients may differ
        torch.testing.assert_close(d["losses"], c["losses"], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(d["norms"], c["norms"], rtol=1e-5, atol=1e-6)
        assert d["state"].keys() == c["state"].keys()
        for k, v in c["state"].items():
            torch.testing.assert_close(d["state"][k], v, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("model,ep,tp", [("qwen3_moe_noaux", 2, 1), ("qwen3", 1, 2)], ids=["autoep2", "autotp2"])
def test_expert_and_tensor_parallel_train_on_the_device_as_on_the_cpu(model, ep, tp):
    """AutoEP 2 on a tiny Qwen3-MoE (the experts' token counts and tokens cross ranks with all-to-all) and
    AutoTP 2 on a tiny Qwen3 (row-parallel outputs all-reduced), on the device.  The MoE model has no
    router auxiliary loss: its transformers code branches on the device kind."""
    on_device = run_distributed(device_cases.parallel_on_device, 2, True, model, ep, tp, init_pg=False)
    # (the AutoEP reference is also that of tests/test_device_fit.py: run once a session)
    on_cpu = run_once(device_cases.parallel_on_device, 2, False, model, ep, tp)
    for d, c in zip(on_device, on_cpu):
        torch.testing.assert_close(d["losses"], c["losses"], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(d["norms"], c["norms"], rtol=1e-5, atol=1e-6)
        for k, v in c["weights"].items():
            torch.testing.assert_close(d["weights"][k], v, rtol=1e-5, atol=1e-6)
