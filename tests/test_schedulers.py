"""rayzero's learning-rate schedules and step counters against DeepSpeed.

Three references: DeepSpeed's numbers recorded once by bench/ds_reference.py into tests/data/ds_reference.json
(regenerate: DS_ACCELERATOR=cpu python bench/ds_reference.py in an environment with DeepSpeed), DeepSpeed's
formulas written out here, and DeepSpeed itself where it is installed (skipped otherwise).
"""

from __future__ import annotations

import json
import math
import os

import pytest
import torch

import rayzero
from rayzero.config import Config, ConfigError
from rayzero.optim.schedulers import (
    LRRangeTest,
    OneCycle,
    WarmupCosineLR,
    WarmupDecayLR,
    WarmupLR,
    build_scheduler,
)

REFERENCE = json.load(open(os.path.join(os.path.dirname(__file__), "data", "ds_reference.json")))


def _optimizer(lrs=tuple(REFERENCE["base_lrs"]), betas=tuple(REFERENCE["betas"])) -> torch.optim.Optimizer:
    weights = [torch.nn.Parameter(torch.zeros(1)) for _ in lrs]
    return torch.optim.AdamW([{"params": [w], "lr": lr} for w, lr in zip(weights, lrs)], betas=betas)


def _build(kind: str, params: dict, optimizer):
    return build_scheduler(Config.from_any({"scheduler": {"type": kind, "params": params}}).scheduler, optimizer)


def _flat(rows):
    return [x for row in rows for x in row]


def _drive(sched, optimizer, steps: int) -> tuple[list[list[float]], list[list[list[float]]]]:
    """As DeepSpeed's engine drives a schedule: the lr (and betas) optimizer step 0..steps-1 runs at, with
    scheduler.step() after each optimizer step."""
    lrs, betas = [], []
    for _ in range(steps):
        lrs.append([float(g["lr"]) for g in optimizer.param_groups])
        betas.append([list(g["betas"]) for g in optimizer.param_groups])
        sched.step()
    return lrs, betas


@pytest.mark.parametrize("name", sorted(REFERENCE["schedules"]))
def test_every_schedule_gives_deepspeeds_lr_at_every_step(name):
    case = REFERENCE["schedules"][name]
    opt = _optimizer()
    sched = _build(case["type"], case["params"], opt)
    lrs, betas = _drive(sched, opt, REFERENCE["steps"])
    assert _flat(lrs) == pytest.approx(_flat(case["lrs"]), rel=1e-12, abs=1e-15)
    assert betas == case["betas"]  # OneCycle's cycled betas; the others leave them alone
    assert sched.state_dict() == case["state_dict"]
    if case["last_lr"] is not None:
        assert sched.get_last_lr() == pytest.approx(case["last_lr"], rel=1e-12, abs=1e-15)


def test_warmup_lr_steps_as_deepspeed_not_one_ahead():
    """Issue 29: DeepSpeed's per-step lr is [0, 0, ...]: building the schedule sets lr(-1) = warmup_min_lr and
    the first optimizer step runs at it; step() after it sets lr(0), also warmup_min_lr under log warmup."""
    opt = _optimizer(lrs=(1.0,))
    sched = _build("WarmupLR", {"warmup_min_lr": 0.0, "warmup_max_lr": 0.001, "warmup_num_steps": 4}, opt)
    lrs, _ = _drive(sched, opt, 6)
    want = [0.0, 0.0] + [0.001 * math.log(i) / math.log(4) for i in (2, 3, 4)] + [0.001]
    assert [lr[0] for lr in lrs] == pytest.approx(want, rel=1e-12, abs=1e-15)
    assert sched.last_batch_iteration == 5 and sched.state_dict() == {"last_batch_iteration": 5}


def _warmup_gamma(n: int, w: int, kind: str) -> float:
    w = max(2, w)
    if n >= w:
        return 1.0
    return math.log(n + 1) / math.log(w) if kind == "log" else n / w


