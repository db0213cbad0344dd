"""AutoEP: expert parallelism for transformers MoE models (rayzero.moe.auto_ep, rayzero.moe.experts).

Every model is built from its config class with random weights (no download), tiny and seeded.  The
distributed cases run on real gloo process groups and compare against the unsharded model run in one
process: EP ranks see different batches, so an expert's gradient on its owner must be the sum of both
batches' gradients, while dense gradients are each rank's own.
"""

from __future__ import annotations

import copy
import pickle

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from distributed import run_distributed
from rayzero.config import ConfigError
from rayzero.moe.auto_ep import apply_auto_ep
from rayzero.moe.experts import ExpertParallelExperts
from rayzero.parallel.slicing import SplitSpec, splits_of, take_slice

VOCAB, HIDDEN, EXPERTS, INTER, BATCH, SEQ = 96, 32, 4, 16, 2, 8
TOL = 1e-5

_COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=HIDDEN,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
    initializer_range=0.2,  # large enough that a wrong expert or a missing gradient term shows far above TOL
    bos_token_id=0,
    eos_token_id=1,
    pad_token_id=None,
)
# family -> (config class, causal-LM class, config kwargs, whether the HF loss adds a router aux loss)
_FAMILIES = {
    "mixtral": (
        "MixtralConfig",
        "MixtralForCausalLM",
        dict(intermediate_size=INTER, num_local_experts=EXPERTS, num_experts_per_tok=2, router_aux_loss_coef=0.1),
        True,
    ),
    "qwen3_moe": (
        "Qwen3MoeConfig",
        "Qwen3MoeForCausalLM",
        dict(
            intermediate_size=48, moe_intermediate_size=INTER, num_experts=EXPERTS, num_experts_per_tok=2,
            head_dim=8, decoder_sparse_step=1, norm_topk_prob=True, router_aux_loss_coef=0.1,
        ),
        True,
    ),
    "qwen2_moe": (  # shared expert with a sigmoid gate
        "Qwen2MoeConfig",
        "Qwen2MoeForCausalLM",
        dict(
            intermediate_size=48, moe_intermediate_size=INTER, shared_expert_intermediate_size=24,
            num_experts=EXPERTS, num_experts_per_tok=2, decoder_sparse_step=1, router_aux_loss_coef=0.1,
        ),
        True,
    ),
    "olmoe": (
        "OlmoeConfig",
        "OlmoeForCausalLM",
        dict(intermediate_size=INTER, num_experts=EXPERTS, num_experts_per_tok=2, router_aux_loss_coef=0.1),
        True,
    ),
    "deepseek_v3": (  # shared experts, sigmoid group routing, first layer dense; no aux loss in transformers
        "DeepseekV3Config",
        "DeepseekV3ForCausalLM",
        dict(
            intermediate_size=48, moe_intermediate_size=INTER, n_routed_experts=EXPERTS, num_experts_per_tok=2,
            n_group=1, topk_group=1, n_shared_experts=1, first_k_dense_replace=1, q_lora_rank=None,
            kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8, num_key_value_heads=4,
        ),
        False,
    ),
}


def build_model(family: str, seed: int = 0):
    import transformers

    config_cls, model_cls, kwargs, _ = _FAMILIES[family]
    config = getattr(transformers, config_cls)(**{**_COMMON, **kwargs})
    torch.manual_seed(seed)
    return getattr(transformers, model_cls)(config).eval()  # eval: no router jitter


def make_batch(rank: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 + rank)
    return torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)


def run_model(model, ids: torch.Tensor, aux: bool) -> dict:
    model.zero_grad(set_to_none=True)
    kwargs = {"output_router_logits": True} if aux else {}
    out = model(input_ids=ids, labels=ids, **kwargs)
    out.loss.backward()
    grads = {
        n: (p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p)) for n, p in model.named_parameters()
    }
    aux_loss = getattr(out, "aux_loss", None)
    return {
        "logits": out.logits.detach(),
        "loss": out.loss.detach(),
        "aux_loss": aux_loss.detach() if aux_loss is not None else None,
        "grads": grads,
    }


def _max_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """Largest error, relative to the reference's scale where that exceeds 1."""
    return float((a - b).abs().max() / max(1.0, float(b.abs().max())))


