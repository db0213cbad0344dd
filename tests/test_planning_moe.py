"""The driver's plan with tensor x expert parallelism: the layout per world size, the refusals, and the cut
of each step's samples over the data-parallel shards.  Pure Python, no Ray (one Ray run at the end)."""

from __future__ import annotations

import importlib.util
import math
import os

import pytest

import rayzero
from rayzero.train.data import GlobalOrder, micro_batches
from rayzero.train.planning import StepPlan, layout_problem, plan_range, plan_step, skipped_sizes
from rayzero.train.worker import WorkerSpec, _plan_for

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# ---- tp = ep = 1: the plain plan is unchanged (docs/ray.md's worked example) ---------------------------------


def test_plain_plan_is_unchanged():
    assert plan_step(12, 1) == StepPlan(1, 12, 12, 1)
    assert plan_step(12, 2, [2, 4]) == StepPlan(2, 12, 2, 3)
    assert plan_step(12, 3, [4]) == StepPlan(3, 12, 4, 1)
    assert plan_step(12, 3).dp == 3 and plan_step(12, 3).tp == 1 and plan_step(12, 3).ep == 1
    with pytest.raises(rayzero.ConfigError, match=r"acceptable sizes that would work: \[1, 2, 3, 6\]"):
        plan_step(12, 2, [4])
    with pytest.raises(rayzero.ConfigError) as e:
        plan_range(8, 1, 3)
    assert "cannot be kept at every world size in [1, 3]" in str(e.value)
    assert "8 % 3 = 2" in str(e.value) and "world sizes that divide it: [1, 2]" in str(e.value)
    assert sorted(plan_range(12, 1, 3)) == [1, 2, 3] and skipped_sizes(1, 3) == {}


# ---- the layout per world size ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "world, tp, ep, dp, edp, micro, acc",
    [
        (2, 1, 2, 2, 1, 6, 1),  # EP=2 on 2 workers: two data shards, the experts split between them
        (4, 1, 2, 4, 2, 3, 1),  # 2 EP groups of 2: every expert has 2 replicas
        (4, 2, 1, 2, 2, 6, 1),  # TP=2: 2 data shards of 2 ranks each
        (8, 2, 2, 4, 2, 3, 1),
        (4, 2, 2, 2, 1, 6, 1),
    ],
)
def test_layout_and_cut_over_data_shards(world, tp, ep, dp, edp, micro, acc):
    plan = plan_step(12, world, None, tp, ep)
    assert (plan.dp, plan.edp, plan.micro_batch, plan.accumulation) == (dp, edp, micro, acc)
    assert plan.micro_batch * plan.accumulation * plan.dp == 12  # the global batch is cut over dp, not world
    dims = plan.dims  # the engine's own layout object agrees with the plan
    assert (dims.dp, dims.tp, dims.ep, dims.edp) == (dp, tp, ep, edp)
    # what the engine resolves from the overrides the worker sends it: train_batch_size = micro x gas x dp
    batch = rayzero.Config.from_any(plan.config_overrides()).resolve_batch(plan.dp)
    assert (batch.train_batch_size, batch.micro_batch_size, batch.gradient_accumulation_steps) == (
        12, micro, acc)


def test_micro_batch_choice_per_data_shard():
    # 24 samples on 4 workers with tp=2: 12 per data shard, micro-batches of at most 4 -> 4 x 3
    plan = plan_step(24, 4, [1, 2, 3, 4], tp=2)
    assert (plan.micro_batch, plan.accumulation) == (4, 3)
    with pytest.raises(rayzero.ConfigError) as e:
        plan_step(24, 4, [5], tp=2)
    assert "12 samples per data shard" in str(e.value) and "the 2 data shards of 4 workers (tp 2)" in str(e.value)
    assert "[1, 2, 3, 4, 6, 12]" in str(e.value)
    assert "world 4 = tp 2 x dp 2: micro-batch 4 x accumulation 3" == plan.describe()
    assert "(ep 2 x edp 2)" in plan_step(8, 4, ep=2).describe()


# ---- refusals --------------------------------------------------------------------------------------------


def test_sizes_that_cannot_host_the_layout_are_refused_with_the_numbers():
    with pytest.raises(rayzero.ConfigError) as e:
        plan_step(12, 3, tp=2)
    assert "3 workers cannot host tensor_parallel.autotp_size=2: 3 % 2 = 1" in str(e.value)
    assert "multiple of tp x ep = 2" in str(e.value)
    with pytest.raises(rayzero.ConfigError) as e:
        plan_step(12, 6, tp=2, ep=2)
    msg = str(e.value)
    assert "6 workers give 3 data-parallel ranks (world 6 // tp 2)" in msg
    assert "expert_parallel.autoep_size=2: 3 % 2 = 1" in msg and "multiple of tp x ep = 4" in msg
    with pytest.raises(rayzero.ConfigError) as e:
        plan_step(12, 3, ep=2)
    assert "3 workers give 3 data-parallel ranks, which cannot host expert_parallel.autoep_size=2: 3 % 2 = 1" \
        in str(e.value)
    assert layout_problem(8, 2, 2) is None and layout_problem(2, 1, 2) is None


def test_batch_not_divisible_by_data_shards_is_refused():
    # 6 workers, tp 2 -> 3 data shards: fine for 12 samples, not for 8
    assert plan_step(12, 6, tp=2).micro_batch == 4
    with pytest.raises(rayzero.ConfigError) as e:
        plan_step(8, 6, tp=2)
    assert "cannot be split over the 3 data shards of 6 workers (world 6 // tp 2 = 3; 8 % 3 = 2)" in str(e.value)
    with pytest.raises(rayzero.ConfigError, match="must be an integer >= 1"):
        plan_step(8, 2, tp=0)


