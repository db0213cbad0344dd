"""Expert and tensor parallelism through the engine, against one process training on every shard.

Every case trains with plain SGD and a clip threshold that clips every step, so a wrong gradient scale
or a wrong global norm changes the weights; the weights must match the single-process reference to 1e-5.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn as nn

from distributed import run_distributed
from moe_cases import assert_matches, batches, engine_config, train_engine, train_reference

pytest.importorskip("transformers")


# ---- the global norm counts each expert once -------------------------------------------------------------
class TwoExperts(nn.Module):
    """Two experts of 5 weights each, spread over an EP group by ``shard_experts`` (the protocol AutoEP
    calls on user layers); the loss is linear, so each expert's gradient is exactly its coefficients."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.zeros(2, 5))
        self.w._rayzero_expert = True
        self.dense = nn.Parameter(torch.zeros(3))
        self.ep_rank, self.ep_size = 0, 1

    def shard_experts(self, ep_group, ep_size, ep_rank, tp_group=None, tp_size=1, tp_rank=0):
        from rayzero.parallel.slicing import SplitSpec, mark_split, take_slice

        spec = SplitSpec("ep", 0, ep_size, ep_rank)
        local = nn.Parameter(take_slice(self.w.data, spec))
        local._rayzero_expert = True
        mark_split(local, spec)
        self.w = local
        self.ep_rank, self.ep_size = ep_rank, ep_size

    def forward(self, coeff: torch.Tensor) -> torch.Tensor:
        n = 2 // self.ep_size
        return (self.w * coeff[self.ep_rank * n : (self.ep_rank + 1) * n]).sum() + self.dense.sum() * 0.0


def _norm_case(rank, world):
    import rayzero

    # Gradients are coefficient / dp: expert 0 gets [2, 4, 0, 0, 0] (squares sum to 20), expert 1 gets
    # [10, 0, 0, 0, 0] (100).  The true norm is sqrt(120) = 10.954; averaging the two EP ranks' own norms,
    # the bug this guards against, gives (sqrt(20) + sqrt(100)) / 2 = 7.236.
    coeff = torch.tensor([[4.0, 8.0, 0, 0, 0], [20.0, 0, 0, 0, 0]])
    norms = {}
    for stage in (0, 1, 2, 3):
        engine = rayzero.initialize(TwoExperts(), {
            "train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "SGD", "params": {"lr": 0.0}},
            "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
            "expert_parallel": {"enabled": True, "autoep_size": 2}, "steps_per_print": 0,
        })
        engine.backward(engine(coeff))
        engine.step()
        norms[stage] = engine.global_grad_norm
        engine.destroy()
    return norms


def test_global_norm_counts_each_expert_once():
    for norms in run_distributed(_norm_case, 2):
        for stage, norm in norms.items():
            assert math.isclose(norm, math.sqrt(120), rel_tol=1e-6), (stage, norm)
            assert not math.isclose(norm, 7.236, rel_tol=1e-3)


# ---- AutoTP on a dense HF model ------------------------------------------------------------------------
def _stages(rank, world, model, stages, steps, data, **kw):
    return {s: train_engine(rank, world, model, engine_config(s, **kw), steps, data) for s in stages}


def test_autotp2_dense_qwen3_matches_single_process():
    steps = 3
    data = batches(steps, shards=1, micro=2)
    ref = train_reference("qwen3", steps, data)
    results = run_distributed(_stages, 2, "qwen3", (0, 1, 3), steps, data, tp=2)
    for stage, res in results[0].items():
        assert res["dp"] == 1 and res["topology"].tp == 2
        assert_matches(res, ref)


# ---- AutoEP on HF MoE models ---------------------------------------------------------------------------
def test_ep2_qwen3_moe_zero123_matches_single_process():
    steps = 3
    data = batches(steps, shards=2, micro=2)
    ref = train_reference("qwen3_moe", steps, data)
    results = run_distributed(_stages, 2, "qwen3_moe", (1, 2, 3), steps, data, ep=2)
    for stage, res in results[0].items():
        assert res["dp"] == 2 and res["topology"].ep == 2 and res["topology"].edp == 1
        assert_matches(res, ref)


