"""One rank under an RLIMIT_AS budget (run as a script by test_offload.py): builds a 16.8M-parameter model,
limits its address space to what it holds now plus ``budget_mb``, then trains 3 steps at ZeRO stage 3 with
the optimizer offload given on the command line.  Prints one JSON line: the losses, or the error."""

from __future__ import annotations

import json
import resource
import sys

import torch


def vm_size() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmSize:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmSize in /proc/self/status")


def main(device: str, swap_root: str, budget_mb: int) -> None:
    import rayzero

    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(1024, 1024) for _ in range(16)])
    off = {"device": device, **({"nvme_path": swap_root} if device in ("nvme", "auto") else {})}
    cfg = {
        "train_micro_batch_size_per_gpu": 4,
        "zero_optimization": {"stage": 3, "sub_group_size": 1 << 20, "stage3_param_persistence_threshold": 0,
                              "offload_optimizer": {**off, "buffer_count": 2}},
        "aio": {"block_size": 1 << 20, "queue_depth": 2, "thread_count": 1},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
    }
    x = torch.randn(4, 1024, generator=torch.Generator().manual_seed(1))
    limit = vm_size() + budget_mb * (1 << 20)
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    try:
        engine = rayzero.initialize(model, cfg)
        losses = []
        for _ in range(3):
            loss = engine(x).pow(2).mean()
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
        chosen = engine.offload_device
        engine.destroy()
        print(json.dumps({"losses": losses, "offload": chosen}))
    except Exception as e:  # reported to the test, which checks the message
        print(json.dumps({"error": f"{type(e).__name__}: {e}"}))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]))
