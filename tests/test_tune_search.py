"""``rayzero tune``'s search and search space, without a cluster (the trials are tests/test_ray_tune.py's)."""

from __future__ import annotations

import json
import math

import pytest
import torch

from rayzero.config import Config, ConfigError
from rayzero.train.tune import CHOICES, CoordinateSearch, SearchSpace, build_space, config_for, point_key


def _space(**choices) -> SearchSpace:
    start = {c: v[len(v) // 2] for c, v in choices.items()}
    return SearchSpace(choices, start, {"train_batch_size": 16}, 2, 16, start["bucket"])


def _drive(space, objective, skip=lambda p: None, confirm=0):
    skipped = []
    search = CoordinateSearch(space, skip, lambda p, why: skipped.append((p, why)), confirm=confirm)
    ran = []
    for i in range(1000):
        out = search.suggest(f"t{i}")
        if out == search.FINISHED:
            break
        assert out is not None  # one at a time: the previous trial is always complete here
        p = out["point"]
        ran.append(p)
        value = objective(p)
        result = {"status": "ok", "step_s": value} if math.isfinite(value) else {"status": "failed"}
        search.on_trial_complete(f"t{i}", result)
    return ran, skipped, search


def test_coordinate_search_finds_a_separable_optimum_in_under_a_third_of_the_grid():
    space = _space(stage=[1, 2, 3], micro_batch=[2, 4, 8], bucket=[100, 200, 400, 800], offload=["none"])
    cost = {"stage": {1: 0.30, 2: 0.10, 3: 0.20}, "micro_batch": {2: 0.05, 4: 0.0, 8: 0.02},
            "bucket": {100: 0.04, 200: 0.0, 400: 0.01, 800: 0.09}}
    objective = lambda p: 1.0 + sum(cost[c][p[c]] for c in cost)
    grid = space.points()
    assert len(grid) == 36
    ran, skipped, search = _drive(space, objective, confirm=3)
    # 1 + 2 + 2 + 3 configs, then the 3 fastest once more: 11 of 36
    assert len(ran) == 1 + 2 + 2 + 3 + 3 <= len(grid) / 3
    searched, again = ran[:8], ran[8:]
    assert len({point_key(p) for p in searched}) == 8  # no config twice while searching
    assert again == sorted(searched, key=objective)[:3]
    best = min(grid, key=objective)
    assert min(ran, key=objective) == best == {**search.best}
    assert skipped == []


def test_a_second_run_keeps_the_faster_time_and_can_change_the_winner():
    space = _space(stage=[1, 2], micro_batch=[4], bucket=[100], offload=["none"])
    # after the search stage 2 leads (0.28 against 0.30); the second runs make stage 1 the faster (0.27)
    runs = {1: [0.30, 0.27], 2: [0.28, 0.35]}
    count = {1: 0, 2: 0}

    def objective(p):
        t = runs[p["stage"]][count[p["stage"]]]
        count[p["stage"]] += 1
        return t

    ran, _, search = _drive(space, objective, confirm=2)
    assert [p["stage"] for p in ran] == [1, 2, 2, 1]  # the search, then the two fastest again, fastest first
    assert search.seen == {(1, 4, 100, "none"): 0.27, (2, 4, 100, "none"): 0.28}
    assert search.best["stage"] == 1


def test_a_skipped_or_failed_config_is_never_chosen():
    space = _space(stage=[1, 2, 3], micro_batch=[2, 4, 8], bucket=[100, 200], offload=["none"])
    # stage 1 cannot fit; micro-batch 8 fails when it runs; otherwise stage 3 and micro 8 would be fastest
    skip = lambda p: "needs 9 GiB of model state per worker" if p["stage"] == 1 else None
    objective = lambda p: math.inf if p["micro_batch"] == 8 else 1.0 - 0.1 * p["stage"] - 0.01 * p["micro_batch"]
    ran, skipped, search = _drive(space, objective, skip)
    assert all(p["stage"] != 1 for p in ran)
    assert [(p["stage"], why) for p, why in skipped] == [(1, "needs 9 GiB of model state per worker")]
    assert search.best["stage"] == 3 and search.best["micro_batch"] == 4


def test_searcher_state_survives_save_and_restore(tmp_path):
    space = _space(stage=[1, 2], micro_batch=[2, 4], bucket=[100], offload=["none"])
    ran, _, search = _drive(space, lambda p: p["stage"] + p["micro_batch"] / 10, confirm=1)
    search.save(str(tmp_path / "s.json"))
    other = CoordinateSearch(space, lambda p: None, lambda p, w: None)
    other.restore(str(tmp_path / "s.json"))
    assert other.best == search.best and other.choice == search.choice and other.seen == search.seen
    assert other.confirmed == search.confirmed == [(1, 2, 100, "none")]


def _mlp():
    with torch.device("meta"):
        return torch.nn.Sequential(*[torch.nn.Linear(1024, 1024) for _ in range(8)])


def test_search_space_keeps_the_global_batch_and_the_users_keys():
    cfg = {"train_batch_size": 32, "train_micro_batch_size_per_gpu": 4,
           "zero_optimization": {"stage": 1, "prefetch_bucket_size": 123},
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}, "steps_per_print": 0}
    space = build_space(_mlp(), cfg, 4, False)
    # 32 / 4 workers = 8 per worker: micro-batches within 4x of the config's 4
    assert space.choices["micro_batch"] == [1, 2, 4, 8]
    assert space.choices["stage"] == [1, 2, 3] and space.choices["offload"] == ["none"]
    assert space.start == {"stage": 1, "micro_batch": 4, "bucket": space.derived_bucket, "offload": "none"}
    assert space.derived_bucket == 3_750_000  # 8.4M elements / 8 is under gloo's floor (zero/buckets.py)
    for p in space.points():
        out = config_for(space, p)
        c = Config.from_any(out)
        plan = c.resolve_batch(4)
        assert plan.train_batch_size == 32 and plan.micro_batch_size == p["micro_batch"]
        assert out["zero_optimization"]["prefetch_bucket_size"] == 123  # the user's spelling, untouched
        assert out["steps_per_print"] == 0 and out["optimizer"] == cfg["optimizer"]
        assert c.zero_optimization.reduce_bucket_size == c.zero_optimization.allgather_bucket_size == p["bucket"]
    assert json.dumps(config_for(space, space.start))  # plain JSON


def test_search_space_errors_name_the_problem(tmp_path):
    with pytest.raises(ConfigError, match="keeps the global batch"):
        build_space(_mlp(), {"zero_optimization": {"stage": 1}}, 2, False)
    with pytest.raises(ConfigError, match=r"micro-batch sizes \[5\] do not divide the 8 samples per worker"):
        build_space(_mlp(), {"train_batch_size": 16}, 2, False, micro_batches=[4, 5])
    with pytest.raises(ConfigError, match="offload choice 'nvme' needs"):
        build_space(_mlp(), {"train_batch_size": 16}, 2, False, offload=["none", "nvme"])
    with pytest.raises(ConfigError, match="needs the model's shapes"):
        build_space(None, {"train_batch_size": 16}, 2, False)
    assert CHOICES == ("stage", "micro_batch", "bucket", "offload")
