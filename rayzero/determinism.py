"""The opt-in deterministic execution policy (``"deterministic": true``).

What it does, on every rank:

* seeds Python's ``random``, NumPy (when installed) and torch (CPU and every accelerator device) with
  ``seed + rank``, so dropout and other sampling differ between ranks but repeat between runs;
* ``torch.use_deterministic_algorithms(True)`` (which makes torch raise on operations that have no
  deterministic implementation, rather than run them nondeterministically), and on CUDA sets
  ``CUBLAS_WORKSPACE_CONFIG=:4096:8`` and turns cuDNN benchmarking off;
* fixes rayzero's own reduction order: gradient buckets are launched in a fixed order on every rank, and
  every reduction (gradient buckets, stage 0's all-reduce, the global norm) runs through the ordered
  transport, which adds the ranks' contributions in rank order.

What it promises: the same config, world size, model code, data order and software versions give bitwise
identical weights, losses and gradient norms on every run.

What it does not promise: equality across different world sizes, ZeRO stages, bucket sizes, thread counts,
torch versions or hardware (floating-point sums in another order round differently); determinism of
the user's own data loading or of operations outside the model's forward/backward.
"""

from __future__ import annotations

import os
import random

import torch


def seed_everything(seed: int) -> None:
    random.seed(seed)
    try:
        import numpy as np

        np.random.seed(seed % (2**32))
    except ImportError:  # numpy is optional
        pass
    torch.manual_seed(seed)


def apply_deterministic_policy(seed: int, rank: int, accelerator) -> None:
    seed_everything(seed + rank)
    accelerator.set_deterministic(True)
    if accelerator.name == "cuda":
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True)