# ----------------------------------------------------------------------------------------------- EP=2 models
def _ep_models_case(rank: int, world: int, families: list[str]) -> dict:
    group = dist.group.WORLD
    spec = SplitSpec("ep", 0, world, rank)
    report = {"group_errors": []}
    # the group passed must be the EP group this rank's ep_rank indexes: refused before the model changes
    model = build_model("mixtral")
    for size, ep_rank in ((4, rank), (world, 1 - rank)):
        try:
            apply_auto_ep(model, group, size, ep_rank)
        except ConfigError as e:
            report["group_errors"].append(str(e))
    report["untouched"] = not any(getattr(p, "_rayzero_expert", False) for p in model.parameters())
    for family in families:
        aux = _FAMILIES[family][3]
        reference = build_model(family)
        model = copy.deepcopy(reference)
        names = apply_auto_ep(model, group, world, rank, preset_model=family)
        refs = [run_model(reference, make_batch(r), aux) for r in range(world)]
        mine = run_model(model, make_batch(rank), aux)
        ref = refs[rank]

        r = {"names": names, "aux": mine["aux_loss"] is not None}
        r["logits"] = _max_err(mine["logits"], ref["logits"])
        r["loss"] = _max_err(mine["loss"], ref["loss"])
        r["aux_loss"] = _max_err(mine["aux_loss"], ref["aux_loss"]) if aux else 0.0
        expert_err = dense_err = 0.0
        expert_names, bad_splits, idle_experts = [], [], []
        for name, p in model.named_parameters():
            grad = mine["grads"][name]
            if getattr(p, "_rayzero_expert", False):
                expert_names.append(name)
                if splits_of(p) != (spec,):
                    bad_splits.append(name)
                expected = take_slice(sum(rf["grads"][name] for rf in refs), spec)
                expert_err = max(expert_err, _max_err(grad, expected))
                # every local expert got tokens (some from the other rank): the exchange really ran
                idle_experts += [f"{name}[{j}]" for j in range(p.shape[0]) if not grad[j].abs().sum() > 0]
            else:
                dense_err = max(dense_err, _max_err(grad, ref["grads"][name]))
        r.update(
            expert_grads=expert_err,
            dense_grads=dense_err,
            expert_params=expert_names,
            bad_splits=bad_splits,
            idle=idle_experts,
            replaced=[type(model.get_submodule(n)).__name__ for n in names],
        )
        report[family] = r

    # activation checkpointing recomputes the dispatch (and its exchanges) inside backward, on every rank
    reference = build_model("qwen3_moe").train()
    model = copy.deepcopy(reference)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    apply_auto_ep(model, group, world, rank)
    refs = [run_model(reference, make_batch(r), True) for r in range(world)]
    mine = run_model(model, make_batch(rank), True)
    err = _max_err(mine["loss"], refs[rank]["loss"])
    for name, p in model.named_parameters():
        if getattr(p, "_rayzero_expert", False):
            expected = take_slice(sum(rf["grads"][name] for rf in refs), spec)
        else:
            expected = refs[rank]["grads"][name]
        err = max(err, _max_err(mine["grads"][name], expected))
    report["checkpointing"] = err
    return report


def test_auto_ep_hf_models_ep2_match_single_process():
    families = list(_FAMILIES)
    reports = run_distributed(_ep_models_case, 2, families)
    for rank, report in enumerate(reports):
        size_error, rank_error = report["group_errors"]
        assert "autoep_size=4 but the ep process group passed has 2 ranks" in size_error, size_error
        assert f"ep_rank={1 - rank} but this process is rank {rank} of the ep group" in rank_error, rank_error
        assert report["untouched"]
        err = report["checkpointing"]
        assert err <= TOL, f"rank {rank}: with activation checkpointing, differs by {err:.3g}"
        for family in families:
            r = report[family]
            moe_layers = [1] if family == "deepseek_v3" else [0, 1]
            assert r["names"] == [f"model.layers.{i}.mlp.experts" for i in moe_layers], (family, r["names"])
            assert set(r["replaced"]) == {"ExpertParallelExperts"}, (family, r["replaced"])
            assert sorted(r["expert_params"]) == sorted(
                f"{n}.{w}" for n in r["names"] for w in ("gate_up_proj", "down_proj")
            ), (family, r["expert_params"])
            assert not r["bad_splits"], (family, rank, r["bad_splits"])
            assert not r["idle"], (family, rank, r["idle"])
            assert r["aux"] == _FAMILIES[family][3], family
            for key in ("logits", "loss", "aux_loss", "expert_grads", "dense_grads"):
                assert r[key] <= TOL, f"{family} rank {rank}: {key} differs by {r[key]:.3g}"