@pytest.mark.parametrize("kind", ["log", "linear"])
def test_closed_forms(kind):
    """DeepSpeed's formulas, written out: the optimizer step with index i runs at f(i - 1)."""
    steps = 40
    lo, hi, w, total = 0.01, 0.1, 7, 25
    opt = _optimizer()
    got, _ = _drive(_build("WarmupLR", {"warmup_min_lr": lo, "warmup_max_lr": hi, "warmup_num_steps": w,
                                        "warmup_type": kind}, opt), opt, steps)
    want = [lo] + [lo + (hi - lo) * _warmup_gamma(i - 1, w, kind) for i in range(1, steps)]
    assert [g[0] for g in got] == pytest.approx(want, rel=1e-12)

    opt = _optimizer()
    got, _ = _drive(_build("WarmupDecayLR", {"warmup_min_lr": lo, "warmup_max_lr": hi, "warmup_num_steps": w,
                                             "total_num_steps": total, "warmup_type": kind}, opt), opt, steps)
    want = [lo] + [lo + (hi - lo) * (_warmup_gamma(n, w, kind) if n < w else max(0.0, (total - n) / (total - w)))
                   for n in range(steps - 1)]
    assert [g[1] for g in got] == pytest.approx(want, rel=1e-12)
    assert got[total + 1][0] == lo  # decayed to warmup_min_lr at n = total_num_steps

    min_ratio, cos_min = 0.2, 0.01
    opt = _optimizer()
    got, _ = _drive(_build("WarmupCosineLR", {"total_num_steps": total, "warmup_num_steps": w,
                                              "warmup_min_ratio": min_ratio, "cos_min_ratio": cos_min,
                                              "warmup_type": kind}, opt), opt, steps)

    def ratio(n):
        if n < w:
            return min_ratio + (1 - min_ratio) * _warmup_gamma(n, w, kind)
        progress = min(1.0, (n - w + 1) / (total - w))
        return cos_min + (1 - cos_min) * (1 + math.cos(math.pi * progress)) / 2

    want = [[0.0, 0.0]] + [[b * ratio(n) for b in REFERENCE["base_lrs"]] for n in range(steps - 1)]
    assert _flat(got) == pytest.approx(_flat(want), rel=1e-12)
    assert got[-1] == pytest.approx([b * cos_min for b in REFERENCE["base_lrs"]])  # held after the end


def test_one_cycle_and_range_test_closed_forms():
    lo, hi, first, second = 0.001, 0.011, 4, 6
    opt = _optimizer()
    sched = _build("OneCycle", {"cycle_min_lr": lo, "cycle_max_lr": hi, "cycle_first_step_size": first,
                                "cycle_second_step_size": second, "cycle_min_mom": 0.8, "cycle_max_mom": 0.9,
                                "decay_lr_rate": 0.5, "decay_step_size": 2}, opt)
    assert isinstance(sched, OneCycle)
    lrs, betas = _drive(sched, opt, 16)
    # step i runs after step() i times: position i in the cycle (0 at build), up for `first`, down for `second`
    up = [i / first for i in range(first + 1)]
    down = [1 - j / second for j in range(1, second)]
    scale = up + down
    for i, s in enumerate(scale):
        assert lrs[i][0] == pytest.approx(lo + (hi - lo) * s, rel=1e-12)
        if i:  # at build DeepSpeed sets the first beta to cycle_min_mom; after that it mirrors the lr
            assert betas[i][0] == pytest.approx([0.9 - 0.1 * s, 0.99], rel=1e-12)
    assert betas[0][0] == [0.8, 0.99]
    for i in range(first + second, 16):  # after the cycle: cycle_min_lr / (1 + rate * k / decay_step_size)
        k = i - (first + second)
        assert lrs[i][0] == pytest.approx(lo / (1 + 0.5 * k / 2), rel=1e-12)
        assert betas[i][0] == [0.9, 0.99]  # no decay_mom_rate: held at cycle_max_mom

    opt = _optimizer()
    sched = _build("LRRangeTest", {"lr_range_test_min_lr": 0.002, "lr_range_test_step_size": 5,
                                   "lr_range_test_step_rate": 3.0}, opt)
    assert isinstance(sched, LRRangeTest)
    lrs, _ = _drive(sched, opt, 12)
    assert [g[0] for g in lrs] == pytest.approx([0.002 * (1 + 3.0 * i / 5) for i in range(12)], rel=1e-12)


