"""Per-rank training runs that save and resume universal checkpoints (used by test_checkpoint.py)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

import rayzero
from zero_cases import base_config, batches, global_mean, make_model


def global_step(engine, xs: torch.Tensor, ys: torch.Tensor, gas: int = 1) -> float:
    """One optimizer step over this rank's share ``xs``/``ys`` in ``gas`` micro-steps; the mean loss over
    all ranks."""
    micro = xs.shape[0] // gas
    total = 0.0
    for k in range(gas):
        loss = F.mse_loss(engine(xs[k * micro : (k + 1) * micro]).float(), ys[k * micro : (k + 1) * micro])
        engine.backward(loss)
        engine.step()
        total += global_mean(loss) / gas
    return total


def train_steps(engine, rank: int, world: int, data, gas: int = 1) -> tuple[list[float], list[float]]:
    global_batch = data[0][0].shape[0]
    per_rank = global_batch // world
    losses, norms = [], []
    for x, y in data:
        xs, ys = x[rank * per_rank : (rank + 1) * per_rank], y[rank * per_rank : (rank + 1) * per_rank]
        losses.append(global_step(engine, xs, ys, gas))
        norms.append(engine.global_grad_norm)
    return losses, norms


def make_engine(stage: int, world: int, global_batch: int, gas: int = 1, **extra):
    cfg = base_config(stage, world, global_batch, gas, **extra)
    return rayzero.initialize(make_model(), cfg)


def save_after(rank, world, stage, steps, global_batch, save_dir, gas=1, async_save=False, **extra):
    """Train ``steps`` steps and save; return the state and what came before."""
    engine = make_engine(stage, world, global_batch, gas, **extra)
    data = batches(steps, global_batch)
    losses, norms = train_steps(engine, rank, world, data, gas)
    engine.save_checkpoint(save_dir, client_state={"note": "resume here", "step": steps}, async_save=async_save)
    state = engine.full_state_dict()
    engine.destroy()
    return {"losses": losses, "norms": norms, "state": state if rank == 0 else None}


def resume(rank, world, stage, first, more, global_batch, save_dir, gas=1, **extra):
    """Load the checkpoint and train steps ``first .. first + more`` of the same global batch stream."""
    engine = make_engine(stage, world, global_batch, gas, **extra)
    client = engine.load_checkpoint(save_dir)
    assert client == {"note": "resume here", "step": first}, client
    assert engine.global_steps == first
    assert engine.global_samples == first * global_batch
    data = batches(first + more, global_batch)[first:]
    losses, norms = train_steps(engine, rank, world, data, gas)
    state = engine.full_state_dict()
    engine.destroy()
    return {"losses": losses, "norms": norms, "state": state if rank == 0 else None}


def uninterrupted(rank, world, stage, steps, global_batch, **extra):
    engine = make_engine(stage, world, global_batch, **extra)
    losses, norms = train_steps(engine, rank, world, batches(steps, global_batch))
    state = engine.full_state_dict()
    engine.destroy()
    return {"losses": losses, "norms": norms, "state": state if rank == 0 else None}


def optimizer_view(engine) -> dict:
    """Full fp32 masters and optimizer states (gathered), and each group's step as the optimizer keeps it."""
    out = {"master": {}, "states": {}, "steps": []}
    for gi, g in enumerate(engine.partitions.groups):
        st = engine.optimizer.state[g.master]
        step = st.get("step")
        out["steps"].append((step.item(), str(step.dtype), str(step.device)) if torch.is_tensor(step) else step)
        for e in g.layout.entries:
            out["master"][e.name] = engine.partitions.gather_full(e)
            for name, flat in st.items():
                if torch.is_tensor(flat) and flat.shape == g.master.shape:
                    shard = flat[e.partition_offset : e.partition_offset + e.chunk]
                    rows = torch.empty((g.world, e.chunk))
                    if g.world > 1:
                        g.comm.all_gather(rows, shard.contiguous()).wait()
                    else:
                        rows[0].copy_(shard)
                    out["states"][(e.name, name)] = rows.reshape(-1)[: e.numel].clone()
    return out


def save_and_view(rank, world, stage, save_dir, steps=3, **extra):
    engine = make_engine(stage, world, 12, **extra)
    train_steps(engine, rank, world, batches(steps, 12))
    view = optimizer_view(engine)
    engine.save_checkpoint(save_dir, client_state={"note": "resume here", "step": steps})
    more = train_steps(engine, rank, world, batches(steps + 2, 12)[steps:])
    after = engine.full_state_dict()
    engine.destroy()
    return {"view": view, "after": after, "more": more} if rank == 0 else None


def load_and_view(rank, world, stage, save_dir, steps=3, **extra):
    engine = make_engine(stage, world, 12, **extra)
    engine.load_checkpoint(save_dir)
    view = optimizer_view(engine)
    more = train_steps(engine, rank, world, batches(steps + 2, 12)[steps:])
    after = engine.full_state_dict()
    engine.destroy()
    return {"view": view, "after": after, "more": more} if rank == 0 else None


def async_vs_sync(rank, world, stage, sync_dir, async_dir, hold_s=0.0):
    """Save the same step synchronously and asynchronously, training on while the async one writes.

    The async save copies the masters and optimizer states on its own thread; ``hold_s`` makes that
    thread start late, so the next optimizer step must wait for the copies (or the files would hold the
    state after it).  Returns how long that step took."""
    import time

    from rayzero.checkpoint import engine_io

    engine = make_engine(stage, world, 12)
    train_steps(engine, rank, world, batches(3, 12))
    engine.save_checkpoint(sync_dir, client_state={"note": "resume here", "step": 3})
    start_thread = engine_io.BackgroundSave
    engine_io.BackgroundSave = lambda work: start_thread(lambda: (time.sleep(hold_s), work()))
    try:
        engine.save_checkpoint(async_dir, client_state={"note": "resume here", "step": 3}, async_save=True)
    finally:
        engine_io.BackgroundSave = start_thread
    t = time.perf_counter()
    train_steps(engine, rank, world, batches(4, 12)[3:])  # overlaps the background copies and write
    first_step_s = time.perf_counter() - t
    train_steps(engine, rank, world, batches(5, 12)[4:])
    engine.save_checkpoint(sync_dir, tag="later")  # waits for the async save first
    engine.destroy()
    return first_step_s


class TiedLM(torch.nn.Module):
    """An embedding and an output head sharing one weight, plus a buffer: the model of the checkpoint-tool
    tests and of docs/checkpoint_format.md (a tied 11x6 embedding, a LayerNorm, a 2-element buffer)."""

    def __init__(self, vocab: int = 11, dim: int = 6):
        super().__init__()
        self.wte = torch.nn.Embedding(vocab, dim)
        self.ln = torch.nn.LayerNorm(dim)
        self.head = torch.nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.wte.weight
        self.register_buffer("scale", torch.tensor([0.5, 2.0]))

    def forward(self, idx):
        return self.head(self.ln(self.wte(idx)) * self.scale[0])