# ----------------------------------------------------------------------------------------------- EP=1
def test_auto_ep_size_one_keeps_model_and_marks_experts():
    for family in ("mixtral", "qwen2_moe"):
        reference = build_model(family)
        model = copy.deepcopy(reference)
        names = apply_auto_ep(model, None, 1, 0)
        assert names == ["model.layers.0.mlp.experts", "model.layers.1.mlp.experts"]
        for n in names:  # nothing to route with one EP rank: the transformers module (and its kernels) stays
            assert not isinstance(model.get_submodule(n), ExpertParallelExperts)
        marked = sorted(n for n, p in model.named_parameters() if getattr(p, "_rayzero_expert", False))
        assert marked == sorted(f"{n}.{w}" for n in names for w in ("gate_up_proj", "down_proj"))
        assert all(not splits_of(p) for p in model.parameters())
        ids = make_batch(0)
        ref, mine = run_model(reference, ids, True), run_model(model, ids, True)
        assert torch.equal(ref["logits"], mine["logits"]) and torch.equal(ref["loss"], mine["loss"])
        assert all(torch.equal(ref["grads"][n], mine["grads"][n]) for n in ref["grads"])


# ----------------------------------------------------------------------------------------------- experts math
def _experts_module(kind: str, seed: int = 0) -> nn.Module:
    """A standalone transformers experts module with O(1) random weights: Mixtral's (E, 2I, H) / (E, H, I)
    layout, or GPT-OSS's (transposed, interleaved gate/up, biases, its own clamped gate)."""
    if kind == "mixtral":
        from transformers import MixtralConfig
        from transformers.models.mixtral.modeling_mixtral import MixtralExperts as cls

        config = MixtralConfig(hidden_size=HIDDEN, intermediate_size=INTER, num_local_experts=EXPERTS)
    else:
        from transformers import GptOssConfig
        from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts as cls

        config = GptOssConfig(hidden_size=HIDDEN, intermediate_size=INTER, num_local_experts=EXPERTS)
    config._experts_implementation = "eager"
    torch.manual_seed(seed)
    module = cls(config)
    with torch.no_grad():
        for p in module.parameters():
            p.normal_(0.0, 0.3)
    return module


def _routing(seed: int, tokens: int = 12, sentinel: bool = False):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, HIDDEN, generator=g)
    index = torch.rand(tokens, EXPERTS, generator=g).topk(2, dim=-1).indices
    if sentinel:  # transformers' "no expert" id (== num_experts) contributes nothing
        index[0, 1] = EXPERTS
        index[3, 0] = EXPERTS
    weights = torch.rand(tokens, 2, generator=g)
    probe = torch.randn(tokens, HIDDEN, generator=g)
    return x, index, weights, probe


def _run_experts(module, x, index, weights, probe) -> dict:
    module.zero_grad(set_to_none=True)
    x, weights = x.clone().requires_grad_(), weights.clone().requires_grad_()
    out = module(x, index, weights)
    (out * probe).sum().backward()
    return {
        "out": out.detach(),
        "x": x.grad,
        "weights": weights.grad,
        "params": {n: p.grad.clone() for n, p in module.named_parameters()},
    }


def test_expert_parallel_experts_single_rank_matches_transformers():
    for kind, sentinel in (("mixtral", True), ("gpt_oss", False)):
        hf = _experts_module(kind)
        ours = ExpertParallelExperts(copy.deepcopy(hf))
        assert [n for n, _ in ours.named_parameters()] == [n for n, _ in hf.named_parameters()]
        assert ours.num_experts == EXPERTS and all(p._rayzero_expert for p in ours.parameters())
        batch = _routing(7, sentinel=sentinel)
        ref, mine = _run_experts(hf, *batch), _run_experts(ours, *batch)
        for key in ("out", "x", "weights"):
            assert _max_err(mine[key], ref[key]) <= TOL, (kind, key)
        for n, g in ref["params"].items():
            assert _max_err(mine["params"][n], g) <= TOL, (kind, n)
        # without process groups the module pickles (e.g. to move a model between processes)
        again = pickle.loads(pickle.dumps(ours))
        assert torch.equal(again(*batch[:3]), ours(*batch[:3]))