def test_state_dict_round_trip_and_earlier_format():
    params = {"total_num_steps": 50, "warmup_num_steps": 5, "warmup_type": "linear"}
    opt = _optimizer()
    sched = _build("WarmupCosineLR", params, opt)
    _drive(sched, opt, 17)
    state = sched.state_dict()
    assert state == {"last_batch_iteration": 16}
    fresh_opt = _optimizer()
    fresh = _build("WarmupCosineLR", params, fresh_opt)
    fresh.load_state_dict(json.loads(json.dumps(state)))
    assert [g["lr"] for g in fresh_opt.param_groups] == [g["lr"] for g in opt.param_groups]
    assert _drive(fresh, fresh_opt, 10) == _drive(sched, opt, 10)

    # rayzero's earlier scheduler state counted steps taken (last_epoch): 17 steps taken is index 16
    old_opt = _optimizer()
    old = _build("WarmupCosineLR", params, old_opt)
    old.load_state_dict({"last_epoch": 17, "_step_count": 18, "warmup_num_steps": 5})
    assert old.last_batch_iteration == 16
    assert [g["lr"] for g in old_opt.param_groups] == fresh.lr_at(16)


def test_default_warmup_max_lr_is_the_groups_lr_and_cosine_scales_it():
    opt = _optimizer(lrs=(0.3, 0.03))
    sched = _build("WarmupLR", {"warmup_num_steps": 2}, opt)
    assert isinstance(sched, WarmupLR) and sched.get_last_lr() == [0.0, 0.0]
    assert sched.lr_at(5) == [0.3, 0.03]
    opt = _optimizer(lrs=(0.3, 0.03))
    sched = _build("WarmupDecayLR", {"total_num_steps": 10}, opt)
    assert isinstance(sched, WarmupDecayLR) and sched.max_lrs == [0.001, 0.001]  # DeepSpeed's default here
    opt = _optimizer(lrs=(0.3, 0.03))
    assert isinstance(_build("WarmupCosineLR", {"total_num_steps": 10}, opt), WarmupCosineLR)


