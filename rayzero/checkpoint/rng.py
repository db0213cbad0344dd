"""The random-number streams a checkpoint carries per rank (torch's, the device's, Python's and NumPy's), and
how a rank of a new world size derives its own instead."""

from __future__ import annotations

import base64
import hashlib
import random

import torch


def _b64(t: torch.Tensor) -> str:
    return base64.b64encode(t.cpu().numpy().tobytes()).decode()


def rng_state(accelerator) -> dict:
    state = {"torch": _b64(torch.get_rng_state())}
    if accelerator.name != "cpu":  # the device's own generator (on CPU it is the torch one above)
        state["device"] = {"kind": accelerator.name, "state": _b64(accelerator.get_rng_state())}
    version, internal, gauss = random.getstate()
    state["python"] = [version, list(internal), gauss]
    try:
        import numpy as np

        kind, keys, pos, has_gauss, cached = np.random.get_state()
        state["numpy"] = [kind, keys.tolist(), pos, has_gauss, cached]
    except ImportError:
        pass
    return state


def set_rng_state(state: dict, accelerator) -> None:
    torch.set_rng_state(torch.frombuffer(bytearray(base64.b64decode(state["torch"])), dtype=torch.uint8))
    device = state.get("device")
    if device is not None and device["kind"] == accelerator.name:  # saved on another kind: nothing to restore
        accelerator.set_rng_state(torch.frombuffer(bytearray(base64.b64decode(device["state"])), dtype=torch.uint8))
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    if "numpy" in state:
        import numpy as np

        kind, keys, pos, has_gauss, cached = state["numpy"]
        np.random.set_state((kind, np.array(keys, dtype=np.uint32), pos, has_gauss, cached))


def rederive_rng(seed: int, step: int, rank: int, accelerator) -> None:
    """A new world size has new ranks: derive each rank's streams from (seed, step, rank), reproducibly."""
    digest = hashlib.sha256(f"rayzero-rng:{seed}:{step}:{rank}".encode()).digest()
    value = int.from_bytes(digest[:7], "little")
    torch.manual_seed(value)
    accelerator.manual_seed(value)  # the device's generator too
    random.seed(value)
    try:
        import numpy as np

        np.random.seed(value % (2**32))
    except ImportError:
        pass
