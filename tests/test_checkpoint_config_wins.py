"""Loading a checkpoint restores the optimizer's state, never its settings: the config wins.

And under strict=False, parameters the checkpoint does not have start their optimizer state as a fresh
optimizer would (Adam: step 0), or the load is refused when that cannot be done exactly.
"""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn.functional as F

from distributed import run_distributed
from zero_cases import IN, OUT, batches, make_model

import rayzero
from rayzero.checkpoint.format import CheckpointError

SAVED_STEPS = 3


def _config(stage: int, world: int, optimizer: dict, **extra) -> dict:
    return {"train_batch_size": 12, "zero_optimization": {"stage": stage}, "optimizer": optimizer, **extra}


def _groups(model) -> list[dict]:
    """Two user groups; fc3.weight is marked as an expert so user group 0 is two optimizer groups (dense
    and expert partitions)."""
    decay = [model.fc1.weight, model.fc2.weight, model.fc3.weight]
    return [{"params": decay, "weight_decay": 0.1}, {"params": [model.fc1.bias, model.fc2.bias, model.fc3.bias]}]


def _train(engine, steps, rank=0, world=1, first=0):
    per_rank = 12 // world
    for x, y in batches(first + steps, 12)[first:]:
        xs, ys = x[rank * per_rank : (rank + 1) * per_rank], y[rank * per_rank : (rank + 1) * per_rank]
        engine.backward(F.mse_loss(engine(xs), ys))
        engine.step()


def _engine(optimizer: dict, stage: int = 1, **extra):
    model = make_model()
    model.fc3.weight._rayzero_expert = True
    return rayzero.initialize(model, _config(stage, 1, optimizer, **extra), model_parameters=_groups(model))


def _hparams(engine) -> list[dict]:
    return [{k: (v.item() if torch.is_tensor(v) else v) for k, v in g.items() if k != "params"}
            for g in engine.optimizer.param_groups]


def _states(engine) -> list[dict]:
    out = []
    for g in engine.partitions.groups:
        st = engine.optimizer.state[g.master]
        out.append({k: (v.item() if v.numel() == 1 and v.shape != g.master.shape else v.clone())
                    for k, v in st.items() if torch.is_tensor(v)})
    return out


def _rayzero_warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "rayzero" and r.levelno == logging.WARNING]


SAVED_ADAMW = {"type": "AdamW", "params": {"lr": 1e-2, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.01,
                                           "foreach": True}}
CONFIG_ADAMW = {"type": "AdamW", "params": {"lr": 3e-3, "betas": [0.8, 0.99], "eps": 1e-6, "weight_decay": 0.05,
                                            "fused": True}}


