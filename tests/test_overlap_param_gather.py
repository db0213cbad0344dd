"""``zero_optimization.overlap_param_gather`` (stages 1-2, weights gathered over gloo as across hosts): the
all-gather after a step is left running and the next forward waits for each parameter as an operation first
reads it (rayzero/zero/publish.py, WaitForWeights). Training is bitwise the same as with the gather finished
inside step(), through accumulation, a tied weight read by another module, a save and a load."""

from __future__ import annotations


import pytest
import torch
import torch.nn.functional as F

import rayzero
from distributed import run_distributed

STEPS = 5


class TiedNet(torch.nn.Module):
    """An embedding whose weight the output layer reads functionally (as tied language-model heads do),
    large linears (gathered straight into their storage) and small biases (packed buckets)."""

    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(64, 256)
        self.blocks = torch.nn.Sequential(torch.nn.Linear(256, 1024), torch.nn.GELU(), torch.nn.Linear(1024, 256))
        self.norm = torch.nn.LayerNorm(256)

    def forward(self, ids):
        h = self.embed(ids)
        h = h + self.blocks(h)
        return F.linear(self.norm(h), self.embed.weight)  # the embedding's weight, outside its module


def _run(rank: int, world: int, overlap: bool, stage: int, root: str) -> dict:
    torch.manual_seed(0)
    engine = rayzero.initialize(TiedNet(), {
        "train_batch_size": 16, "gradient_accumulation_steps": 2, "gradient_clipping": 1.0,
        "zero_optimization": {"stage": stage, "overlap_param_gather": overlap, "allgather_bucket_size": 100_000},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
    })
    g = torch.Generator().manual_seed(3)
    losses, pending_after_step, pending_after_forward = [], [], []
    for step in range(STEPS):
        for _ in range(2):
            ids = torch.randint(0, 64, (8, 12), generator=g)[rank * 4:(rank + 1) * 4]
            logits = engine(ids)
            pending_after_forward.append(engine.publisher.pending)
            loss = F.cross_entropy(logits[:, :-1].reshape(-1, 64), ids[:, 1:].reshape(-1))  # the next token
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
        pending_after_step.append(engine.publisher.pending)
        if step == 2:
            engine.save_checkpoint(root, tag=f"overlap{int(overlap)}")
            engine.load_checkpoint(root, tag=f"overlap{int(overlap)}")
            pending_after_step.append(engine.publisher.pending)  # the load published again
    engine.wait_for_weights()
    params = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
    state = engine.full_state_dict()
    engine.destroy()
    return {"losses": losses, "params": params, "state": state, "after_step": pending_after_step,
            "after_forward": pending_after_forward}


@pytest.mark.parametrize("stage", [1, 2])
def test_overlapped_gather_trains_bitwise_like_the_finished_one(stage, tmp_path):
    env = {"RAYZERO_SHM": "0"}  # every group on gloo: the weights are gathered, as across hosts
    on = run_distributed(_run, 2, True, stage, str(tmp_path), env=env)
    off = run_distributed(_run, 2, False, stage, str(tmp_path), env=env)
    for a, b in zip(on, off):
        assert a["losses"] == b["losses"]
        assert a["params"].keys() == b["params"].keys()
        for n in a["params"]:
            assert torch.equal(a["params"][n], b["params"][n]), n
        for n in a["state"]:
            assert torch.equal(a["state"][n], b["state"][n]), n
        # overlapped: every step and the load leave gathers running, every forward finishes them
        assert all(k > 0 for k in a["after_step"]) and set(a["after_forward"]) == {0}, a["after_step"]
        assert set(b["after_step"]) == {0}
    # the weights really moved: the runs are not trivially equal
    torch.manual_seed(0)
    init = dict(TiedNet().named_parameters())
    assert all(not torch.equal(on[0]["params"][n], init[n]) for n in init)
    assert len(set(on[0]["losses"])) == len(on[0]["losses"])


def _pending_read(rank: int, world: int) -> dict:
    """Outside a forward, wait_for_weights() is what makes the parameters whole."""
    torch.manual_seed(0)
    engine = rayzero.initialize(TiedNet(), {
        "train_batch_size": 8, "zero_optimization": {"stage": 1, "overlap_param_gather": True},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
    })
    ids = torch.randint(0, 64, (4, 12), generator=torch.Generator().manual_seed(rank))
    loss = F.cross_entropy(engine(ids).reshape(-1, 64), ids.reshape(-1))
    engine.backward(loss)
    engine.step()
    pending = engine.publisher.pending
    engine.wait_for_weights()
    full = engine.full_state_dict()
    same = all(torch.equal(p, full[n]) for n, p in engine.module.named_parameters())
    engine.destroy()
    return {"pending": pending, "same": same}


def test_wait_for_weights_completes_the_parameters():
    for r in run_distributed(_pending_read, 2, env={"RAYZERO_SHM": "0"}):
        assert r["pending"] > 0 and r["same"], r


def test_on_one_host_nothing_is_gathered_so_nothing_is_left_running():
    for r in run_distributed(_pending_read, 2):  # the shared-memory transport: one copy of the weights
        assert r["pending"] == 0 and r["same"], r
