"""Optimizer on NVMe: gradient partitions swapped sub-group by sub-group, zero_init shards written straight to
the NVMe path, masters built one sub-group at a time (offload/gradients.py, offload/optimizer.py,
zero/init.py).  Oracle: the same model and data without offload, on 2 gloo ranks."""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F

import rayzero
from distributed import run_distributed

DIM, HIDDEN, BLOCKS = 32, 96, 4


def _model() -> torch.nn.Module:
    return torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(DIM, HIDDEN), torch.nn.GELU(),
                                                     torch.nn.Linear(HIDDEN, DIM)) for _ in range(BLOCKS)])


def _config(world: int, zero: dict, gas: int, optimizer: dict) -> dict:
    return {"train_batch_size": 4 * world * gas, "train_micro_batch_size_per_gpu": 4,
            "gradient_accumulation_steps": gas, "gradient_clipping": 0.5,
            # small sub-groups and buckets: several sub-groups, several buckets per sub-group
            "zero_optimization": {"stage": 3, "sub_group_size": 4000, "reduce_bucket_size": 1500,
                                  "stage3_param_persistence_threshold": 40, **zero},
            "optimizer": optimizer}


def _run(rank: int, world: int, zero: dict, gas: int, optimizer: dict, use_zero_init: bool,
         shard_dir: str | None = None) -> dict:
    cfg = _config(world, zero, gas, optimizer)
    if use_zero_init:
        with rayzero.zero_init(seed=0, config=cfg):
            model = _model()
            # while the model exists only as shards, they are files under the NVMe path, not tensors
            sharded = [p._rayzero_shard for p in model.parameters()]
            in_memory = sum(isinstance(s, torch.Tensor) for s in sharded)
            del sharded
            files = sorted(os.listdir(os.path.join(shard_dir, "rayzero-swap"))) if shard_dir else []
    else:
        torch.manual_seed(0)
        model = _model()
        in_memory, files = None, []
    engine = rayzero.initialize(model, cfg)
    g = torch.Generator().manual_seed(100 + rank)
    losses, norms, grads_held, on_disk = [], [], [], []
    for _ in range(3):
        for _ in range(gas):
            x = torch.randn(4, DIM, generator=g)
            loss = F.mse_loss(engine(x), x.flip(-1))
            engine.backward(loss)
            losses.append(loss.item())
            # between backward and step: no gradient partition in memory
            grads_held.append(sum(p.grad.numel() for p in engine.partitions.groups))
            swap = engine.partitions.grad_swap
            on_disk.append(None if swap is None else sorted(set(swap.state)))
            engine.step()
        norms.append(engine.global_grad_norm)
    state = {k: v.clone() for k, v in engine.full_state_dict().items()}
    groups = len(engine.partitions.groups)
    engine.destroy()
    root = os.path.join(shard_dir, "rayzero-swap") if shard_dir else None
    left = sorted(os.listdir(root)) if root and os.path.isdir(root) else []
    return dict(losses=losses, norms=norms, state=state, grads_held=grads_held, on_disk=on_disk, groups=groups,
                in_memory=in_memory, files=files, left=left)


def _cases(rank: int, world: int, swap: str) -> list[dict]:
    nvme = {"offload_optimizer": {"device": "nvme", "nvme_path": swap},
            "offload_param": {"device": "nvme", "nvme_path": swap}}
    adamw = {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01}}
    sgd = {"type": "SGD", "params": {"lr": 0.1, "momentum": 0.9}}  # not fused: the clip multiplier is a mul_
    return [
        _run(rank, world, {}, 2, adamw, True),
        _run(rank, world, nvme, 2, adamw, True, shard_dir=swap),
        _run(rank, world, {}, 1, sgd, False),
        _run(rank, world, {"offload_optimizer": {"device": "nvme", "nvme_path": swap}}, 1, sgd, False),
    ]


def test_nvme_gradients_match_no_offload(tmp_path):
    swap = str(tmp_path / "swap")
    os.makedirs(swap)
    plain, nvme, plain_sgd, nvme_sgd = run_distributed(_cases, 2, swap)[0]
    for ref, got in ((plain, nvme), (plain_sgd, nvme_sgd)):
        torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(ref["losses"]), rtol=1e-6, atol=0)
        torch.testing.assert_close(torch.tensor(got["norms"]), torch.tensor(ref["norms"]), rtol=1e-6, atol=0)
        for k in ref["state"]:
            torch.testing.assert_close(got["state"][k], ref["state"][k], rtol=1e-6, atol=1e-7)
        assert got["groups"] > 2  # several sub-groups, each swapped on its own
        # the gradient partitions are in the swap store after every backward, not in memory
        assert set(got["grads_held"]) == {0}
        assert all(s == ["disk"] for s in got["on_disk"]), got["on_disk"]
        assert set(ref["grads_held"]) != {0}
    # zero_init under the NVMe config: the shards were files, never tensors, and every file is gone after
    assert nvme["in_memory"] == 0
    assert any("-zero-init-" in f for f in nvme["files"])
    assert not any("-zero-init-" in f for f in nvme["left"]), nvme["left"]
    assert plain["in_memory"] == 2 * BLOCKS * 2
