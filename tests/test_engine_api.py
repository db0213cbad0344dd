"""Engine set-up paths, zero_init, tied weights and bad input (memory over many steps and cycles: test_memory_flat.py)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

import rayzero
from distributed import run_distributed

VOCAB, DIM, HIDDEN = 53, 16, 37


class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.ln = torch.nn.LayerNorm(DIM)
        self.fc = torch.nn.Linear(DIM, HIDDEN)
        self.proj = torch.nn.Linear(HIDDEN, DIM)

    def forward(self, x):
        return x + self.proj(F.gelu(self.fc(self.ln(x))))


class TinyLM(torch.nn.Module):
    """GPT-shaped: tied embedding/head, `apply(init)` and a direct re-init of children after construction."""

    def __init__(self):
        super().__init__()
        self.wte = torch.nn.Embedding(VOCAB, DIM)
        self.blocks = torch.nn.ModuleList([Block() for _ in range(2)])
        self.ln_f = torch.nn.LayerNorm(DIM)
        self.head = torch.nn.Linear(DIM, VOCAB, bias=False)
        self.head.weight = self.wte.weight
        self.apply(self._init_weights)
        for name, p in self.named_parameters():
            if name.endswith("proj.weight"):
                torch.nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(4))

    @staticmethod
    def _init_weights(m):
        if isinstance(m, torch.nn.Linear):
            torch.nn.init.normal_(m.weight, mean=0.0, std=0.02)
            if m.bias is not None:
                torch.nn.init.zeros_(m.bias)
        elif isinstance(m, torch.nn.Embedding):
            torch.nn.init.normal_(m.weight, mean=0.0, std=0.02)

    def forward(self, idx):
        x = self.wte(idx)
        for b in self.blocks:
            x = b(x)
        return self.head(self.ln_f(x))


def lm_batches(steps, batch, seq=9, seed=3):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (batch, seq + 1), generator=g) for _ in range(steps)]


def lm_loss(logits, tokens):
    return F.cross_entropy(logits.float().reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))


def lm_reference(steps, batch):
    torch.manual_seed(7)
    model = TinyLM()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for tokens in lm_batches(steps, batch):
        loss = lm_loss(model(tokens[:, :-1]), tokens)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, model.state_dict()


def _lm_worker(rank, world, stage, use_zero_init, steps, batch):
    cfg = {
        "train_batch_size": batch,
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 20, "reduce_bucket_size": 300},
        "optimizer": {"type": "AdamW", "params": {"lr": 3e-3}},
        "gradient_clipping": 1.0,
    }
    if use_zero_init:
        with rayzero.zero_init(seed=7):
            model = TinyLM()
        # nothing whole was left behind: every trainable parameter is a one-element stand-in
        assert all(p.untyped_storage().nbytes() <= 4 for p in model.parameters())
    else:
        torch.manual_seed(7)
        model = TinyLM()
    engine = rayzero.initialize(model, cfg)
    initial = engine.full_state_dict()
    per = batch // world
    losses = []
    for tokens in lm_batches(steps, batch):
        mine = tokens[rank * per : (rank + 1) * per]
        loss = lm_loss(engine(mine[:, :-1]), mine)
        engine.backward(loss)
        engine.step()
        t = loss.detach().reshape(1).clone()
        torch.distributed.all_reduce(t)
        losses.append(t.item() / world)
    final = engine.full_state_dict()
    engine.destroy()
    return {"initial": initial, "final": final, "losses": losses} if rank == 0 else None


@pytest.mark.parametrize("world", [2, 3])
def test_zero_init_gives_exactly_the_full_init_weights(world):
    torch.manual_seed(7)
    expected = TinyLM().state_dict()
    got = run_distributed(_lm_worker, world, 3, True, 0, 6)[0]["initial"]
    assert list(got) == list(expected)
    for name in expected:
        assert torch.equal(got[name], expected[name]), name


def test_tied_weights_train_like_reference_in_every_stage():
    steps, batch = 5, 6
    ref_losses, ref_state = lm_reference(steps, batch)
    for stage, use_zero_init in [(0, False), (1, False), (2, False), (3, False), (3, True)]:
        r = run_distributed(_lm_worker, 2, stage, use_zero_init, steps, batch)[0]
        assert r["losses"] == pytest.approx(ref_losses, rel=1e-5), f"stage {stage} zero_init={use_zero_init}"
        assert torch.equal(r["final"]["head.weight"], r["final"]["wte.weight"])  # still tied
        for name, expected in ref_state.items():
            err = ((r["final"][name] - expected).norm() / expected.norm().clamp_min(1e-12)).item()
            assert err < 1e-5, f"stage {stage} zero_init={use_zero_init} {name}: {err:.2e}"


def _from_env(rank, world):
    import torch.distributed as dist

    assert not dist.is_initialized()
    engine = rayzero.initialize(torch.nn.Linear(3, 5), {"zero_optimization": {"stage": 2}})
    seen = (engine.rank, engine.world_size, dist.get_world_size())
    engine.destroy()
    return seen, dist.is_initialized()


def test_process_group_from_standard_environment_and_destroyed_with_engine():
    out = run_distributed(_from_env, 2, init_pg=False)
    assert out == [((0, 2, 2), False), ((1, 2, 2), False)]


def test_no_environment_runs_as_world_size_one():
    engine = rayzero.initialize(torch.nn.Linear(3, 5), {"zero_optimization": {"stage": 3}})
    assert (engine.rank, engine.world_size) == (0, 1)
    out = engine(torch.randn(2, 3))
    engine.backward(out.sum())
    engine.step()
    assert engine.global_steps == 1
    engine.destroy()


def test_bad_input_errors_name_the_problem():
    model = torch.nn.Linear(3, 5)
    with pytest.raises(rayzero.ConfigError, match="zero_optimization.stgae.*did you mean 'stage'"):
        rayzero.initialize(model, {"zero_optimization": {"stgae": 2}})
    with pytest.raises(rayzero.NotSupportedYetError, match="offload_optimizer.ratio"):
        rayzero.initialize(model, {"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu", "ratio": 0.3}}})
    with pytest.raises(rayzero.ConfigError, match="offload_optimizer.*needs ZeRO stage 1, 2 or 3"):
        rayzero.initialize(model, {"zero_optimization": {"stage": 0, "offload_optimizer": {"device": "cpu"}}})
    with pytest.raises(rayzero.ConfigError, match="train_batch_size 10 .* 3 .* 4 .* 1 = 12"):
        rayzero.initialize(
            model, {"train_batch_size": 10, "train_micro_batch_size_per_gpu": 3, "gradient_accumulation_steps": 4}
        )
    with pytest.raises(rayzero.ConfigError, match="betaz"):
        rayzero.initialize(model, {"optimizer": {"type": "AdamW", "params": {"betaz": [0.9, 0.99]}}})
    with rayzero.zero_init():
        sharded = torch.nn.Linear(3, 5)
    with pytest.raises(rayzero.ConfigError, match="zero_init.*stage 3"):
        rayzero.initialize(sharded, {"zero_optimization": {"stage": 2}})
    engine = rayzero.initialize(model, {})
    engine.destroy()
    with pytest.raises(RuntimeError, match="destroyed"):
        engine.step()


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_zero_grad_drops_gradients_accumulated_so_far(stage):
    x = torch.randn(4, 3)

    def trained(with_discarded_backward: bool):
        torch.manual_seed(0)
        model = torch.nn.Linear(3, 5)
        engine = rayzero.initialize(
            model, {"zero_optimization": {"stage": stage}, "gradient_accumulation_steps": 2, "train_batch_size": 2}
        )
        if with_discarded_backward:
            engine.backward(engine(x * 100).sum())
            engine.zero_grad()
        engine.set_gradient_accumulation_boundary(True)
        engine.backward(engine(x).pow(2).mean())
        engine.step()
        out = engine.full_state_dict()
        engine.destroy()
        return out

    clean, discarded = trained(False), trained(True)
    for name in clean:
        assert torch.equal(clean[name], discarded[name]), name


def test_frozen_parameters_built_under_zero_init_are_whole():
    torch.manual_seed(5)
    expected = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.Linear(6, 2)).state_dict()
    with rayzero.zero_init(seed=5):
        model = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.Linear(6, 2))
        model[0].requires_grad_(False)
    engine = rayzero.initialize(model, {"zero_optimization": {"stage": 3}})
    assert torch.equal(model[0].weight, expected["0.weight"])
    got = engine.full_state_dict()
    for name in expected:
        assert torch.equal(got[name], expected[name]), name
    engine.destroy()