def _ep_tp_case(rank: int, world: int) -> dict:
    # TP groups {0,1}, {2,3}; EP groups {0,2}, {1,3}.  Both ranks of a TP group see the same batch.
    tp_groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    ep_groups = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    ep_rank, tp_rank = rank // 2, rank % 2
    report = {}
    for kind, sentinel in (("mixtral", True), ("gpt_oss", False)):
        hf = _experts_module(kind)
        batches = [_routing(100 + d, sentinel=sentinel) for d in range(2)]
        refs = [_run_experts(hf, *b) for b in batches]
        ours = ExpertParallelExperts(
            copy.deepcopy(hf), ep_groups[tp_rank], 2, ep_rank, tp_groups[ep_rank], 2, tp_rank, name=kind
        )
        mine = _run_experts(ours, *batches[ep_rank])
        ref = refs[ep_rank]
        r = {key: _max_err(mine[key], ref[key]) for key in ("out", "x", "weights")}
        with torch.no_grad():  # a deep copy shares the process groups and computes the same
            x, index, weights, _ = batches[ep_rank]
            r["copy"] = torch.equal(copy.deepcopy(ours)(x, index, weights), mine["out"])
        r["params"], r["splits"], r["tp_marks"] = 0.0, {}, {}
        for n, p in ours.named_parameters():
            expected = sum(rf["params"][n] for rf in refs)
            for spec in splits_of(p):
                expected = take_slice(expected, spec)
            r["params"] = max(r["params"], _max_err(mine["params"][n], expected))
            r["splits"][n] = splits_of(p)
            r["tp_marks"][n] = getattr(p, "_rayzero_tp", None)
        report[kind] = r
    return report


