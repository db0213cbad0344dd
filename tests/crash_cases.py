"""Processes for tests/test_checkpoint_crash.py: a saver that is SIGKILLed inside a commit, the fresh process
that loads what it left, and a Ray train_step that logs each worker attempt.

    python crash_cases.py save DIR POINT OUT      save tag "ckpt", train a step, re-save "ckpt": killed at POINT
    python crash_cases.py recover DIR OUT ORDER   ORDER "load-first": load latest, save, load again;
                                                  "save-first": save another tag, then load "ckpt"
"""

from __future__ import annotations

import json
import os
import sys

import torch
import torch.nn.functional as F

TAG = "ckpt"


def make_engine(seed: int):
    import rayzero

    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(7, 13), torch.nn.ReLU(), torch.nn.Linear(13, 5))
    return rayzero.initialize(model, {"train_batch_size": 4, "zero_optimization": {"stage": 1},
                                      "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}}})


def one_step(engine) -> None:
    g = torch.Generator().manual_seed(engine.global_steps)
    loss = F.mse_loss(engine(torch.randn(4, 7, generator=g)), torch.randn(4, 5, generator=g))
    engine.backward(loss)
    engine.step()


def view(engine) -> dict:
    """What must come back bitwise: weights, fp32 masters and optimizer state, and the step counter."""
    out = {"steps": engine.global_steps, "state": {k: v.clone() for k, v in engine.full_state_dict().items()}}
    for gi, g in enumerate(engine.partitions.groups):
        out[f"master{gi}"] = g.master.detach().clone()
        for k, v in engine.optimizer.state[g.master].items():
            out[f"opt{gi}.{k}"] = v.detach().clone() if torch.is_tensor(v) else v
    return out


def save(save_dir: str, point: str, out: str) -> None:
    from rayzero.checkpoint.writer import CRASH_ENV

    engine = make_engine(0)
    one_step(engine)
    engine.save_checkpoint(save_dir, tag=TAG, client_state={"which": "old"})
    torch.save(view(engine), os.path.join(out, "old.pt"))
    one_step(engine)
    torch.save(view(engine), os.path.join(out, "new.pt"))
    os.environ[CRASH_ENV] = point  # this re-save of the same tag dies at ``point``
    engine.save_checkpoint(save_dir, tag=TAG, client_state={"which": "new"})
    print("survived", flush=True)


def recover(save_dir: str, out: str, order: str) -> None:
    engine = make_engine(1)  # other starting weights: the load must overwrite them
    if order == "save-first":  # the next save's prepare() runs before anything reads the checkpoint
        engine.save_checkpoint(save_dir, tag="other")
        client = engine.load_checkpoint(save_dir, tag=TAG)
    else:
        client = engine.load_checkpoint(save_dir)
    torch.save({"client": client, **view(engine)}, os.path.join(out, "loaded.pt"))
    one_step(engine)
    engine.save_checkpoint(save_dir, tag=TAG, client_state={"which": "after"})
    torch.save(view(engine), os.path.join(out, "after.pt"))
    engine.destroy()
    again = make_engine(2)
    client = again.load_checkpoint(save_dir)
    torch.save({"client": client, **view(again)}, os.path.join(out, "reloaded.pt"))
    again.destroy()
    with open(os.path.join(out, "listing.json"), "w") as f:
        json.dump(sorted(os.listdir(save_dir)), f)


class AttemptLog:
    """A train_step that appends ``{"pid", "rank", "start"}`` to ``path`` on its first call in each worker
    process (one line per rank per worker-group attempt), then trains as fit's default step does."""

    def __init__(self, path: str):
        self.path = path
        self.seen = False

    def __call__(self, engine, batch):
        import ray.train

        from ray_cases import mse

        if not self.seen:
            self.seen = True
            rank = ray.train.get_context().get_world_rank()
            with open(self.path, "a") as f:
                f.write(json.dumps({"pid": os.getpid(), "rank": rank, "start": engine.global_steps}) + "\n")
        loss = mse(engine(batch[0]), batch)
        engine.backward(loss)
        engine.step()
        return loss


if __name__ == "__main__":
    if sys.argv[1] == "save":
        save(*sys.argv[2:5])
    elif sys.argv[1] == "recover":
        recover(*sys.argv[2:5])
    else:
        raise SystemExit(f"unknown command {sys.argv[1]!r}")
