"""The model, data and DeepSpeed config of the DeepSpeed checkpoints in tests/data/deepspeed_ckpt/
(made by bench/make_ds_checkpoints.py), shared by that script and tests/test_deepspeed_import.py."""
from __future__ import annotations

from dataclasses import dataclass

import torch

IN, HIDDEN, OUT = 5, 7, 3  # odd sizes: every parameter pads at world sizes 2 and 3
DS_SAVE_STEP = 3  # DeepSpeed saved after this many optimizer steps
DS_STEPS_AFTER = 2  # and then trained this many more
LR, WEIGHT_DECAY, CLIP = 1e-2, 0.01, 1.0


@dataclass(frozen=True)
class Case:
    stage: int
    dtype: str = "fp32"
    world: int = 2  # DeepSpeed's ranks
    batch: int = 8  # the global batch
    scheduler: bool = False  # DeepSpeed's WarmupLR, warmed up before the save (so the steps after it run
    # at the full lr in DeepSpeed and in rayzero alike)
    wrapped: bool = False  # DeepSpeed trained the model inside a wrapper (names "module.<name>")
    extras: bool = False  # a frozen layer, a tied weight, a buffer, and two param groups (decay / no decay,
    # their own lr)


CASES = {
    "zero1_fp32": Case(1, scheduler=True),
    "zero2_fp32": Case(2),
    "zero3_fp32": Case(3),
    "zero2_bf16": Case(2, "bf16"),
    "zero1_bf16": Case(1, "bf16"),
    "zero2_wrapped": Case(2, wrapped=True),
    "zero2_extras_w3": Case(2, world=3, batch=12, extras=True),
    "zero3_extras_w3": Case(3, world=3, batch=12, extras=True),
}
# DeepSpeed's universal checkpoints (ds_to_universal) made of these cases' saves
UNIVERSAL = ("zero2_fp32", "zero3_extras_w3")
WARMUP = {"type": "WarmupLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": LR, "warmup_num_steps": 2,
                                         "warmup_type": "linear"}}


class MLP(torch.nn.Module):
    def __init__(self, extras: bool = False):
        super().__init__()
        self.frozen = torch.nn.Linear(IN, IN).requires_grad_(False) if extras else None
        self.fc1 = torch.nn.Linear(IN, HIDDEN)
        self.fc2 = torch.nn.Linear(HIDDEN, HIDDEN)
        self.tied = torch.nn.Linear(HIDDEN, HIDDEN, bias=False) if extras else None
        if extras:
            self.tied.weight = self.fc2.weight  # one parameter under two names, as tied embeddings are
        self.fc3 = torch.nn.Linear(HIDDEN, OUT)
        if extras:
            self.register_buffer("shift", torch.linspace(-0.2, 0.3, OUT))
        else:
            self.shift = None

    def forward(self, x):
        if self.frozen is not None:
            x = torch.tanh(self.frozen(x))
        h = torch.tanh(self.fc2(torch.tanh(self.fc1(x))))
        if self.tied is not None:
            h = torch.tanh(self.tied(h))
        y = self.fc3(h)
        return y if self.shift is None else y + self.shift.to(y.dtype)


class Wrapper(torch.nn.Module):
    def __init__(self, module: torch.nn.Module):
        super().__init__()
        self.module = module

    def forward(self, x):
        return self.module(x)


def make_model(case: Case, seed: int = 0) -> MLP:
    torch.manual_seed(seed)
    return MLP(case.extras)


def model_parameters(model: MLP, case: Case):
    """The trainable parameters, as DeepSpeed and rayzero are handed them."""
    trainable = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    if not case.extras:
        return [p for _, p in trainable]
    return [{"params": [p for n, p in trainable if n.endswith("weight")]},
            {"params": [p for n, p in trainable if n.endswith("bias")], "weight_decay": 0.0, "lr": 2 * LR}]


def batches(case: Case, steps: int, seed: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(case.batch, IN, generator=g), torch.randn(case.batch, OUT, generator=g))
            for _ in range(steps)]


def ds_config(case: Case, stage: int, world: int) -> dict:
    """The saved run's DeepSpeed config at ``stage`` and ``world``; rayzero reads the same keys."""
    cfg = {
        "train_batch_size": case.batch,
        "train_micro_batch_size_per_gpu": case.batch // world,
        "gradient_accumulation_steps": 1,
        "zero_optimization": {"stage": stage},
        "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": WEIGHT_DECAY, "torch_adam": True}},
        "gradient_clipping": CLIP,
    }
    if case.dtype == "bf16":
        cfg["bf16"] = {"enabled": True}
    if case.scheduler:
        cfg["scheduler"] = WARMUP
    return cfg
