"""The model, data and DeepSpeed config of the DeepSpeed checkpoints in tests/data/deepspeed_ckpt/
(made by bench/make_ds_checkpoints.py), shared by that script and tests/test_deepspeed_import.py."""
from __future__ import annotations

import torch

IN, HIDDEN, OUT = 5, 7, 3  # odd sizes: every parameter pads at world size 2
GLOBAL_BATCH = 8
DS_WORLD = 2
DS_SAVE_STEP = 3  # DeepSpeed saved after this many optimizer steps
DS_STEPS_AFTER = 2  # and then trained this many more
LR, WEIGHT_DECAY, CLIP = 1e-2, 0.01, 1.0

# case name -> (ZeRO stage, dtype); zero1_fp32 also runs DeepSpeed's WarmupLR (warmed up before the save, so
# the steps after it run at the full lr in DeepSpeed and in rayzero alike)
CASES = {"zero1_fp32": (1, "fp32"), "zero2_fp32": (2, "fp32"), "zero3_fp32": (3, "fp32"), "zero2_bf16": (2, "bf16")}
WARMUP = {"type": "WarmupLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": LR, "warmup_num_steps": 2,
                                         "warmup_type": "linear"}}


class MLP(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = torch.nn.Linear(IN, HIDDEN)
        self.fc2 = torch.nn.Linear(HIDDEN, HIDDEN)
        self.fc3 = torch.nn.Linear(HIDDEN, OUT)

    def forward(self, x):
        return self.fc3(torch.tanh(self.fc2(torch.tanh(self.fc1(x)))))


def make_model(seed: int = 0) -> MLP:
    torch.manual_seed(seed)
    return MLP()


def batches(steps: int, seed: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(GLOBAL_BATCH, IN, generator=g), torch.randn(GLOBAL_BATCH, OUT, generator=g))
            for _ in range(steps)]


def ds_config(stage: int, dtype: str, world: int, scheduler: bool = False) -> dict:
    """DeepSpeed's config of the saved run; rayzero reads the same keys."""
    cfg = {
        "train_batch_size": GLOBAL_BATCH,
        "train_micro_batch_size_per_gpu": GLOBAL_BATCH // world,
        "gradient_accumulation_steps": 1,
        "zero_optimization": {"stage": stage},
        "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": WEIGHT_DECAY, "torch_adam": True}},
        "gradient_clipping": CLIP,
    }
    if dtype == "bf16":
        cfg["bf16"] = {"enabled": True}
    if scheduler:
        cfg["scheduler"] = WARMUP
    return cfg
