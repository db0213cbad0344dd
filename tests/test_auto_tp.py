"""AutoTP on real gloo process groups (TP=2) against the same model run whole in one process."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from distributed import run_distributed
from rayzero.config import ConfigError
from rayzero.parallel.slicing import splits_of, take_slice
from rayzero.tp import apply_auto_tp

ATOL = RTOL = 1e-5


def tiny_qwen3(seed: int = 0):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(
        hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        intermediate_size=128, vocab_size=128, attn_implementation="eager",
    )
    torch.manual_seed(seed)
    return Qwen3ForCausalLM(config)


# ---- plain torch models (no config, no plan: the name-pattern fallback)


class Attention(nn.Module):
    """Multi-head self-attention that reshapes with a stored head count (AutoTP must make it local)."""

    def __init__(self, dim: int = 32, heads: int = 4):
        super().__init__()
        self.num_heads, self.head_dim = heads, dim // heads
        self.q_proj, self.k_proj, self.v_proj = (nn.Linear(dim, dim) for _ in range(3))
        self.o_proj = nn.Linear(dim, dim)

    def forward(self, x):
        b, t, _ = x.shape
        q, k, v = (
            p(x).view(b, t, self.num_heads, self.head_dim).transpose(1, 2)
            for p in (self.q_proj, self.k_proj, self.v_proj)
        )
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(y.transpose(1, 2).reshape(b, t, self.num_heads * self.head_dim))


class PlainModel(nn.Module):
    def __init__(self, dim: int = 32, vocab: int = 50):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.attn = Attention(dim)
        self.mlp = nn.ModuleDict({"fc1": nn.Linear(dim, 4 * dim), "fc2": nn.Linear(4 * dim, dim)})
        self.w1, self.w3 = nn.Linear(dim, 2 * dim, bias=False), nn.Linear(dim, 2 * dim, bias=False)
        self.w2 = nn.Linear(2 * dim, dim, bias=False)
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab)

    def forward(self, ids, labels):
        h = self.embed(ids)
        h = h + self.attn(h)
        h = h + self.mlp["fc2"](F.gelu(self.mlp["fc1"](h)))
        h = h + self.w2(F.silu(self.w1(h)) * self.w3(h))
        logits = self.head(self.norm(h))
        return logits, F.cross_entropy(logits.flatten(0, 1), labels.flatten())


class HeadNormBlock(nn.Module):
    """Names the fallback does not know, a bare per-feature parameter, and a per-head norm (partial grad)."""

    def __init__(self, dim: int = 24, inner: int = 48, head: int = 8):
        super().__init__()
        self.head = head
        self.up, self.down = nn.Linear(dim, inner), nn.Linear(inner, dim)
        self.scale = nn.Parameter(torch.randn(inner))
        self.hnorm = nn.RMSNorm(head)

    def forward(self, x):
        h = self.up(x)
        h = self.hnorm(h.unflatten(-1, (-1, self.head))).flatten(-2)
        return x + self.down(F.gelu(h * self.scale))


class PlanModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([HeadNormBlock(), HeadNormBlock()])

    def forward(self, x, target):
        for b in self.blocks:
            x = b(x)
        return x, F.mse_loss(x, target)


PLAN = {
    "blocks.*.up": "colwise",
    "blocks.*.scale": "colwise",
    "blocks.*.hnorm": "replicated_with_grad_allreduce",
    "blocks.*.down": "rowwise",
}


# ---- the comparison, run on each rank


def compare_with_whole(model, run, tp_group, tp_size, tp_rank, plan=None) -> dict:
    """Run ``model`` whole, shard it, run it again; check outputs, loss and every gradient.

    ``run(m)`` returns (output, loss); every rank feeds the same input."""
    import torch.distributed as dist

    whole = copy.deepcopy(model)
    names = [n for n, _ in whole.named_parameters()]
    out_ref, loss_ref = run(whole)
    loss_ref.backward()

    sharded = apply_auto_tp(model, tp_group, tp_size, tp_rank, plan=plan)
    assert sharded, "nothing sharded"
    assert [n for n, _ in model.named_parameters()] == names, "parameter names changed"

    out, loss = run(model)
    torch.testing.assert_close(out, out_ref, atol=ATOL, rtol=RTOL, msg=lambda m: f"output: {m}")
    torch.testing.assert_close(loss, loss_ref, atol=ATOL, rtol=RTOL, msg=lambda m: f"loss: {m}")
    loss.backward()

    ref = dict(whole.named_parameters())
    kinds = {"shard": 0, "partial": 0, None: 0}
    partial_differs = False
    for name, p in model.named_parameters():
        kind = getattr(p, "_rayzero_tp", None)
        kinds[kind] += 1
        r = ref[name]
        assert p.grad is not None, f"{name}: no gradient"
        if kind == "shard":
            (spec,) = splits_of(p)
            assert spec.axis == "tp" and spec.parts == tp_size and spec.index == tp_rank, f"{name}: {spec}"
            torch.testing.assert_close(p.data, take_slice(r.data, spec), atol=0, rtol=0)
            expected = take_slice(r.grad, spec)
            torch.testing.assert_close(p.grad, expected, atol=ATOL, rtol=RTOL, msg=lambda m: f"{name} grad: {m}")
        elif kind == "partial":
            assert p.shape == r.shape, f"{name}: partial params stay whole"
            partial_differs |= not torch.allclose(p.grad, r.grad, atol=ATOL, rtol=RTOL)
            summed = p.grad.clone()
            dist.all_reduce(summed, group=tp_group)
            torch.testing.assert_close(summed, r.grad, atol=ATOL, rtol=RTOL, msg=lambda m: f"{name} summed grad: {m}")
        else:
            assert p.shape == r.shape and not splits_of(p), f"{name}: replicated params stay whole"
            torch.testing.assert_close(p.grad, r.grad, atol=ATOL, rtol=RTOL, msg=lambda m: f"{name} grad: {m}")
    if kinds["partial"]:
        assert partial_differs, "a 'partial' gradient should differ from the full one on its own"
    return {"sharded": sharded, "kinds": {str(k): v for k, v in kinds.items()}}


def _qwen3_rank(rank, world):
    import torch.distributed as dist

    model = tiny_qwen3()
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 128, (2, 10), generator=g)

    def run(m):
        out = m(input_ids=ids, labels=ids)
        return out.logits, out.loss

    result = compare_with_whole(model, run, dist.group.WORLD, world, rank)
    attn = model.model.layers[0].self_attn
    mlp = model.model.layers[0].mlp
    result["shapes"] = {
        "q": tuple(attn.q_proj.weight.shape),
        "k": tuple(attn.k_proj.weight.shape),
        "o": tuple(attn.o_proj.weight.shape),
        "down": tuple(mlp.down_proj.weight.shape), "lm_head": tuple(model.lm_head.weight.shape),
        "embed": tuple(model.model.embed_tokens.weight.shape),
    }
    result["features"] = (attn.q_proj.out_features, attn.o_proj.in_features)
    result["q_norm"] = getattr(attn.q_norm.weight, "_rayzero_tp", None)
    return result


def test_qwen3_tp2_matches_single_process():
    r0, r1 = run_distributed(_qwen3_rank, 2)
    assert r0["sharded"] == r1["sharded"]
    per_layer = ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                 "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"]
    assert sorted(r0["sharded"]) == sorted(f"model.layers.{i}.{m}" for i in range(2) for m in per_layer)
    assert r0["shapes"] == {"q": (32, 64), "k": (16, 64), "o": (64, 32), "down": (64, 64),
                            "lm_head": (128, 64), "embed": (128, 64)}
    assert r0["features"] == (32, 32)
    assert r0["q_norm"] == "partial"
    # replicated: 2 layer norms per layer, the final norm, embed_tokens, lm_head
    assert r0["kinds"] == {"shard": 14, "partial": 4, "None": 2 * 2 + 3}


def _plain_rank(rank, world):
    import torch.distributed as dist

    results = {}
    torch.manual_seed(0)
    model = PlainModel()
    g = torch.Generator().manual_seed(1)
    ids, labels = torch.randint(0, 50, (2, 8), generator=g), torch.randint(0, 50, (2, 8), generator=g)
    results["fallback"] = compare_with_whole(model, lambda m: m(ids, labels), dist.group.WORLD, world, rank)
    results["num_heads"] = model.attn.num_heads

    torch.manual_seed(2)
    model = PlanModel()
    x, target = torch.randn(3, 5, 24, generator=g), torch.randn(3, 5, 24, generator=g)
    results["plan"] = compare_with_whole(model, lambda m: m(x, target), dist.group.WORLD, world, rank, plan=PLAN)
    return results


def test_plain_torch_models_tp2():
    r0, r1 = run_distributed(_plain_rank, 2)
    assert r0["fallback"]["sharded"] == r1["fallback"]["sharded"] == [
        "attn.q_proj", "attn.k_proj", "attn.v_proj", "attn.o_proj", "mlp.fc1", "mlp.fc2", "w1", "w3", "w2",
    ]
    assert r0["num_heads"] == 2
    assert r0["fallback"]["kinds"]["partial"] == 0
    assert r0["plan"]["sharded"] == [
        "blocks.0.scale", "blocks.0.up", "blocks.0.down", "blocks.1.scale", "blocks.1.up", "blocks.1.down",
    ]
    # per block: up weight + bias, down weight, scale sharded; hnorm partial; down bias replicated
    assert r0["plan"]["kinds"] == {"shard": 8, "partial": 2, "None": 2}


# ---- errors and no-ops (no process group needed: AutoTP validates before it communicates)


def _shapes(model):
    return {n: tuple(p.shape) for n, p in model.named_parameters()}


def test_heads_not_divisible():
    model = tiny_qwen3()
    before = _shapes(model)
    with pytest.raises(ConfigError) as e:
        apply_auto_tp(model, None, 3, 0)
    msg = str(e.value)
    assert "num_attention_heads=4" in msg and "num_key_value_heads=2" in msg and "autotp_size=3" in msg
    assert "valid tp sizes for this model: 1, 2" in msg
    assert _shapes(model) == before, "a failed apply_auto_tp must change nothing"
    assert type(model.model.layers[0].self_attn.q_proj) is nn.Linear


def test_dim_not_divisible():
    model = nn.ModuleDict({"fc1": nn.Linear(8, 6), "fc2": nn.Linear(6, 8)})
    with pytest.raises(ConfigError, match=r"fc1: dim 0 has 6 elements.*valid tp sizes for this model: 1, 2, 3, 6"):
        apply_auto_tp(model, None, 4, 0)


def test_nothing_to_shard():
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8))
    with pytest.raises(ConfigError) as e:
        apply_auto_tp(model, None, 2, 0)
    msg = str(e.value)
    assert "*.fc1 (colwise)" in msg and "*.down_proj (rowwise)" in msg and '"tensor_parallel": {"tp_plan"' in msg
    # a lone colwise match has no layer to reduce it: not sharded by the fallback
    with pytest.raises(ConfigError):
        apply_auto_tp(nn.ModuleDict({"fc1": nn.Linear(8, 8)}), None, 2, 0)
    # a plan that matches nothing
    with pytest.raises(ConfigError, match="no module of Sequential matches the tensor_parallel.tp_plan"):
        apply_auto_tp(model, None, 2, 0, plan={"layers.*.q_proj": "colwise"})


def test_bad_plans():
    model = tiny_qwen3()
    with pytest.raises(ConfigError, match="style 'diagonal'"):
        apply_auto_tp(model, None, 2, 0, plan={"layers.*.mlp.up_proj": "diagonal"})
    with pytest.raises(ConfigError, match="lm_head is an embedding / lm_head"):
        apply_auto_tp(model, None, 2, 0, plan={"lm_head": "colwise", "layers.*.mlp.down_proj": "rowwise"})
    with pytest.raises(ConfigError, match="only shards nn.Linear"):
        apply_auto_tp(model, None, 2, 0, plan={"layers.*.input_layernorm": "colwise"})


def test_tp1_and_experts_are_untouched():
    model = tiny_qwen3()
    before = _shapes(model)
    assert apply_auto_tp(model, None, 1, 0) == []
    assert _shapes(model) == before
    assert all(getattr(p, "_rayzero_tp", None) is None for p in model.parameters())

    # an expert-marked linear is left to AutoEP even when its name matches
    mlp = nn.ModuleDict({"fc1": nn.Linear(8, 8), "fc2": nn.Linear(8, 8)})
    experts = nn.ModuleDict({"w1": nn.Linear(8, 8), "w2": nn.Linear(8, 8)})
    for p in experts.parameters():
        p._rayzero_expert = True
    model = nn.ModuleDict({"mlp": mlp, "moe": experts})
    assert apply_auto_tp(model, None, 2, 0) == ["mlp.fc1", "mlp.fc2"]
    assert all(tuple(p.shape) in ((8, 8), (8,)) for p in experts.parameters())


def test_qwen3_moe_experts_left_to_autoep():
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    config = Qwen3MoeConfig(
        hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
        intermediate_size=64, moe_intermediate_size=16, num_experts=4, num_experts_per_tok=2, vocab_size=64,
        mlp_only_layers=[1],
    )
    torch.manual_seed(0)
    model = Qwen3MoeForCausalLM(config)
    before = _shapes(model)
    sharded = apply_auto_tp(model, None, 2, 0)
    assert not any("experts" in n or n.endswith("mlp.gate") for n in sharded)
    assert "model.layers.1.mlp.down_proj" in sharded and "model.layers.0.self_attn.o_proj" in sharded
    for name, p in model.named_parameters():
        if ".experts." in name or ".mlp.gate." in name:  # experts (AutoEP's) and the router stay whole
            assert tuple(p.shape) == before[name] and getattr(p, "_rayzero_tp", None) is None, name
