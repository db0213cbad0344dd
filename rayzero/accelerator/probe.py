"""What a node's device really does, found by running it: the node's accelerator actor calls ``probe``.

An accelerator's ``is_bf16_supported()`` and friends say what its kind promises; a probe runs a few tiny
kernels on the device itself and checks their results, so a driver, a card or a build that breaks a
promise shows up in the node table before training starts, not as a crash or a wrong loss in step one.

* ``bf16`` / ``fp16``: a matrix product in the dtype agrees with the fp32 one;
* ``fused_optimizer``: torch's fused AdamW takes one step and moves the weight as the loop one does;
* ``graph_capture``: the registry and the process allow it (``supports_graph_capture``); on a device
  whose capture is cheap to try (CUDA graphs), a one-kernel graph is recorded and replayed on new input.
  On the CPU a real capture means a compile of tens of seconds, so there the probe stops at the compiler
  check.

Each entry is ``True``/``False``; a failure's reason is under ``errors``.
"""

from __future__ import annotations

from typing import Any

import torch

def _matmul(acc: Any, dtype: torch.dtype) -> bool:
    if not (acc.is_bf16_supported() if dtype == torch.bfloat16 else acc.is_fp16_supported()):
        return False
    g = torch.Generator().manual_seed(0)
    a, b = (torch.randn(16, 16, generator=g) for _ in range(2))
    want = a @ b
    got = (a.to(acc.device(), dtype) @ b.to(acc.device(), dtype)).float().cpu()
    return bool(torch.allclose(got, want, rtol=0.05, atol=0.25))


def _fused_adamw(acc: Any) -> bool:
    if not acc.supports_fused_optimizer():
        return False
    weights = []
    for fused in (True, False):
        p = torch.nn.Parameter(torch.ones(8, device=acc.device()))
        p.grad = torch.linspace(-1.0, 1.0, 8, device=acc.device())
        torch.optim.AdamW([p], lr=0.1, fused=fused, foreach=False if not fused else None).step()
        weights.append(p.detach().cpu())
    return bool(torch.allclose(weights[0], weights[1], rtol=1e-5, atol=1e-6))


def _graph_capture(acc: Any) -> bool:
    if not acc.supports_graph_capture():
        return False
    if acc.device().type != "cuda":
        return True  # the registry and the compiler allow it; a real capture here is a full compile
    x = torch.zeros(4, device=acc.device())
    y = torch.empty(4, device=acc.device())
    graph = acc.create_graph()
    with acc.capture_to_graph(graph) as rec:
        rec.record(lambda t, out: torch.mul(t, 2.0, out=out), x, y)
    x.fill_(3.0)
    acc.replay_graph(graph)
    acc.synchronize()
    return bool(torch.equal(y.cpu(), torch.full((4,), 6.0)))


def probe(acc: Any) -> dict:
    """Run every probe on ``acc``'s current device; ``{name: bool, ..., "errors": {name: reason}}``."""
    checks = {
        "bf16": lambda: _matmul(acc, torch.bfloat16),
        "fp16": lambda: _matmul(acc, torch.float16),
        "fused_optimizer": lambda: _fused_adamw(acc),
        "graph_capture": lambda: _graph_capture(acc),
    }
    out: dict = {"errors": {}}
    for name, check in checks.items():
        try:
            out[name] = check()
        except Exception as e:  # noqa: BLE001 - a failing probe is a finding, not a crash
            out[name] = False
            out["errors"][name] = f"{type(e).__name__}: {e}"
    return out