@pytest.mark.parametrize("scheduler", [False, True])
def test_config_hyperparameters_win_and_one_warning_lists_them(tmp_path, caplog, scheduler):
    sched = {"scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 4e-3,
                                                          "warmup_num_steps": 10, "warmup_type": "linear"}}}
    saver = _engine(SAVED_ADAMW, **(sched if scheduler else {}))
    assert len(saver.partitions.groups) == 3  # user group 0: dense + expert; user group 1: dense
    _train(saver, SAVED_STEPS)
    saver.save_checkpoint(str(tmp_path))
    saved_states = _states(saver)
    saver.destroy()

    engine = _engine(CONFIG_ADAMW, **(sched if scheduler else {}))
    built = _hparams(engine)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="rayzero"):
        engine.load_checkpoint(str(tmp_path))
    after = _hparams(engine)
    if scheduler:  # the scheduler puts the lr at the restored step; everything else is as built
        # SAVED_STEPS steps taken: the schedule's last_batch_iteration is SAVED_STEPS - 1 (as DeepSpeed counts)
        assert [g.pop("lr") for g in after] == pytest.approx([4e-3 * (SAVED_STEPS - 1) / 10] * 3)
        for g in built:
            g.pop("lr")
    assert after == built
    assert after[0]["betas"] == (0.8, 0.99) and after[0]["eps"] == 1e-6 and after[0]["fused"] is True
    assert after[0]["foreach"] is None and after[0]["weight_decay"] == 0.1 and after[2]["weight_decay"] == 0.05
    # the state (moments and steps) is the checkpoint's
    for got, want in zip(_states(engine), saved_states):
        assert got.keys() == want.keys() and got["step"] == SAVED_STEPS
        for k in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(got[k], want[k]), k

    (message,) = _rayzero_warnings(caplog)
    assert "using the config" in message
    group0, group1 = message.split("; param group 1 ")
    assert "param group 0 [fc1.weight, fc2.weight, fc3.weight]" in group0
    assert "[fc1.bias, fc2.bias, fc3.bias]" in group1
    for part in (group0, group1):
        assert "betas saved [0.9, 0.999] now [0.8, 0.99]" in part and "eps saved 1e-08 now 1e-06" in part
        assert "foreach saved True now None" in part and "fused saved None now True" in part
        assert ("lr saved" in part) is not scheduler
    assert "weight_decay" not in group0  # the group's own 0.1, saved and now
    assert "weight_decay saved 0.01 now 0.05" in group1
    if not scheduler:
        assert "lr saved 0.01 now 0.003" in group0
    assert "(dense parameters)" not in message and "(expert parameters)" not in message

    _train(engine, 1, first=SAVED_STEPS)  # the config's fused kernel runs on the restored state
    assert [st["step"] for st in _states(engine)] == [SAVED_STEPS + 1] * 3
    engine.destroy()


def test_sgd_momentum_and_amsgrad_follow_the_config(tmp_path, caplog):
    sgd = {"type": "SGD", "params": {"lr": 0.1, "momentum": 0.9}}
    saver = _engine(sgd)
    _train(saver, SAVED_STEPS)
    saver.save_checkpoint(str(tmp_path / "sgd"))
    buffers = [st["momentum_buffer"] for st in _states(saver)]
    saver.destroy()
    engine = _engine({"type": "SGD", "params": {"lr": 0.1, "momentum": 0.5, "nesterov": True}})
    with caplog.at_level(logging.WARNING, logger="rayzero"):
        engine.load_checkpoint(str(tmp_path / "sgd"))
    assert [g["momentum"] for g in engine.optimizer.param_groups] == [0.5] * 3
    assert all(g["nesterov"] for g in engine.optimizer.param_groups)
    for st, buf in zip(_states(engine), buffers):
        assert torch.equal(st["momentum_buffer"], buf)
    (message,) = _rayzero_warnings(caplog)
    assert "momentum saved 0.9 now 0.5" in message and "nesterov saved False now True" in message
    engine.destroy()

    # amsgrad turned on by the config: its running maximum starts at zero, as torch starts it
    saver = _engine(SAVED_ADAMW)
    _train(saver, SAVED_STEPS)
    saver.save_checkpoint(str(tmp_path / "adam"))
    saver.destroy()
    engine = _engine({"type": "AdamW", "params": {**SAVED_ADAMW["params"], "amsgrad": True}})
    engine.load_checkpoint(str(tmp_path / "adam"))
    assert all(torch.equal(st["max_exp_avg_sq"], torch.zeros_like(st["exp_avg"])) for st in _states(engine))
    _train(engine, 1, first=SAVED_STEPS)
    engine.save_checkpoint(str(tmp_path / "amsgrad"))
    engine.destroy()
    # and turned off again: the saved maximum is dropped
    engine = _engine(SAVED_ADAMW)
    engine.load_checkpoint(str(tmp_path / "amsgrad"))
    assert all("max_exp_avg_sq" not in st for st in _states(engine))
    _train(engine, 1, first=SAVED_STEPS + 1)
    engine.destroy()


