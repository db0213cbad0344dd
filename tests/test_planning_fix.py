"""The driver keeps the user's micro-batch x accumulation where it fits the world size (and says when it
cannot), and the pre-launch memory check counts the model states of docs/design.md "Memory per rank",
also for model factories (built on the meta device).  Pure Python: no Ray, no allocation of big models."""

from __future__ import annotations

import os
import re

import pytest
import ray.cloudpickle as cloudpickle
import torch

import rayzero
from rayzero.config import Config
from rayzero.train.cluster_config import ClusterConfig
from rayzero.train.fit import _plan_run
from rayzero.memory import model_state_bytes, model_state_bytes_per_param, model_state_bytes_per_worker
from rayzero.train.state_memory import _check_fits
from rayzero.train.planning import MicroBatchSizes, plan_range, plan_step
from rayzero.train.worker import WorkerSpec, _plan_for

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GIB = 1 << 30


def _cuts(plans):
    return {w: (p.micro_batch, p.accumulation) for w, p in plans.items()}


def _worker_plan(micro_sizes, global_batch, world, tp=1, ep=1):
    """A worker's re-plan of ``world``, from a spec that went through pickling as Ray sends it."""
    spec = WorkerSpec(model=None, config={}, global_batch=global_batch, max_steps=1, micro_batch_sizes=micro_sizes,
                      tp=tp, ep=ep)
    return _plan_for(cloudpickle.loads(cloudpickle.dumps(spec)), world)


# ---- 1. the user's micro-batch / accumulation ----------------------------------------------------------


def test_accumulation_from_the_config_is_kept_where_it_fits():
    cfg = Config.from_any({"train_batch_size": 24, "gradient_accumulation_steps": 4})
    global_batch, micro_sizes, plans = _plan_run(cfg, ClusterConfig.from_any({"workers": (1, 4)}))
    assert global_batch == 24
    # 24 / W samples per worker, 4 micro-batches each where 4 divides them
    assert _cuts(plans) == {1: (6, 4), 2: (3, 4), 3: (2, 4), 4: (2, 3)}
    assert [w for w, p in plans.items() if p.note] == [4]
    # 6 samples per worker at W=4 are not a multiple of 4: the nearest accumulation, and the plan says so
    note = plans[4].note
    assert "gradient accumulation 4 -> 3" in note and "6 samples per worker (24 / 4 on 4 workers)" in note
    assert "not a multiple of 4" in note and "re-planned: " + note in plans[4].describe()
    # every worker's re-plan (its spec pickled as Ray sends it) keeps the same cut and note
    for w, plan in plans.items():
        again = _worker_plan(micro_sizes, global_batch, w)
        assert (again.micro_batch, again.accumulation, again.note) == (plan.micro_batch, plan.accumulation, plan.note)