def test_scheduler_config_errors_name_every_problem():
    with pytest.raises(ConfigError, match="'scheduler.params.warmup_num_steps' = 0 is invalid.*leave out the "
                                          "'scheduler' section"):
        Config.from_any({"scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 0}}})
    with pytest.raises(ConfigError) as err:
        Config.from_any({"scheduler": {"type": "OneCycle", "params": {"cycle_min_lr": -1, "cycle_mom": 0.9}}})
    text = str(err.value)
    assert "3 problems in 'scheduler'" in text
    assert "'scheduler.params.cycle_min_lr' = -1 is invalid" in text
    assert "unknown config key 'scheduler.params.cycle_mom'" in text
    assert "'scheduler.params.cycle_max_lr' is required for OneCycle" in text
    with pytest.raises(ConfigError, match="'Linear' is unknown; supported types: WarmupLR, WarmupDecayLR, "
                                          "WarmupCosineLR, OneCycle, LRRangeTest"):
        Config.from_any({"scheduler": {"type": "Linear"}})
    with pytest.raises(ConfigError, match="3 values but the optimizer has 2 param groups"):
        _build("WarmupLR", {"warmup_max_lr": [0.1, 0.2, 0.3]}, _optimizer())
    # as in DeepSpeed, a schedule built at a later position leaves the optimizer's lr alone until step()
    opt = _optimizer()
    sched = _build("WarmupLR", {"warmup_num_steps": 4, "warmup_max_lr": 0.4, "last_batch_iteration": 1}, opt)
    assert [g["lr"] for g in opt.param_groups] == list(REFERENCE["base_lrs"]) and sched.last_batch_iteration == 1
    sched.step()
    assert [g["lr"] for g in opt.param_groups] == [0.4 * math.log(3) / math.log(4)] * 2
    # DeepSpeed accepts a total shorter than the warmup (with a warning), and so does rayzero
    Config.from_any({"scheduler": {"type": "WarmupDecayLR", "params": {"total_num_steps": 5, "warmup_num_steps": 10}}})


# --- the engine's counters, batch keys, clipping and lr against DeepSpeed's engine ------------------------


@pytest.mark.parametrize("name", sorted(REFERENCE["engine_runs"]))
def test_engine_counters_losses_and_lr_match_deepspeed(name):
    run = REFERENCE["engine_runs"][name]
    model = torch.nn.Linear(4, 2)
    model.load_state_dict({k: torch.tensor(v) for k, v in run["init"].items()})
    engine = rayzero.initialize(model, run["config"])
    try:
        assert {"train_batch_size": engine.batch.train_batch_size,
                "train_micro_batch_size_per_gpu": engine.batch.micro_batch_size,
                "gradient_accumulation_steps": engine.gradient_accumulation_steps} == run["batch"]
        for x, ref in zip(run["inputs"], run["steps"]):
            boundary = engine.is_gradient_accumulation_boundary()
            lr = engine.get_lr()
            loss = engine(torch.tensor(x)).pow(2).mean()
            engine.backward(loss)
            engine.step()
            assert (boundary, engine.global_steps, engine.micro_steps, engine.global_samples,
                    engine.skipped_steps) == (ref["boundary"], ref["global_steps"], ref["micro_steps"],
                                              ref["global_samples"], ref["skipped_steps"])
            assert lr == pytest.approx(ref["lr"], rel=1e-12, abs=1e-15)
            assert float(loss.detach()) == pytest.approx(ref["loss"], abs=2e-6)
            if ref["grad_norm"] is not None:  # the unscaled norm before clipping, as DeepSpeed reports it
                assert engine.global_grad_norm == pytest.approx(ref["grad_norm"], rel=1e-5)
        final = engine.full_state_dict()
        for key, value in run["final"].items():
            torch.testing.assert_close(final[key], torch.tensor(value), atol=1e-6, rtol=1e-5)
    finally:
        engine.destroy()


def test_skipped_fp16_step_counts_but_does_not_step_the_schedule():
    """DeepSpeed's engine on an fp16 overflow: skipped_steps, global_steps and global_samples go up, the
    schedule does not step (runtime/engine.py _take_model_step)."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    engine = rayzero.initialize(model, {
        "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1,
        "optimizer": {"type": "Adam", "params": {"lr": 0.01}}, "fp16": {"enabled": True, "initial_scale_power": 4},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 4, "warmup_type": "linear"}}})
    try:
        seen = []
        for i in range(4):
            loss = engine(torch.randn(2, 4)).float().pow(2).mean()
            engine.backward(loss * float("inf") if i == 1 else loss)
            engine.step()
            seen.append((engine.global_steps, engine.skipped_steps, engine.global_samples,
                         engine.lr_scheduler.last_batch_iteration))
        assert seen == [(1, 0, 2, 0), (2, 1, 4, 0), (3, 1, 6, 1), (4, 1, 8, 2)]
        assert engine.get_lr() == pytest.approx([0.01 * 2 / 4])
    finally:
        engine.destroy()


def test_live_deepspeed_schedules_match():
    """Where DeepSpeed is installed: its schedules, built now, against rayzero's over the reference cases."""
    pytest.importorskip("deepspeed")
    import importlib.util

    from deepspeed.runtime import lr_schedules

    spec = importlib.util.spec_from_file_location(
        "ds_reference", os.path.join(os.path.dirname(__file__), "..", "bench", "ds_reference.py"))
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    for name, kind, params in bench.CASES:
        live = bench._schedule_case(lr_schedules, torch, kind, params)
        opt = _optimizer()
        lrs, betas = _drive(_build(kind, params, opt), opt, bench.STEPS)
        assert _flat(lrs) == pytest.approx(_flat(live["lrs"]), rel=1e-12, abs=1e-15), name
        assert betas == live["betas"], name


def test_one_cycle_momentum_is_refused_under_graph_capture():
    """A captured step keeps the betas it was recorded with, so OneCycle's cycled betas would not reach it."""
    cfg = {"train_micro_batch_size_per_gpu": 1, "graph_capture": {"enabled": True},
           "scheduler": {"type": "OneCycle", "params": {"cycle_min_lr": 0.001, "cycle_max_lr": 0.01}}}
    with pytest.raises(ConfigError, match="cycle_momentum.*captured step keeps the betas"):
        rayzero.initialize(torch.nn.Linear(4, 2), cfg)


@pytest.mark.parametrize("case", REFERENCE["loss_scaler"]["cases"],
                         ids=lambda c: "w{window}-h{hysteresis}-c{consecutive_hysteresis}".format(**c))
def test_dynamic_loss_scale_follows_deepspeeds(case):
    """DeepSpeed grows the scale on the good step after each `window` good steps since the last overflow
    (runtime/fp16/loss_scaler.py: stable_interval), and spends hysteresis before it halves."""
    from rayzero.optim.loss_scaler import LossScaler

    ref = REFERENCE["loss_scaler"]
    scaler = LossScaler(scale=ref["init_scale"], dynamic=True, window=case["window"], hysteresis=case["hysteresis"],
                        consecutive_hysteresis=case["consecutive_hysteresis"], min_scale=ref["min_scale"],
                        hysteresis_left=case["hysteresis"])
    scales = []
    for overflow in ref["overflows"]:
        scaler.update(overflow)
        scales.append(scaler.scale)
    assert scales == case["scales"]