# ---- strict=False with new parameters ------------------------------------------------------------------
class Grown(torch.nn.Module):
    """zero_cases.MLP's layers (same names, same init) plus a new output layer."""

    def __init__(self):
        super().__init__()
        base = make_model()
        self.fc1, self.fc2, self.fc3 = base.fc1, base.fc2, base.fc3
        torch.manual_seed(7)
        self.extra = torch.nn.Linear(OUT, OUT)

    def forward(self, x):
        return self.extra(self.fc3(torch.tanh(self.fc2(torch.tanh(self.fc1(x))))))


def _grown_run(rank, world, stage, save_dir, optimizer):
    """Save the small model, then load it into the grown one: refused with one param group, exact with
    the new layer in its own group."""
    cfg = _config(stage, world, optimizer)
    small = rayzero.initialize(make_model(), cfg)
    _train(small, SAVED_STEPS, rank, world)
    small.save_checkpoint(save_dir)
    small.destroy()

    grown = rayzero.initialize(Grown(), cfg)  # one param group: old and new parameters share a step count
    try:
        grown.load_checkpoint(save_dir, strict=False)
        refused = None
    except CheckpointError as e:
        refused = str(e)
    grown.destroy()

    model = Grown()
    new = list(model.extra.parameters())
    old = [p for n, p in model.named_parameters() if not n.startswith("extra.")]
    engine = rayzero.initialize(model, cfg, model_parameters=[{"params": old}, {"params": new}])
    engine.load_checkpoint(save_dir, strict=False)
    report = list(engine.load_report)
    before = engine.full_state_dict()
    steps_before = [engine.optimizer.state[g.master].get("step") for g in engine.partitions.groups]
    steps_before = [s.item() if torch.is_tensor(s) else s for s in steps_before]
    _train(engine, 1, rank, world, first=SAVED_STEPS)
    after = engine.full_state_dict()
    steps_after = [engine.optimizer.state[g.master]["step"].item() for g in engine.partitions.groups]
    engine.destroy()
    return {"refused": refused, "report": report, "before": before, "after": after,
            "steps_before": steps_before, "steps_after": steps_after}


@pytest.mark.parametrize("world,stage,optimizer", [
    (1, 0, {"type": "Adam", "params": {"lr": 1e-2}}),
    (2, 2, {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01}}),
])
def test_new_parameters_start_at_step_zero_or_the_load_is_refused(tmp_path, world, stage, optimizer):
    save_dir = str(tmp_path / "small")
    if world == 1:
        results = [_grown_run(0, 1, stage, save_dir, optimizer)]
    else:
        results = run_distributed(_grown_run, world, stage, save_dir, optimizer)
    for r in results:  # every rank refuses with the same explanation
        assert r["refused"] is not None, "a group mixing loaded and new parameters loaded with the saved step"
        assert "['extra.bias', 'extra.weight']" in r["refused"] and "step 3" in r["refused"]
        assert "param group of their own" in r["refused"]
    r = results[0]
    assert r["report"] == ["missing in the checkpoint: ['extra.bias', 'extra.weight']"]
    assert r["steps_before"] == [SAVED_STEPS, None]  # the new group has no state yet: a fresh optimizer's
    assert r["steps_after"] == [SAVED_STEPS + 1, 1]

    # The new layer's first update is a fresh Adam's first step: bias-corrected m/sqrt(v) = g/|g|.
    model = Grown()
    model.load_state_dict(r["before"])
    x, y = batches(SAVED_STEPS + 1, 12)[SAVED_STEPS]
    F.mse_loss(model(x), y).backward()
    lr, eps, wd = 1e-2, 1e-8, optimizer["params"].get("weight_decay", 0.0)
    for name in ("extra.weight", "extra.bias"):
        p, g = r["before"][name], dict(model.named_parameters())[name].grad
        want = p * (1 - lr * wd) - lr * g / (g.abs() + eps)
        torch.testing.assert_close(r["after"][name], want, rtol=1e-5, atol=1e-6)
