"""rayzero.moe.MoE against a naive per-token reference, single-process and with EP=2 and EP=2 x TP=2."""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn.functional as F

from distributed import run_distributed
from rayzero.moe import MoE, drop_over_capacity, moe_aux_loss
from rayzero.parallel.slicing import SplitSpec, splits_of, take_slice

H, FFN, E, T = 8, 6, 4, 12
TOL = dict(atol=1e-5, rtol=1e-5)


def make_layer(seed: int = 0, **kw) -> MoE:
    torch.manual_seed(seed)
    kw.setdefault("top_k", 2)
    return MoE(H, FFN, E, **kw)


def make_batch(index: int, tokens: int = T) -> tuple[torch.Tensor, torch.Tensor]:
    """Input and a fixed output-gradient projection, different for every ``index``."""
    g = torch.Generator().manual_seed(1000 + index)
    return torch.randn(tokens, H, generator=g), torch.randn(tokens, H, generator=g)


def _swiglu(gate_up: torch.Tensor, down: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    h = gate_up @ x
    half = h.shape[0] // 2
    return down @ (F.silu(h[:half]) * h[half:])


def naive_moe(layer: MoE, x: torch.Tensor):
    """One token at a time, one of its top-k experts at a time; returns (output, dropped (t, slot) pairs)."""
    tokens, k = x.shape[0], layer.top_k
    probs = torch.softmax(x.float() @ layer.router.weight.float().t(), dim=-1)
    capacity = None
    if layer.capacity_factor is not None:
        capacity = math.ceil(layer.capacity_factor * tokens * k / layer.num_experts)
    used = [0] * layer.num_experts
    dropped = set()
    rows = []
    for t in range(tokens):
        weight, index = torch.topk(probs[t], k)
        if layer.normalize_topk:
            weight = weight / weight.sum()
        y = torch.zeros(x.shape[1], dtype=x.dtype)
        for s in range(k):
            e = int(index[s])
            if capacity is not None:
                if used[e] >= capacity:
                    dropped.add((t, s))
                    continue
                used[e] += 1
            y = y + weight[s] * _swiglu(layer.experts.gate_up_proj[e], layer.experts.down_proj[e], x[t])
        if layer.shared_experts is not None:
            sh = layer.shared_experts
            y = y + _swiglu(sh.gate_up_proj.weight, sh.down_proj.weight, x[t])
        rows.append(y)
    return torch.stack(rows), dropped


def grads(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in module.named_parameters()}


def run_layer(layer: MoE, x: torch.Tensor, g: torch.Tensor) -> dict:
    """Forward, backward of ``(out * g).sum() + aux``; output, input grad and parameter grads."""
    x = x.clone().requires_grad_()
    out = layer(x)
    ((out * g).sum() + moe_aux_loss(layer)).backward()
    return {"out": out.detach(), "x_grad": x.grad, "grads": grads(layer)}


# ---- 1. single process against the naive reference -----------------------------------------------


@pytest.mark.parametrize(
    "kw",
    [
        dict(top_k=1, normalize_topk=False),
        dict(top_k=1, normalize_topk=True),
        dict(top_k=2, normalize_topk=False),
        dict(top_k=2, normalize_topk=True, aux_loss_coef=0.1, z_loss_coef=0.01),
        dict(top_k=2, num_shared_experts=2, shared_ffn_hidden_size=5),
        dict(top_k=3, normalize_topk=False, num_shared_experts=1),
    ],
)
def test_matches_naive_reference(kw):
    layer = make_layer(**kw)
    ref = copy.deepcopy(layer)
    x, g = make_batch(0)
    got = run_layer(layer, x, g)

    xr = x.clone().requires_grad_()
    want, dropped = naive_moe(ref, xr)
    assert not dropped
    ref(xr)  # only for ref.aux_loss (its formula is checked by hand below), which reaches x and the router
    ((want * g).sum() + ref.aux_loss).backward()

    torch.testing.assert_close(got["out"], want.detach(), **TOL)
    torch.testing.assert_close(got["x_grad"], xr.grad, **TOL)
    for name, p in ref.named_parameters():
        torch.testing.assert_close(got["grads"][name], p.grad, **TOL, msg=name)


def test_leading_dims_and_marks():
    layer = make_layer(top_k=2)
    x = torch.randn(3, 4, H)
    out = layer(x)
    assert out.shape == x.shape
    torch.testing.assert_close(out.reshape(-1, H), naive_moe(layer, x.reshape(-1, H))[0], **TOL)
    assert layer.experts.gate_up_proj._rayzero_expert and layer.experts.down_proj._rayzero_expert
    assert not getattr(layer.router.weight, "_rayzero_expert", False)
    assert [n for n, _ in layer.named_parameters()] == ["router.weight", "experts.gate_up_proj", "experts.down_proj"]
    assert layer.tokens_per_expert.sum() == x.shape[0] * x.shape[1] * 2


def test_bf16():
    layer = make_layer(top_k=2, num_shared_experts=1).to(torch.bfloat16)
    ref = copy.deepcopy(layer).float()  # the same (bf16-representable) weights in fp32: the same routing
    x = torch.randn(T, H).to(torch.bfloat16).requires_grad_()
    out = layer(x)
    assert out.dtype == torch.bfloat16
    _, _, probs, _ = layer.route(x.detach())
    assert probs.dtype == torch.float32 and layer.aux_loss.dtype == torch.float32
    (out.float().sum() + moe_aux_loss(layer)).backward()
    assert layer.experts.gate_up_proj.grad.dtype == torch.bfloat16 and x.grad.dtype == torch.bfloat16
    assert layer.router.weight.grad is not None and torch.isfinite(layer.router.weight.grad.float()).all()
    torch.testing.assert_close(out.float(), naive_moe(ref, x.detach().float())[0].detach(), atol=3e-2, rtol=3e-2)


# ---- 2. auxiliary losses ---------------------------------------------------------------------------


@pytest.mark.parametrize("top_k", [1, 2])
def test_aux_and_z_loss_formulas(top_k):
    aux_coef, z_coef = 0.3, 0.07
    layer = make_layer(top_k=top_k, aux_loss_coef=aux_coef, z_loss_coef=z_coef, capacity_factor=0.5)
    x, _ = make_batch(2)
    layer(x)

    logits = x @ layer.router.weight.t()
    probs = torch.exp(logits) / torch.exp(logits).sum(-1, keepdim=True)
    counts = [0] * E
    for t in range(T):  # before any capacity drop
        for e in torch.topk(probs[t], top_k).indices.tolist():
            counts[e] += 1
    f = torch.tensor(counts, dtype=torch.float32) / (T * top_k)
    p_mean = probs.sum(0) / T
    balance = E * sum(f[e] * p_mean[e] for e in range(E))
    z = sum(torch.log(torch.exp(logits[t]).sum()) ** 2 for t in range(T)) / T
    want = aux_coef * balance + z_coef * z
    torch.testing.assert_close(layer.aux_loss, want, **TOL)

    (g_got,) = torch.autograd.grad(layer.aux_loss, layer.router.weight)
    (g_want,) = torch.autograd.grad(want, layer.router.weight)
    torch.testing.assert_close(g_got, g_want, **TOL)


def test_balanced_router_gives_unit_balance_loss():
    layer = make_layer(top_k=1, aux_loss_coef=1.0)
    with torch.no_grad():
        layer.router.weight.zero_()  # uniform probabilities: P_e = 1/E
    # with equal logits topk picks expert 0 for every token: f = (1, 0, 0, 0), loss = E * 1 * 1/E = 1
    layer(torch.randn(T, H))
    torch.testing.assert_close(layer.aux_loss, torch.tensor(1.0))


def test_moe_aux_loss_sums_layers():
    model = torch.nn.Sequential(make_layer(seed=0), torch.nn.Linear(H, H), make_layer(seed=1))
    assert moe_aux_loss(model).item() == 0.0  # no forward yet
    model(torch.randn(T, H))
    torch.testing.assert_close(moe_aux_loss(model), model[0].aux_loss + model[2].aux_loss)
    assert moe_aux_loss(model).requires_grad
    plain = moe_aux_loss(torch.nn.Linear(2, 2))
    assert plain.item() == 0.0 and plain.shape == ()


# ---- 3. capacity -------------------------------------------------------------------------------------


def test_drop_over_capacity_rule():
    index = torch.tensor([[0, 1], [0, 2], [1, 0], [3, 0], [0, 1]])
    want = torch.tensor([[0, 1], [0, 2], [1, -1], [3, -1], [-1, -1]])
    assert torch.equal(drop_over_capacity(index, 4, 2), want)
    assert torch.equal(drop_over_capacity(index, 4, 0), torch.full_like(index, -1))
    assert torch.equal(drop_over_capacity(index, 4, 5), index)


@pytest.mark.parametrize("top_k,factor", [(1, 1.0), (2, 1.0), (2, 0.5)])
def test_capacity_drops_match_rule(top_k, factor):
    layer = make_layer(top_k=top_k, capacity_factor=factor, num_shared_experts=1)
    x, _ = make_batch(3)
    index, _, _, _ = layer.route(x)
    want, dropped = naive_moe(layer, x)
    assert dropped, "the test batch should overflow some expert"
    got_dropped = {(t, s) for t, s in (index == -1).nonzero().tolist()}
    assert got_dropped == dropped
    capacity = math.ceil(factor * T * top_k / E)
    assert int(layer.tokens_per_expert.max()) <= capacity
    assert int(layer.tokens_per_expert.sum()) == T * top_k - len(dropped)
    torch.testing.assert_close(layer(x), want, **TOL)


def test_large_capacity_equals_dropless():
    dropless = make_layer(top_k=2)
    capped = make_layer(top_k=2, capacity_factor=float(E))  # capacity T * k: nothing can overflow
    x, g = make_batch(4)
    a, b = run_layer(dropless, x, g), run_layer(capped, x, g)
    assert torch.equal(a["out"], b["out"]) and torch.equal(a["x_grad"], b["x_grad"])
    for name in a["grads"]:
        # with a capacity every expert computes capacity rows, the unused ones zeros: its weight gradient
        # sums more (zero) rows, in another order, so it may differ in the last bit
        torch.testing.assert_close(a["grads"][name], b["grads"][name], rtol=1e-6, atol=1e-7, msg=name)


# ---- 4/5. expert parallelism (and tensor parallelism) on gloo ranks -----------------------------

CONFIGS = [
    dict(top_k=2, num_shared_experts=1, z_loss_coef=1e-3),
    dict(top_k=1, normalize_topk=False, capacity_factor=1.0),
]


def _parallel_worker(rank: int, world: int, tp: int) -> list[dict]:
    import torch.distributed as dist

    ep = world // tp
    tp_rank, ep_rank = rank % tp, rank // tp
    if tp == 1:
        ep_group, tp_group = dist.group.WORLD, None
    else:  # every rank creates every group, in the same order
        tp_groups = [dist.new_group([b * tp + t for t in range(tp)]) for b in range(ep)]
        ep_groups = [dist.new_group([e * tp + t for e in range(ep)]) for t in range(tp)]
        tp_group, ep_group = tp_groups[ep_rank], ep_groups[tp_rank]
    results = []
    for cfg in CONFIGS:
        layer = make_layer(**cfg)
        layer.shard_experts(ep_group, ep, ep_rank, tp_group, tp, tp_rank)
        x, g = make_batch(ep_rank)  # the ranks of one TP group share their batch
        res = run_layer(layer, x, g)
        res["splits"] = {n: splits_of(p) for n, p in layer.named_parameters()}
        res["tp_mark"] = {n: getattr(p, "_rayzero_tp", None) for n, p in layer.named_parameters()}
        results.append(res)
    return results


def _reference(cfg: dict, batches: int) -> tuple[list[dict], dict[str, torch.Tensor]]:
    """Single-process full layer per batch, and the expert grads summed over all batches."""
    per_batch = [run_layer(make_layer(**cfg), *make_batch(i)) for i in range(batches)]
    summed = {n: sum(r["grads"][n] for r in per_batch) for n in ("experts.gate_up_proj", "experts.down_proj")}
    return per_batch, summed


def _check_parallel(results: list[list[dict]], tp: int) -> None:
    ep = len(results) // tp
    for c, cfg in enumerate(CONFIGS):
        per_batch, summed = _reference(cfg, ep)
        for rank, rank_results in enumerate(results):
            got = rank_results[c]
            tp_rank, ep_rank = rank % tp, rank // tp
            want = per_batch[ep_rank]
            where = f"config {c}, rank {rank}"
            torch.testing.assert_close(got["out"], want["out"], **TOL, msg=where)
            torch.testing.assert_close(got["x_grad"], want["x_grad"], **TOL, msg=where)
            for name, grad in got["grads"].items():
                if name.startswith("experts."):
                    specs = [SplitSpec("ep", 0, ep, ep_rank)]
                    if tp > 1 and "gate_up" in name:
                        specs.append(SplitSpec("tp", 1, tp, tp_rank, packed=2))
                    elif tp > 1:
                        specs.append(SplitSpec("tp", 2, tp, tp_rank))
                    expected = summed[name]
                    for spec in specs:
                        expected = take_slice(expected, spec)
                    assert got["splits"][name] == tuple(specs), where
                    assert got["tp_mark"][name] == ("shard" if tp > 1 else None), where
                else:  # router and shared experts: replicated, this rank's batch only
                    expected = want["grads"][name]
                    assert got["splits"][name] == (), where
                torch.testing.assert_close(grad, expected, **TOL, msg=f"{where}: {name}")


def test_expert_parallel_2_ranks():
    _check_parallel(run_distributed(_parallel_worker, 2, 1, timeout=120.0), tp=1)


def test_expert_parallel_2_x_tensor_parallel_2():
    _check_parallel(run_distributed(_parallel_worker, 4, 2, timeout=120.0), tp=2)


# ---- 6. shard_experts without a process group --------------------------------------------------


def test_shard_experts_slices_and_marks():
    full = make_layer(top_k=2)
    layer = copy.deepcopy(full).shard_experts(None, 2, 1, None, 3, 2)
    gu, dn = layer.experts.gate_up_proj, layer.experts.down_proj
    assert gu.shape == (E // 2, 2 * FFN // 3, H) and dn.shape == (E // 2, H, FFN // 3)
    assert gu._rayzero_expert and dn._rayzero_expert and gu._rayzero_tp == "shard"
    assert splits_of(gu) == (SplitSpec("ep", 0, 2, 1), SplitSpec("tp", 1, 3, 2, packed=2))
    assert splits_of(dn) == (SplitSpec("ep", 0, 2, 1), SplitSpec("tp", 2, 3, 2))
    # gate rows [F/3*2, F) of experts 2 and 3, then their up rows
    want_gu = full.experts.gate_up_proj[2:4][:, [4, 5, 10, 11]]
    assert torch.equal(gu.detach(), want_gu.detach())
    assert torch.equal(dn.detach(), full.experts.down_proj[2:4, :, 4:6].detach())
    assert [n for n, _ in layer.named_parameters()] == [n for n, _ in full.named_parameters()]
    with pytest.raises(RuntimeError, match="already"):
        layer.shard_experts(None, 2, 1)
    # copies keep the marks (deepcopy of an nn.Parameter alone drops its attributes)
    copied = copy.deepcopy(layer).experts.gate_up_proj
    assert copied._rayzero_expert and copied._rayzero_tp == "shard" and splits_of(copied) == splits_of(gu)
    assert copy.deepcopy(full).experts.down_proj._rayzero_expert


def test_shard_experts_ep1_is_identity():
    full = make_layer(top_k=2, num_shared_experts=1)
    layer = copy.deepcopy(full).shard_experts(None, 1, 0)
    assert layer.is_sharded and splits_of(layer.experts.gate_up_proj) == ()
    assert layer.experts.down_proj._rayzero_expert
    x, g = make_batch(5)
    a, b = run_layer(full, x, g), run_layer(layer, x, g)
    assert torch.equal(a["out"], b["out"])
    for name in a["grads"]:
        assert torch.equal(a["grads"][name], b["grads"][name]), name


def test_bad_sizes_raise():
    with pytest.raises(ValueError, match=r"4 experts.*3 ranks"):
        make_layer().shard_experts(None, 3, 0)
    with pytest.raises(ValueError, match=r"ffn_hidden_size=6.*4 ranks"):
        make_layer().shard_experts(None, 2, 0, None, 4, 0)
    with pytest.raises(ValueError, match="ep_rank=2"):
        make_layer().shard_experts(None, 2, 2)
    with pytest.raises(ValueError, match="top_k"):
        MoE(H, FFN, E, top_k=5)
    with pytest.raises(ValueError, match="activation"):
        MoE(H, FFN, E, activation="tanhh")