def test_ep2_rayzero_moe_layers_match_single_process():
    steps = 3
    data = batches(steps, shards=2, micro=2)
    ref = train_reference("rayzero_moe", steps, data)
    results = run_distributed(_stages, 2, "rayzero_moe", (2, 3), steps, data, ep=2)
    for stage, res in results[0].items():
        assert_matches(res, ref)


def test_ep2_mixtral_stage0_accumulation_matches_single_process():
    steps = 2
    data = batches(steps, shards=2, micro=1, gas=2)
    ref = train_reference("mixtral", steps, data)
    results = run_distributed(_stages, 2, "mixtral", (0,), steps, data, ep=2, micro=1, gas=2)
    assert_matches(results[0][0], ref)


def test_ep2_edp2_on_4_ranks_matches_single_process():
    steps = 2
    data = batches(steps, shards=4, micro=1)
    ref = train_reference("qwen3_moe", steps, data)
    results = run_distributed(_stages, 4, "qwen3_moe", (2,), steps, data, ep=2, micro=1)
    res = results[0][2]
    assert res["dp"] == 4 and res["topology"].edp == 2
    assert [r[2]["dp_rank"] for r in results] == [0, 1, 2, 3]
    assert_matches(res, ref)


def test_ep2_tp2_on_4_ranks_matches_single_process():
    steps = 2
    data = batches(steps, shards=2, micro=1)
    ref = train_reference("qwen3_moe", steps, data)
    results = run_distributed(_stages, 4, "qwen3_moe", (1, 3), steps, data, ep=2, tp=2, micro=1)
    # TP innermost: ranks 0 and 1 form a TP group and feed the same shard
    assert [r[1]["dp_rank"] for r in results] == [0, 0, 1, 1]
    for stage, res in results[0].items():
        assert res["topology"].tp == 2 and res["topology"].ep == 2 and res["dp"] == 2
        assert_matches(res, ref)


def _half_case(rank, world, steps, data):
    runs = {"fp32": {}, "bf16": {"bf16": {"enabled": True}}, "fp16": {"fp16": {"enabled": True, "initial_scale_power": 8}}}
    return {k: train_engine(rank, world, "qwen3_moe", engine_config(2, ep=2, **extra), steps, data)
            for k, extra in runs.items()}


def test_ep2_bf16_and_fp16_track_fp32():
    steps = 3
    data = batches(steps, shards=2, micro=2)
    runs = run_distributed(_half_case, 2, steps, data)[0]
    fp32 = runs["fp32"]
    for kind in ("bf16", "fp16"):
        for a, b in zip(fp32["losses"], runs[kind]["losses"]):
            assert abs(a - b) <= 0.02 * abs(a), kind
        for name, w in fp32["weights"].items():
            rel = (runs[kind]["weights"][name].float() - w).norm() / max(w.norm(), 1e-6)
            assert rel < 0.02, (kind, name, float(rel))


# ---- bad layouts ---------------------------------------------------------------------------------------
def _bad_layout(rank, world, cfg):
    import rayzero
    from moe_cases import tiny_qwen3_moe

    try:
        rayzero.initialize(tiny_qwen3_moe(experts=4), cfg)
    except Exception as e:  # noqa: BLE001 - the message is what is checked
        return f"{type(e).__name__}: {e}"
    return "no error"


def test_layouts_that_do_not_fit_are_clear_errors():
    ep3 = engine_config(1, ep=3, micro=1)
    msg = run_distributed(_bad_layout, 2, ep3)[0]
    assert "ConfigError" in msg and "autoep_size=3" in msg and "ep=3 does not divide dp=2" in msg
    tp4 = engine_config(1, tp=4, micro=1)
    msg = run_distributed(_bad_layout, 2, tp4)[0]
    assert "ConfigError" in msg and "autotp_size=4" in msg