def test_micro_batch_and_accumulation_from_the_config():
    cfg = Config.from_any({"train_batch_size": 48, "train_micro_batch_size_per_gpu": 4,
                           "gradient_accumulation_steps": 3})
    _, micro_sizes, plans = _plan_run(cfg, ClusterConfig.from_any({"workers": (2, 4)}))
    assert _cuts(plans) == {2: (4, 6), 3: (4, 4), 4: (4, 3)}
    assert plans[4].note == ""  # 4 x 3 x 4 workers = 48: the config as written
    assert "gradient accumulation 3 -> 6" in plans[2].note and "24 samples per worker" in plans[2].note
    assert "gradient accumulation 3 -> 4" in plans[3].note
    assert _worker_plan(micro_sizes, 48, 3).note == plans[3].note
    # without train_batch_size the global batch is micro x accumulation x min, and min keeps both as given
    cfg = Config.from_any({"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 6})
    global_batch, _, plans = _plan_run(cfg, ClusterConfig.from_any({"workers": (2, 4)}))
    assert global_batch == 24 and _cuts(plans) == {2: (2, 6), 3: (2, 4), 4: (2, 3)} and plans[2].note == ""
    assert "gradient accumulation 6 -> 3" in plans[4].note


def test_micro_batch_that_does_not_divide_is_cut_down_and_said():
    plan = plan_step(24, 4, MicroBatchSizes(range(1, 5), micro_batch=4, accumulation=2))
    assert (plan.micro_batch, plan.accumulation) == (3, 2)  # never above the user's micro-batch
    assert plan.note.startswith("micro-batch 4 -> 3: 4 does not divide the 6 samples per worker")
    # an explicit list of acceptable sizes that leaves out the user's micro-batch
    plan = plan_step(24, 2, [2, 3], micro_batch=4)
    assert (plan.micro_batch, plan.accumulation) == (3, 4)
    assert "micro-batch 4 -> 3: 4 is not one of the acceptable micro-batch sizes" in plan.note
    # only a micro-batch given, and it fits: no note (the accumulation is whatever makes the batch)
    assert plan_step(24, 2, micro_batch=4).note == "" and plan_step(24, 2, micro_batch=4).accumulation == 3
    with pytest.raises(rayzero.ConfigError, match="gradient_accumulation_steps must be an integer >= 1"):
        plan_step(24, 2, accumulation=0)


def test_accumulation_is_kept_over_data_shards_with_tp():
    cfg = Config.from_any({"train_batch_size": 16, "gradient_accumulation_steps": 2,
                           "tensor_parallel": {"autotp_size": 2}})
    _, micro_sizes, plans = _plan_run(cfg, ClusterConfig.from_any({"workers": (2, 4)}))
    assert sorted(plans) == [2, 4]  # 3 cannot host tp 2
    assert _cuts(plans) == {2: (8, 2), 4: (4, 2)} and not any(p.note for p in plans.values())
    assert _worker_plan(micro_sizes, 16, 4, tp=2).micro_batch == 4
    plan = plan_range(16, 8, 8, tp=2, accumulation=3)[8]  # dp 4: 4 samples per data shard
    assert (plan.micro_batch, plan.accumulation) == (1, 4)  # 4 is as near 3 as 2 is; the smaller micro-batch
    assert "the 4 samples per data shard (16 / 4 on the 4 data shards of 8 workers (tp 2))" in plan.note


def test_without_a_config_cut_the_plan_is_unchanged():
    _, micro_sizes, plans = _plan_run(Config.from_any({"train_batch_size": 12}),
                                      ClusterConfig.from_any({"workers": (1, 3)}))
    assert micro_sizes is None and _cuts(plans) == {1: (12, 1), 2: (6, 1), 3: (4, 1)}
    _, micro_sizes, plans = _plan_run(Config.from_any({"train_batch_size": 12}),
                                      ClusterConfig.from_any({"workers": (1, 3), "micro_batch_sizes": [2, 4]}))
    assert micro_sizes == [2, 4] and _cuts(plans) == {1: (4, 3), 2: (2, 3), 3: (4, 1)}


# ---- 2. the memory check -------------------------------------------------------------------------------

# docs/design.md "Memory per rank", bytes per trainable parameter (stage 3 without persistent parameters)
TABLE = {
    (0, False): lambda w: 16, (0, True): lambda w: 18,
    (1, False): lambda w: 8 + 16 / w, (1, True): lambda w: 6 + 16 / w,
    (2, False): lambda w: 4 + 16 / w, (2, True): lambda w: 2 + 16 / w,
    (3, False): lambda w: 16 / w, (3, True): lambda w: 16 / w,
}


def test_the_table_is_the_one_in_design_md():
    text = open(os.path.join(ROOT, "docs", "design.md")).read()
    rows = {int(m[0]): (m[1], m[2]) for m in re.findall(r"^\| (\d) \|.*\| \*\*(.+?)\*\*(?: \+ [^|]*)? \| (.+?) \|$",
                                                       text, re.M)}
    assert rows[0] == ("16", "18") and rows[1] == ("8 + 16/W", "6 + 16/W")
    assert rows[2] == ("4 + 16/W", "2 + 16/W") and rows[3][0] == "16/W"


@pytest.mark.parametrize("dtype", ["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_bytes_per_parameter_match_the_table(stage, dtype):
    mixed = dtype != "fp32"
    for world in (1, 2, 4, 8):
        assert model_state_bytes_per_param(stage, world, mixed) == pytest.approx(TABLE[stage, mixed](world))
        assert model_state_bytes_per_worker(8000, stage, world, mixed) == round(8000 * TABLE[stage, mixed](world))
    # the same through a config and a model: 2 x 1000 parameters, none at or under the persistence threshold
    config = {"zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0}}
    if mixed:
        config[dtype] = {"enabled": True}
    cfg = Config.from_any(config)
    with torch.device("meta"):
        model = torch.nn.Sequential(torch.nn.Linear(100, 10, bias=False), torch.nn.Linear(10, 100, bias=False))
    for world in (1, 2, 4):
        assert model_state_bytes(model, cfg, world) == (round(2000 * TABLE[stage, mixed](world)), 2000)


def test_persistent_frozen_and_optimizer_state():
    with torch.device("meta"):
        model = torch.nn.Sequential(torch.nn.Linear(100, 10, bias=True), torch.nn.Linear(10, 100, bias=False))
    # stage 3: the 10-element bias stays whole (under the default threshold), in bf16; so does everything
    assert model_state_bytes(model, Config.from_any({"zero_optimization": {"stage": 3}, "bf16": {"enabled": True}}),
                             4)[0] == 2010 * 4 + 2010 * 2
    assert model_state_bytes(model, Config.from_any({"zero_optimization": {"stage": 3,
                             "stage3_param_persistence_threshold": 10}}), 4)[0] == 2010 * 4 + 10 * 4
    model[1].weight.requires_grad_(False)  # frozen: compute-dtype weights on every rank, nothing else
    assert model_state_bytes(model, Config.from_any({"zero_optimization": {"stage": 2}}), 2)[0] == 1010 * 12 + 1000 * 4
    sgd = {"zero_optimization": {"stage": 0}, "optimizer": {"type": "SGD", "params": {"lr": 0.1}}}
    assert model_state_bytes(model, Config.from_any(sgd), 2)[0] == 1010 * 8 + 1000 * 4  # no moments
    sgd["optimizer"]["params"]["momentum"] = 0.9
    assert model_state_bytes(model, Config.from_any(sgd), 2)[0] == 1010 * 12 + 1000 * 4


def test_tensor_and_expert_parallel_divide_the_parameters():
    from rayzero.moe.layer import MoEExperts

    with torch.device("meta"):
        model = torch.nn.ModuleDict({"dense": torch.nn.Linear(64, 64, bias=False),
                                     "experts": MoEExperts(num_experts=4, hidden_size=8, ffn_hidden_size=16)})
    dense, experts = 64 * 64, 4 * 3 * 16 * 8
    cfg = Config.from_any({"zero_optimization": {"stage": 2}, "expert_parallel": {"enabled": True, "autoep_size": 2}})
    # world 4: dense over dp 4; the experts this rank holds (1/ep) over edp 2
    assert model_state_bytes(model, cfg, 4) == (round(dense * (4 + 16 / 4) + experts / 2 * (4 + 16 / 2)),
                                                 dense + experts)
    cfg = Config.from_any({"zero_optimization": {"stage": 2}, "tensor_parallel": {"autotp_size": 2}})
    assert model_state_bytes(model, cfg, 4)[0] == round((dense + experts) / 2 * (4 + 16 / 2))  # dp 2


def _nodes(*gib):
    return [{"hostname": f"n{i}", "memory_total": int(g * GIB), "devices": 1} for i, g in enumerate(gib)]


def _huge():
    """2**32 + 2**16 parameters: 64 GiB of fp32 model state at stage 0.  Built on meta only by the check."""
    return torch.nn.Linear(2**16, 2**16)


def test_a_factory_whose_states_cannot_fit_is_refused_before_launch():
    built = []

    def factory():
        built.append(_huge())
        return built[-1]

    cfg = Config.from_any({"zero_optimization": {"stage": 0}})
    with pytest.raises(rayzero.ConfigError) as e:
        _check_fits(factory, cfg, ClusterConfig.from_any({"workers": 2}), _nodes(8, 8))
    msg = str(e.value)
    assert built and built[0].weight.device.type == "meta"  # counted without allocating 16 GiB of weights
    assert msg.startswith("the plan cannot fit: 4,295,032,832 parameters at ZeRO stage 0 with float32 compute on 2")
    assert "need 64.0 GiB of model state per worker" in msg and "16.00 bytes per parameter" in msg
    assert "the nodes' usable memory is [8.0, 8.0] GiB" in msg
    # ZeRO-3 over 64 workers: 1 GiB each, fits 8 nodes of 9 GiB
    _check_fits(factory, Config.from_any({"zero_optimization": {"stage": 3}}), ClusterConfig.from_any({"workers": 64}),
                _nodes(*[9] * 8))
    # a factory that cannot be built on meta (it copies the weights to the CPU) is left to the workers
    _check_fits(lambda: _huge().to("cpu"), cfg, ClusterConfig.from_any({"workers": 1}), _nodes(8))


def test_stage_1_counts_the_fp32_gradient_partition():
    with torch.device("meta"):
        model = torch.nn.Linear(2**15, 2**15, bias=False)  # 2**30 parameters
    cfg = Config.from_any({"zero_optimization": {"stage": 1}})
    # 4 workers: 8 + 16/4 = 12 bytes per parameter = 12 GiB (stage 1 without the gradient partition: 11 GiB)
    with pytest.raises(rayzero.ConfigError, match=r"need 12\.0 GiB of model state per worker"):
        _check_fits(model, cfg, ClusterConfig.from_any({"workers": 4}), _nodes(*[11.5] * 4))
    _check_fits(model, cfg, ClusterConfig.from_any({"workers": 4}), _nodes(*[12.5] * 4))
