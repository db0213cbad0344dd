"""Weight gradients computed into reused buffers (rayzero/zero/grad_pool.py): the same values as autograd's,
bit for bit, and a buffer is reused only when nothing else can see it."""

import copy

import pytest
import torch

from rayzero.zero.grad_pool import GradientPool, pool_linear_gradients, unpool_linear_gradients


def _net(dtype):
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 64, bias=False),
                               torch.nn.Linear(64, 256)).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(8, 64), (3, 5, 64)])
def test_pooled_gradients_equal_autograds_bit_for_bit(dtype, shape):
    ref, net = _net(dtype), _net(dtype)
    pool = GradientPool()
    layers = pool_linear_gradients(net, set(net.parameters()), pool)
    assert len(layers) == 3
    grads = {}

    def spend(p):  # the reducer's part: take the gradient, drop .grad, give the buffer back
        g, p.grad = p.grad, None
        grads[p] = g.clone()
        pool.give(g)
        del g

    for p in net.parameters():
        p.register_post_accumulate_grad_hook(spend)
    for step in range(3):
        x = torch.randn(shape, generator=torch.Generator().manual_seed(step)).to(dtype)
        xr, xp = x.clone().requires_grad_(), x.clone().requires_grad_()
        ref.zero_grad(set_to_none=True)
        ref(xr).square().sum().backward()
        out = net(xp)
        assert torch.equal(out, ref(xr.detach()))
        out.square().sum().backward()
        assert torch.equal(xp.grad, xr.grad)
        for (name, p), q in zip(net.named_parameters(), ref.parameters()):
            assert grads[p].shape == q.grad.shape, name
            assert torch.equal(grads[p], q.grad), (name, step)
    # 64x256 and 256x64 weights have as many elements: one buffer serves both shapes
    assert pool.taken == 9 and pool.reused == 8
    unpool_linear_gradients(layers)
    assert all("forward" not in m.__dict__ for m in layers)


def test_a_gradient_something_else_holds_is_not_reused():
    net = _net(torch.float32)
    pool = GradientPool()
    pool_linear_gradients(net, set(net.parameters()), pool)
    kept = []
    net[0].weight.register_hook(lambda g: kept.append(g))  # a user's hook keeps the gradient it is shown
    net(torch.randn(4, 64)).sum().backward()
    snapshot = kept[0].clone()
    g = net[0].weight.grad
    net[0].weight.grad = None
    assert g is not kept[0]  # autograd gave the parameter a copy, as it does for any gradient held elsewhere
    assert pool.give(g)
    del g
    g2 = net[2].weight.grad
    net[2].weight.grad = None
    view = g2.view(-1)
    assert not pool.give(g2)  # a view of it is alive
    del view
    assert not pool.give(g2)  # the pool keeps one buffer per size
    for _ in range(2):  # the next backwards reuse the buffer given back, never the one the hook keeps
        net(torch.randn(4, 64)).sum().backward()
        for p in net.parameters():
            p.grad = None
    assert torch.equal(kept[0], snapshot)
    assert pool.reused >= 1


def test_gradients_of_other_sizes_are_not_kept():
    pool = GradientPool()
    pool.take(torch.Size([4, 8]), torch.float32, torch.device("cpu"))
    other = torch.empty(100)
    assert not pool.give(other)  # no layer asked for 100 elements: an embedding's gradient is not held on to
    same = torch.empty(8, 4)
    assert pool.give(same)
    del same
    assert pool.take(torch.Size([2, 16]), torch.float32, torch.device("cpu")).shape == (2, 16)


def test_a_backward_that_builds_a_graph_still_differentiates():
    ref, net = _net(torch.float32), _net(torch.float32)
    pool_linear_gradients(net, set(net.parameters()), GradientPool())
    x = torch.randn(4, 64)
    for m in (ref, net):
        (gw,) = torch.autograd.grad(m(x).square().sum(), [m[0].weight], create_graph=True)
        gw.square().sum().backward()
    assert torch.equal(net[3].weight.grad, ref[3].weight.grad)


def test_outside_training_the_layer_runs_as_it_always_does():
    net = _net(torch.float32)
    ref = copy.deepcopy(net)
    pool = GradientPool()
    pool_linear_gradients(net, set(net.parameters()), pool)
    x = torch.randn(4, 64)
    with torch.no_grad():
        assert torch.equal(net(x), ref(x))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        net(x).float().sum().backward()
        ref(x).float().sum().backward()
    assert pool.taken == 0
    assert torch.equal(net[0].weight.grad, ref[0].weight.grad)


def test_gradients_reach_their_hooks_in_autograds_order():
    """The reducer launches its buckets in the order autograd's own linear delivers gradients (a layer's bias
    before its weight); delivered in another order, a later bucket takes its rows before an earlier one is
    reduced and more buckets hold memory at once."""
    orders = []
    for pooled in (False, True):
        net, order = _net(torch.float32), []
        if pooled:
            pool_linear_gradients(net, set(net.parameters()), GradientPool())
        for name, p in net.named_parameters():
            p.register_post_accumulate_grad_hook(lambda p, name=name: order.append(name))
        net(torch.randn(4, 64)).sum().backward()
        orders.append(order)
    assert orders[0] == orders[1] == ["3.bias", "3.weight", "2.weight", "0.bias", "0.weight"]


def test_a_model_with_pooled_layers_saves_and_loads_whole(tmp_path):
    """torch.save of the module itself (not its state dict) while the engine holds it: the loaded copy runs
    the layers' own forward."""
    net = _net(torch.float32)
    pool_linear_gradients(net, set(net.parameters()), GradientPool())
    torch.save(net, tmp_path / "net.pt")
    loaded = torch.load(tmp_path / "net.pt", weights_only=False)
    x = torch.randn(4, 64)
    assert torch.equal(loaded(x), net(x))