# ---- universal checkpoints across EP and TP degrees ----------------------------------------------------
def test_checkpoint_saved_at_ep2_tp2_resumes_at_ep1_world1_and_ep4(tmp_path):
    """Save at EP=2 x TP=2 (4 ranks, ZeRO-1), resume at world 1 and at EP=4 (4 ranks, ZeRO-3): the
    remaining steps match the uninterrupted run.  The same global batch is cut into 2, 1 and 4 shards."""
    steps, save_after = 4, 2
    data = batches(steps, shards=2, micro=2)  # global batch: 2 shards x 2 samples
    ckpt = str(tmp_path / "ckpt")
    full = run_distributed(train_engine, 4, "qwen3_moe_noaux", engine_config(1, ep=2, tp=2), steps, data,
                           save_to=ckpt, save_after=save_after)[0]
    one = data[:, 0][:, :, None]  # world 1: each former shard becomes a micro-step
    world1 = run_distributed(train_engine, 1, "qwen3_moe_noaux", engine_config(2, gas=2), steps, one,
                             load_from=ckpt)[0]
    four = data.reshape(steps, 1, 4, 1, data.shape[-1])  # EP=4: one sample per rank
    ep4 = run_distributed(train_engine, 4, "qwen3_moe_noaux", engine_config(3, ep=4, micro=1), steps, four,
                          load_from=ckpt)[0]
    for resumed in (world1, ep4):
        assert len(resumed["norms"]) == steps - save_after
        resumed_ref = {"norms": full["norms"][save_after:], "weights": full["weights"]}
        assert_matches(resumed, resumed_ref)


def _export_case(rank, world, ckpt, out):
    from moe_cases import tiny_qwen3_moe

    from rayzero.checkpoint.tools import export

    if rank == 0:
        export(ckpt, out)
        model = tiny_qwen3_moe(seed=5, aux_loss=False)  # other weights: everything must come from the file
        from safetensors.torch import load_file

        model.load_state_dict(load_file(out), strict=True)
        return {k: v.clone() for k, v in model.state_dict().items()}
    return None


def test_export_of_an_ep2_tp2_checkpoint_loads_into_the_hf_model(tmp_path):
    steps = 2
    data = batches(steps, shards=2, micro=1)
    ckpt = str(tmp_path / "ckpt")
    res = run_distributed(train_engine, 4, "qwen3_moe_noaux", engine_config(2, ep=2, tp=2, micro=1), steps + 1,
                          data.repeat(2, 1, 1, 1, 1)[: steps + 1], save_to=ckpt, save_after=steps)[0]
    # full_state_dict gives the HF names and full shapes
    from moe_cases import tiny_qwen3_moe

    hf = tiny_qwen3_moe(aux_loss=False).state_dict()
    assert {k: tuple(v.shape) for k, v in res["weights"].items()} == {k: tuple(v.shape) for k, v in hf.items()}
    loaded = run_distributed(_export_case, 1, ckpt, str(tmp_path / "model.safetensors"))[0]
    resumed = run_distributed(train_engine, 1, "qwen3_moe_noaux", engine_config(0, micro=1), steps, data,
                              load_from=ckpt)[0]
    for name, w in resumed["weights"].items():  # the checkpoint's weights, consolidated by a world-1 engine
        assert torch.equal(loaded[name], w), name


def _zero_init_case(rank, world, steps, data):
    import moe_cases
    import rayzero

    real = moe_cases.MODELS["qwen3_moe"]

    def under_zero_init(seed=0):
        with rayzero.zero_init(seed=seed):
            return real(seed)

    moe_cases.MODELS["qwen3_moe_zero_init"] = under_zero_init
    return train_engine(rank, world, "qwen3_moe_zero_init", engine_config(3, ep=2), steps, data)


def test_ep2_with_zero_init_stage3_matches_single_process():
    steps = 2
    data = batches(steps, shards=2, micro=2)
    ref = train_reference("qwen3_moe", steps, data)
    assert_matches(run_distributed(_zero_init_case, 2, steps, data)[0], ref)


def _deterministic_twice(rank, world, steps, data):
    cfg = engine_config(2, ep=2, deterministic=True)
    return [train_engine(rank, world, "qwen3_moe", cfg, steps, data) for _ in range(2)]