def test_expert_parallel_experts_ep2_tp2():
    reports = run_distributed(_ep_tp_case, 4)
    for rank, report in enumerate(reports):
        ep, tp = SplitSpec("ep", 0, 2, rank // 2), rank % 2
        expected_splits = {
            "mixtral": {
                "gate_up_proj": (ep, SplitSpec("tp", 1, 2, tp, packed=2)),
                "down_proj": (ep, SplitSpec("tp", 2, 2, tp)),
            },
            "gpt_oss": {  # transposed (E, H, 2I) / (E, I, H); interleaved gate/up pairs cut contiguously
                "gate_up_proj": (ep, SplitSpec("tp", 2, 2, tp)),
                "gate_up_proj_bias": (ep, SplitSpec("tp", 1, 2, tp)),
                "down_proj": (ep, SplitSpec("tp", 1, 2, tp)),
                "down_proj_bias": (ep,),  # whole over TP, added once
            },
        }
        for kind, r in report.items():
            assert r["splits"] == expected_splits[kind], (kind, rank, r["splits"])
            assert r["copy"], (kind, rank)
            assert r["tp_marks"] == {n: ("shard" if len(s) == 2 else None) for n, s in r["splits"].items()}
            for key in ("out", "x", "weights", "params"):
                assert r[key] <= TOL, f"{kind} rank {rank}: {key} differs by {r[key]:.3g}"


# ----------------------------------------------------------------------------------------------- rayzero layers
class _OwnMoE(nn.Module):
    """Stands in for rayzero's MoE layer: shards itself through shard_experts."""

    def __init__(self):
        super().__init__()
        self.num_experts = EXPERTS
        self.calls = []
        # looks like a transformers experts module, but belongs to the layer: AutoEP must leave it alone
        self.inner = nn.Module()
        self.inner.gate_up_proj = nn.Parameter(torch.zeros(EXPERTS, 2 * INTER, HIDDEN))
        self.inner.down_proj = nn.Parameter(torch.zeros(EXPERTS, HIDDEN, INTER))

    def shard_experts(self, ep_group, ep_size, ep_rank, tp_group=None, tp_size=1, tp_rank=0):
        self.calls.append((ep_group, ep_size, ep_rank, tp_group, tp_size, tp_rank))


def test_modules_with_shard_experts_shard_themselves():
    model = nn.Sequential(nn.Linear(HIDDEN, HIDDEN), _OwnMoE())
    assert apply_auto_ep(model, None, 1, 0) == ["1"]
    assert model[1].calls == [(None, 1, 0, None, 1, 0)]
    assert not any(getattr(p, "_rayzero_expert", False) for p in model.parameters())  # the layer marks its own
    with pytest.raises(ConfigError, match=r"autoep_size=3 does not divide the 4 experts of 1.*1, 2, 4"):
        apply_auto_ep(model, None, 3, 0)


# ----------------------------------------------------------------------------------------------- errors
def test_errors_name_the_problem_and_the_fix():
    import transformers

    dense = transformers.Qwen3ForCausalLM(
        transformers.Qwen3Config(**{**_COMMON, "intermediate_size": 48, "head_dim": 8})
    )
    with pytest.raises(ConfigError, match=r"Qwen3ForCausalLM \(model_type 'qwen3'\) has no MoE block") as e:
        apply_auto_ep(dense, None, 2, 0)
    assert "gate_up_proj" in str(e.value) and "shard_experts" in str(e.value) and "expert_parallel" in str(e.value)
    with pytest.raises(ConfigError, match=r"Linear has no MoE block"):
        apply_auto_ep(nn.Linear(4, 4), None, 1, 0)

    model = build_model("mixtral")
    before = copy.deepcopy(model.state_dict())
    with pytest.raises(ConfigError, match=r"autoep_size=3 does not divide the 4 experts of "
                       r"model\.layers\.0\.mlp\.experts; choose .* divides 4 \(1, 2, 4\)"):
        apply_auto_ep(model, None, 3, 0)
    with pytest.raises(ConfigError, match=r"autotp_size=3 does not divide the expert intermediate size 16 .*"
                       r"\(1, 2, 4, 8, 16\)"):
        apply_auto_ep(model, None, 1, 0, tp_size=3)
    with pytest.raises(ConfigError, match=r"preset_model='qwen3_moe' does not match the model: MixtralForCausalLM "
                       r"has model_type 'mixtral'; set preset_model to 'mixtral' or remove it"):
        apply_auto_ep(model, None, 1, 0, preset_model="qwen3_moe")
    with pytest.raises(ConfigError, match=r"preset_model='llama' is not a preset .*mixtral, qwen3_moe"):
        apply_auto_ep(model, None, 1, 0, preset_model="llama")
    with pytest.raises(ConfigError, match=r"ep_rank=2 is outside \[0, 2\)"):
        apply_auto_ep(model, None, 2, 2)
    # a failed call leaves the model untouched
    assert all(type(model.get_submodule(f"model.layers.{i}.mlp.experts")).__name__ == "MixtralExperts" for i in (0, 1))
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())
    assert not any(getattr(p, "_rayzero_expert", False) for p in model.parameters())

    # without torch.distributed a rank's share can be cut (to inspect or convert it), but not run
    sliced = copy.deepcopy(model)
    apply_auto_ep(sliced, None, 2, 1, tp_size=2, tp_rank=0)
    gate_up = sliced.get_submodule("model.layers.0.mlp.experts").gate_up_proj
    assert gate_up.shape == (2, INTER, HIDDEN) and gate_up._rayzero_tp == "shard"
    full = model.get_submodule("model.layers.0.mlp.experts").gate_up_proj.detach()
    assert torch.equal(gate_up.detach(), torch.cat([full[2:, :8], full[2:, 16:24]], dim=1))
    with pytest.raises(RuntimeError, match=r"ep=2 x tp=2 .*torch.distributed, which is not initialized"):
        sliced(input_ids=make_batch(0))

    # stacked expert tensors outside transformers' experts interface: AutoEP cannot know the math
    custom = nn.Module()
    custom.gate_up_proj = nn.Parameter(torch.zeros(EXPERTS, 2 * INTER, HIDDEN))
    custom.down_proj = nn.Parameter(torch.zeros(EXPERTS, HIDDEN, INTER))
    with pytest.raises(ConfigError, match=r"is not a transformers experts module"):
        ExpertParallelExperts(custom, ep_size=2, ep_rank=0)
    # applied twice
    wrapped = nn.Sequential(ExpertParallelExperts(_experts_module("mixtral")))
    with pytest.raises(ConfigError, match=r"already expert-parallel"):
        apply_auto_ep(wrapped, None, 1, 0)
