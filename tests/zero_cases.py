"""Models, data, the single-process torch reference, and the per-rank training runs the ZeRO tests compare."""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
import torch.nn.functional as F

import rayzero

# Sizes that divide by neither 2 nor 3, so every world size pads.
IN, H1, H2, OUT = 13, 37, 29, 7


class MLP(torch.nn.Module):
    def __init__(self, dropout: float = 0.0, unused: bool = False):
        super().__init__()
        self.fc1 = torch.nn.Linear(IN, H1)
        self.fc2 = torch.nn.Linear(H1, H2)
        self.fc3 = torch.nn.Linear(H2, OUT)
        self.drop = torch.nn.Dropout(dropout)
        # Never used in forward: must get zero gradients, not errors or stale values.
        self.spare = torch.nn.Linear(5, 5) if unused else None

    def forward(self, x):
        x = self.drop(torch.tanh(self.fc1(x)))
        x = torch.tanh(self.fc2(x))
        return self.fc3(x)


def make_model(seed: int = 0, **kw) -> MLP:
    torch.manual_seed(seed)
    return MLP(**kw)


def batches(steps: int, global_batch: int, seed: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(global_batch, IN, generator=g), torch.randn(global_batch, OUT, generator=g)) for _ in range(steps)]


def param_groups_of(model: torch.nn.Module, lr: float) -> list[dict]:
    decay = [p for n, p in model.named_parameters() if n.endswith("weight")]
    no_decay = [p for n, p in model.named_parameters() if n.endswith("bias")]
    return [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0, "lr": lr * 2}]


def reference_run(
    steps: int,
    global_batch: int,
    lr: float = 1e-2,
    clip: float = 0.3,
    weight_decay: float = 0.01,
    groups: bool = False,
    unused: bool = False,
) -> dict:
    """Plain torch, one process, the whole global batch per step: the oracle."""
    model = make_model(unused=unused)
    params = param_groups_of(model, lr) if groups else model.parameters()
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay)
    losses, norms = [], []
    for x, y in batches(steps, global_batch):
        loss = F.mse_loss(model(x), y)
        loss.backward()
        for p in model.parameters():  # unused parameters get zero gradients, as data parallelism gives them
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), clip if clip > 0 else float("inf"))))
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return {"losses": losses, "norms": norms, "state": copy.deepcopy(model.state_dict())}


def base_config(stage: int, world: int, global_batch: int, gas: int = 1, **extra) -> dict:
    cfg = {
        "train_batch_size": global_batch,
        "gradient_accumulation_steps": gas,
        "zero_optimization": {
            "stage": stage,
            # small buckets so every run has several of them, and a parameter larger than a bucket
            "reduce_bucket_size": 500,
            "allgather_bucket_size": 700,
            "stage3_param_persistence_threshold": 30,
        },
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01}},
        "gradient_clipping": 0.3,
    }
    cfg.update(extra)
    return cfg


def global_mean(value: torch.Tensor) -> float:
    t = value.detach().float().reshape(1).clone()
    if dist.is_initialized():
        dist.all_reduce(t)
        t /= dist.get_world_size()
    return t.item()


def engine_run(
    rank: int,
    world: int,
    stage: int,
    steps: int,
    global_batch: int,
    gas: int = 1,
    manual: str | None = None,
    groups: bool = False,
    unused: bool = False,
    model_kw: dict | None = None,
    **cfg_extra,
) -> dict:
    """Train with rayzero on this rank's share of the same global batches.

    ``manual``: None (automatic boundaries), "before" (flag set before each backward) or "after" (the
    boundary is declared only after the last backward, just before ``step``).
    """
    model = make_model(unused=unused, **(model_kw or {}))
    cfg = base_config(stage, world, global_batch, gas, **cfg_extra)
    params = param_groups_of(model, 1e-2) if groups else None
    engine = rayzero.initialize(model, cfg, model_parameters=params)
    per_rank = global_batch // world
    micro = per_rank // gas
    losses, norms = [], []
    for x, y in batches(steps, global_batch):
        xs, ys = x[rank * per_rank : (rank + 1) * per_rank], y[rank * per_rank : (rank + 1) * per_rank]
        step_loss = 0.0
        for k in range(gas):
            if manual == "before":
                engine.set_gradient_accumulation_boundary(k == gas - 1)
            elif manual == "after":
                engine.set_gradient_accumulation_boundary(False)
            out = engine(xs[k * micro : (k + 1) * micro])
            loss = F.mse_loss(out.float(), ys[k * micro : (k + 1) * micro])
            engine.backward(loss)
            if manual == "after" and k == gas - 1:
                engine.set_gradient_accumulation_boundary(True)
            engine.step()
            step_loss += global_mean(loss) / gas
        losses.append(step_loss)
        norms.append(engine.global_grad_norm)
    state = engine.full_state_dict()
    result = {
        "losses": losses,
        "norms": norms,
        "state": state if rank == 0 else None,
        "global_steps": engine.global_steps,
        "micro_steps": engine.micro_steps,
    }
    engine.destroy()
    return result


def run_cases(rank: int, world: int, cases: list[dict]) -> list[dict]:
    return [engine_run(rank, world, **case) for case in cases]
