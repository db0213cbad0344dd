"""ZeRO-3 gathers per block: which modules are units, how far ahead it prefetches, and that a prefetch the
forward never uses is released; training still equals single-process torch."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

import rayzero
from distributed import run_distributed
from rayzero.config import ConfigError
from rayzero.zero.stage3 import mark_gather_unit
from test_zero import assert_matches_reference
from zero_cases import global_mean

IN, W, OUT, BLOCKS = 11, 23, 5, 4
STEPS, GLOBAL_BATCH, SKIP_AT = 5, 8, 3  # at step SKIP_AT the forward leaves block 2 out


class Inner(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.up = torch.nn.Linear(W, 3 * W)
        self.down = torch.nn.Linear(3 * W, W)

    def forward(self, h):
        return self.down(torch.tanh(self.up(h)))


class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = torch.nn.LayerNorm(W)
        self.mlp = Inner()

    def forward(self, h):
        return h + self.mlp(self.norm(h))


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Linear(IN, W)
        self.blocks = torch.nn.ModuleList(Block() for _ in range(BLOCKS))
        self.head = torch.nn.Linear(W, OUT)
        self.skip: int | None = None

    def forward(self, x):
        h = self.embed(x)
        for i, b in enumerate(self.blocks):
            if i != self.skip:
                h = b(h)
        return self.head(h)


def make_net() -> Net:
    torch.manual_seed(0)
    return Net()


def data():
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(GLOBAL_BATCH, IN, generator=g), torch.randn(GLOBAL_BATCH, OUT, generator=g))
            for _ in range(STEPS)]


def config(**zero) -> dict:
    return {"train_batch_size": GLOBAL_BATCH,
            # gathered even where the ranks share a host (what these tests look at)
            "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 30,
                                  "stage3_share_weights": False, **zero},
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01}},
            "gradient_clipping": 0.3}


def reference() -> dict:
    model = make_net()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    losses, norms = [], []
    for step, (x, y) in enumerate(data()):
        model.skip = 2 if step == SKIP_AT else None
        loss = F.mse_loss(model(x), y)
        loss.backward()
        for p in model.parameters():
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), 0.3)))
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return {"losses": losses, "norms": norms, "state": copy.deepcopy(model.state_dict())}


def unit_names(model: torch.nn.Module, engine) -> list[str]:
    names = {id(m): n for n, m in model.named_modules()}
    return sorted(names[id(u.module)] for u in engine.gatherer.units)


def train(rank: int, world: int, cases: list[dict]) -> list[dict]:
    out = []
    for zero in cases:
        model = make_net()
        engine = rayzero.initialize(model, config(**zero))
        g = engine.gatherer
        per = GLOBAL_BATCH // world
        losses, norms, freed_after_skip = [], [], None
        for step, (x, y) in enumerate(data()):
            model.skip = 2 if step == SKIP_AT else None
            loss = F.mse_loss(engine(x[rank * per : (rank + 1) * per]), y[rank * per : (rank + 1) * per])
            if step == SKIP_AT:  # after the forward: the skipped block holds no gathered storage
                freed_after_skip = all(g._storage[p].nbytes() == 0 for p in model.blocks[2].parameters()
                                       if p in g.managed_set)
            if step == STEPS - 1:  # after the last forward: the units left gathered for the backward
                names = {id(m): n for n, m in model.named_modules()}
                kept = sorted(names[id(u.module)] for u in g.units
                              if all(g._storage[p].nbytes() > 0 for p in u.params))
            engine.backward(loss)
            engine.step()
            losses.append(global_mean(loss))
            norms.append(engine.global_grad_norm)
        state = engine.full_state_dict()
        out.append({"losses": losses, "norms": norms, "state": state if rank == 0 else None,
                    "units": unit_names(model, engine), "max_ahead": g.max_ahead,
                    "unused": g.unused_prefetches, "freed_after_skip": freed_after_skip, "kept": kept,
                    "order": len(g.order), "budget": g.prefetch_elements,
                    "largest": max(u.numel for u in g.units)})
        engine.destroy()
    return out


CASES = [{}, {"stage3_gather_unit": "module"}, {"stage3_prefetch_bucket_size": 0},
         {"stage3_prefetch_bucket_size": 10**9}]


@pytest.fixture(scope="module")
def runs():
    return run_distributed(train, 2, CASES)[0]


def test_block_units_and_leaf_units_train_like_torch(runs):
    ref = reference()
    auto, leaf = runs[0], runs[1]
    assert auto["units"] == ["blocks.0", "blocks.1", "blocks.2", "blocks.3", "embed", "head"]
    assert "blocks.0.mlp.up" in leaf["units"] and "blocks.0" not in leaf["units"]
    for r, what in zip(runs, ["auto", "module", "no prefetch", "prefetch all"]):
        assert_matches_reference(r, ref, what=what)


def test_prefetch_looks_as_far_ahead_as_the_bucket_allows(runs):
    auto, _, off, everything = runs
    # default: two of the largest units ahead (two blocks)
    assert auto["budget"] == 2 * auto["largest"]
    assert auto["max_ahead"] == 2
    assert off["max_ahead"] == 0 and off["unused"] == 0
    assert everything["max_ahead"] == everything["order"] - 1  # every other unit of the pass


def test_the_last_units_of_a_forward_stay_gathered_for_its_backward(runs):
    auto, leaf, off, everything = runs
    assert auto["kept"] == ["blocks.3", "head"]  # within two blocks' worth of elements from the end
    assert off["kept"] == []
    assert everything["kept"] == auto["units"]  # a budget of the whole model keeps it all through the turn
    assert leaf["kept"] and all(n.startswith(("head", "blocks.3")) for n in leaf["kept"])


def test_a_prefetch_the_forward_never_uses_is_released(runs):
    auto, _, off, everything = runs
    assert auto["freed_after_skip"] and everything["freed_after_skip"] and off["freed_after_skip"]
    assert auto["unused"] >= 1 and everything["unused"] >= 1


def test_units_from_no_split_modules_marks_and_names():
    def units(model, **zero):
        engine = rayzero.initialize(model, config(**zero))
        names = unit_names(model, engine)
        engine.destroy()
        return names

    hf = make_net()
    hf._no_split_modules = ["Inner"]  # as a Hugging Face model names its layer
    # (the LayerNorms are persistent: at most 30 elements a parameter, they are never gathered)
    assert [n for n in units(hf) if n.startswith("blocks.0")] == ["blocks.0.mlp"]
    marked = make_net()
    mark_gather_unit(marked.blocks[1], marked.head)
    names = units(marked)
    assert "blocks.1" in names and "head" in names and "blocks.0.mlp.up" in names and "blocks.0" not in names
    assert units(make_net(), stage3_gather_unit="Inner") == [f"blocks.{i}.mlp" for i in range(BLOCKS)] + ["embed", "head"]
    with pytest.raises(ConfigError, match="stage3_gather_unit.*names no module of this model.*Block"):
        units(make_net(), stage3_gather_unit="DecoderLayer")
    with pytest.raises(ConfigError, match="stage3_gather_unit"):
        rayzero.initialize(make_net(), config(stage3_gather_unit="not a class"))