def test_range_skips_inner_sizes_and_refuses_bad_ends():
    plans = plan_range(12, 2, 6, tp=2)
    assert sorted(plans) == [2, 4, 6]
    assert [plans[w].dp for w in (2, 4, 6)] == [1, 2, 3]
    assert sorted(skipped_sizes(2, 6, tp=2)) == [3, 5]
    assert sorted(plan_range(16, 4, 8, tp=2, ep=2)) == [4, 8]
    for lo, hi, which in ((1, 4, "1 workers (min of the range)"), (2, 5, "5 workers (max of the range)")):
        with pytest.raises(rayzero.ConfigError) as e:
            plan_range(12, lo, hi, tp=2)
        msg = str(e.value)
        assert f"cannot be kept at every world size in [{lo}, {hi}] with tp 2 x ep 1" in msg
        assert which in msg and "cannot host tensor_parallel.autotp_size=2" in msg
        assert "world sizes (up to 8) that host tp 2 x ep 1 and split the batch over their world // tp data shards: " \
               "[2, 4, 6, 8]" in msg
    # a hostable size inside the range that cannot cut the batch still fails the range
    with pytest.raises(rayzero.ConfigError, match=r"6 workers: the global batch of 8 samples cannot be split over"):
        plan_range(8, 2, 8, tp=2)


def test_worker_group_at_a_skipped_size_stops_with_a_clear_error():
    spec = WorkerSpec(model=None, config={}, global_batch=12, max_steps=1, tp=2, world_sizes=[2, 4])
    assert _plan_for(spec, 4).dp == 2
    with pytest.raises(rayzero.ConfigError) as e:
        _plan_for(spec, 3)
    msg = str(e.value)
    assert "Ray Train started the worker group with 3 workers, which this run cannot use" in msg
    assert "3 % 2 = 1" in msg and "world sizes of the range that work: [2, 4]" in msg


# ---- the data cut ----------------------------------------------------------------------------------------


def _cut(plan: StepPlan, order: GlobalOrder, step: int) -> dict[int, list[list[int]]]:
    """Each world rank's micro-batches of ``step``, cut as the worker does: by its data-parallel coordinate."""
    out = {}
    for rank in range(plan.world_size):
        dp_rank = plan.dims.coords(rank).dp
        out[rank] = list(micro_batches(order, step, plan.global_batch, plan.dp, dp_rank, plan.micro_batch))
    return out


@pytest.mark.parametrize("world, tp, ep, micro_sizes", [(4, 2, 1, None), (4, 2, 1, [2]), (8, 2, 2, [1]),
                                                        (2, 1, 2, None), (4, 1, 2, [1])])
def test_tp_ranks_read_the_same_samples_and_every_sample_is_used_once(world, tp, ep, micro_sizes):
    order = GlobalOrder(96, seed=0)
    plan = plan_step(12, world, micro_sizes, tp, ep)
    for step in range(3):
        cut = _cut(plan, order, step)
        for group in plan.dims.tp_groups():  # the ranks of one TP group get identical batches
            assert all(cut[r] == cut[group[0]] for r in group), (step, group)
        # one rank per data shard (tp index 0) covers the step exactly once
        shards = [cut[plan.dims.rank_of(d, 0)] for d in range(plan.dp)]
        taken = sorted(i for shard in shards for micro in shard for i in micro)
        assert taken == sorted(order.step_indices(step, 12))
        assert all(len(micro) == plan.micro_batch for shard in shards for micro in shard)
        assert all(len(shard) == plan.accumulation for shard in shards)


def test_a_step_holds_the_same_samples_at_every_layout():
    """Resizing or changing the layout changes only the cut, never which samples a step holds."""
    order = GlobalOrder(96, seed=3)
    for world, tp, ep in ((1, 1, 1), (2, 1, 2), (2, 2, 1), (4, 2, 2), (6, 2, 1)):
        plan = plan_step(12, world, None, tp, ep)
        for step in (0, 5):
            cut = _cut(plan, order, step)
            taken = sorted(i for d in range(plan.dp) for micro in cut[plan.dims.rank_of(d, 0)] for i in micro)
            assert taken == sorted(order.step_indices(step, 12))


# ---- the MoE example through rayzero.fit (Ray) -----------------------------------------------------------


def _load_example():
    spec = importlib.util.spec_from_file_location("train_moe_example", os.path.join(ROOT, "examples", "train_moe.py"))
    module = importlib.util.module_from_spec(spec)
    import sys

    sys.modules[spec.name] = module  # cloudpickle sends the example's code by value (the workers cannot import it)
    spec.loader.exec_module(module)
    return module


def test_moe_example_ep2_on_two_ray_workers(tmp_path):
    ray = pytest.importorskip("ray")
    pytest.importorskip("transformers")
    example = _load_example()
    ray.init(num_cpus=2, include_dashboard=False)
    try:
        args = example.parse_args(["--max-steps", "3", "--workers", "2", "--ep", "2", "--storage", str(tmp_path),
                                   "--lr", "1e-2"])
        args_cfg = example.engine_config(args)
        assert args_cfg["expert_parallel"] == {"enabled": True, "autoep_size": 2, "preset_model": "qwen3_moe"}
        result = example.run(args)
    finally:
        ray.shutdown()
    losses = result.losses
    assert len(losses) == 3 and all(math.isfinite(l) for l in losses), losses
    assert losses[-1] < losses[0], losses
    assert result.world_sizes == [2]
    last = result.history[-1]
    assert (last["world_size"], last["ep"], last["tp"], last["dp"]) == (2, 2, 1, 2)
    assert (last["micro_batch"], last["accumulation"]) == (4, 1)  # 8 samples over 2 data shards
