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


def test_parameters_on_nvme_gather_leaf_units_unless_told(tmp_path):
    """With parameters on NVMe, "auto" gathers module by module (what the rank holds at once is the point of
    that config, and each gather waits on the disk however the units are cut): the repeated block and HF's
    ``_no_split_modules`` give way to leaf units, while marked modules and named classes still win.  The
    memory model cuts the same units."""
    from rayzero.memory import rank_memory

    swap = str(tmp_path / "swap")
    nvme = {"offload_optimizer": {"device": "nvme", "nvme_path": swap},
            "offload_param": {"device": "nvme", "nvme_path": swap}}

    def units(model, **zero):
        engine = rayzero.initialize(model, config(**zero))
        names = unit_names(model, engine)
        sizes = sorted(u.numel for u in engine.gatherer.units)
        engine.destroy()
        return names, sizes

    leaves = sorted([f"blocks.{i}.mlp.{leaf}" for i in range(BLOCKS) for leaf in ("up", "down")] + ["embed", "head"])
    names, sizes = units(make_net(), **nvme)
    assert names == leaves
    assert units(make_net(), stage3_gather_unit="module")[0] == leaves  # the same cut "module" asks for
    blocks, block_sizes = units(make_net())
    assert blocks == ["blocks.0", "blocks.1", "blocks.2", "blocks.3", "embed", "head"]
    hf = make_net()
    hf._no_split_modules = ["Inner"]
    assert units(hf, **nvme)[0] == leaves
    marked = make_net()
    mark_gather_unit(*marked.blocks)
    assert units(marked, **nvme)[0] == ["blocks.0", "blocks.1", "blocks.2", "blocks.3", "embed", "head"]
    assert units(make_net(), stage3_gather_unit="Inner", **nvme)[0] == \
        [f"blocks.{i}.mlp" for i in range(BLOCKS)] + ["embed", "head"]
    # the memory model: the running unit and two of the largest ahead, of the units the engine cut
    cfg = rayzero.Config.from_any(config(**nvme))
    assert rank_memory(make_net(), cfg, 1).gathered == 3 * max(sizes) * 4
    assert rank_memory(make_net(), rayzero.Config.from_any(config()), 1).gathered == 3 * max(block_sizes) * 4
    assert max(sizes) < max(block_sizes)


def test_parameters_on_nvme_are_read_before_their_gather(tmp_path):
    """With parameters on NVMe the shards a gather takes were read from the disk since an earlier gather
    (while the units before it ran), for the units gathered ahead and the one after them, instead of being
    read and waited for on the spot; training still equals torch."""
    swap = str(tmp_path / "swap")
    model = make_net()
    engine = rayzero.initialize(model, config(offload_param={"device": "nvme", "nvme_path": swap}))
    g, ps = engine.gatherer, engine.partitions.param_swap
    calls, started, ahead, inside = [0], {}, [], [False]
    gather, start, take = g.gather, ps._start, ps._take

    def counted_gather(unit, direction=0):
        calls[0] += 1
        inside[0] = True
        try:
            gather(unit, direction)
        finally:
            inside[0] = False

    def counted_start(e, key):
        ok = start(e, key)
        if ok:
            started[key] = calls[0]
        return ok

    def counted_take(key):
        if inside[0]:  # (not the step's refresh of the persistent parameters)
            ahead.append(started[key] < calls[0])  # its read began in an earlier gather
        return take(key)

    g.gather, ps._start, ps._take = counted_gather, counted_start, counted_take
    ref = make_net()
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.01)
    for step, (x, y) in enumerate(data()[:3]):
        if step == 1:  # the first step records the order; from the second on the gathers look ahead
            ahead.clear()
        loss = F.mse_loss(engine(x), y)
        engine.backward(loss)
        engine.step()
        ref_loss = F.mse_loss(ref(x), y)
        ref_loss.backward()
        torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.3)
        opt.step()
        opt.zero_grad(set_to_none=True)
        assert abs(loss.item() - ref_loss.item()) <= 1e-5 * max(1.0, abs(ref_loss.item())), step
    engine.destroy()
    # the first units of each pass are read on the spot (nothing ran before them to read them under);
    # 36 of 52 here, and none before the reads went ahead of the launches
    assert len(ahead) >= 2 * 2 * 10 and sum(ahead) >= 0.6 * len(ahead), (sum(ahead), len(ahead))


@pytest.mark.parametrize("where", ["module", "nvme"])
def test_a_recomputed_block_does_not_gather_its_leaves_again(tmp_path, where):
    """Leaf units under activation checkpointing (``"module"``, or ``"auto"`` with parameters on NVMe): the
    recompute of a block inside backward neither gathers ahead in forward order (those units' backward is
    over) nor releases a leaf whose backward comes next, so backward gathers each unit once, as without
    checkpointing, and nothing gathered is left unused; the numbers are the same."""
    swap = str(tmp_path / "swap")
    zero = ({"stage3_gather_unit": "module"} if where == "module" else
            {"offload_param": {"device": "nvme", "nvme_path": swap}})
    out = {}
    for ckpt in (False, True):
        model = make_net()
        cfg = config(**zero)
        if ckpt:
            cfg["activation_checkpointing"] = {}
        engine = rayzero.initialize(model, cfg)
        g = engine.gatherer
        launch, launches = g._launch, {"forward": 0, "backward": 0}

        def counted(unit, launch=launch, launches=launches):
            ok = launch(unit)
            if ok:
                launches["backward" if torch._C._current_graph_task_id() != -1 else "forward"] += 1
            return ok

        g._launch = counted
        losses = []
        for step, (x, y) in enumerate(data()[:3]):
            if step == 2:  # from the third step on, the recorded order and the prefetch are in place
                launches.update(forward=0, backward=0)
                unused = g.unused_prefetches
            loss = F.mse_loss(engine(x), y)
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
        assert len(g.units) == 10  # embed, head, and each block's up and down
        out[ckpt] = dict(launches, unused=g.unused_prefetches - unused, losses=losses)
        engine.destroy()
    plain, ckpt = out[False], out[True]
    assert ckpt["losses"] == pytest.approx(plain["losses"], rel=1e-6)
    assert ckpt["forward"] == plain["forward"] == 10
    assert ckpt["backward"] == plain["backward"] and ckpt["unused"] == plain["unused"] == 0, (plain, ckpt)