def test_ep2_deterministic_policy_repeats_bitwise():
    steps = 3
    data = batches(steps, shards=2, micro=2)
    first, second = run_distributed(_deterministic_twice, 2, steps, data)[0]
    assert first["losses"] == second["losses"] and first["norms"] == second["norms"]
    for name, w in first["weights"].items():
        assert torch.equal(w, second["weights"][name]), name


def test_frozen_experts_are_saved_whole_and_resume_at_another_degree(tmp_path):
    """Frozen expert slices are not partitioned: each slice is written once, at its place in the full
    tensor, and comes back whole in full_state_dict, in the export and at another EP degree."""
    from moe_cases import MODELS

    steps = 3
    data = batches(steps, shards=2, micro=1)
    ckpt = str(tmp_path / "ckpt")
    saved = run_distributed(train_engine, 2, "qwen3_moe_frozen_experts", engine_config(2, ep=2, micro=1), steps,
                            data, save_to=ckpt, save_after=2)[0]
    fresh = MODELS["qwen3_moe_frozen_experts"]().state_dict()
    experts = [n for n in fresh if ".experts." in n]
    assert experts
    for name in experts:  # frozen: unchanged, and whole
        assert torch.equal(saved["weights"][name], fresh[name]), name
    resumed = run_distributed(train_engine, 1, "qwen3_moe_frozen_experts", engine_config(1, micro=1, gas=2),
                              steps, data[:, 0][:, :, None], load_from=ckpt)[0]
    assert_matches(resumed, {"norms": saved["norms"][2:], "weights": saved["weights"]})
    loaded = run_distributed(_export_case, 1, ckpt, str(tmp_path / "model.safetensors"))[0]
    for name in experts:
        assert torch.equal(loaded[name], fresh[name]), name


def test_scheduler_lists_and_get_lr_follow_the_users_groups():
    """A user group holding dense parameters and experts is two optimizer groups inside; per-group
    scheduler lists and get_lr() still count the user's groups, all-frozen groups included."""
    import rayzero
    from moe_cases import TinyMoELM

    model = TinyMoELM()
    model.embed.requires_grad_(False)
    groups = [
        {"params": list(model.embed.parameters())},  # all frozen: dropped inside, still counted
        {"params": [p for n, p in model.named_parameters() if not n.startswith("embed")]},
    ]
    engine = rayzero.initialize(model, {
        "train_micro_batch_size_per_gpu": 1, "steps_per_print": 0,
        "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": [0.0, 0.0], "warmup_max_lr": [1e-4, 1e-3],
                                                     "warmup_num_steps": 2}},
    }, model_parameters=(g for g in groups))
    assert len(engine.optimizer.param_groups) == 2  # the trainable user group: dense and experts
    assert {g.user_group for g in engine.partitions.groups} == {1}
    ids = torch.randint(0, 64, (1, 8))
    for _ in range(3):  # as DeepSpeed: built at lr(-1), then lr(0), lr(1) = the end of a 2-step warmup
        engine.backward(engine(input_ids=ids, labels=ids).loss)
        engine.step()
    assert engine.get_lr() == [pytest.approx(1e-3)]
    assert [g["lr"] for g in engine.optimizer.param_groups] == [pytest.approx(1e-3)] * 2
    engine.destroy()


def _tp_without_ep(rank, world):
    import rayzero
    from moe_cases import TinyMoELM

    try:
        rayzero.initialize(TinyMoELM(), engine_config(1, tp=2, micro=1))
    except Exception as e:  # noqa: BLE001 - the message is what is checked
        return f"{type(e).__name__}: {e}"
    return "no error"


def test_tensor_parallel_that_would_cut_nothing_is_an_error():
    """Whole experts (no expert_parallel to cut them over TP) and no linear AutoTP knows: TP would only
    duplicate work, so it is refused instead of silently halving the data-parallel size."""
    msg = run_distributed(_tp_without_ep, 2)[0]
    assert msg.startswith("ConfigError") and "tp_plan" in msg, msg
