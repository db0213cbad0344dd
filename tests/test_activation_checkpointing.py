"""activation_checkpointing: the model's blocks are recomputed in backward, with the same numbers."""

from __future__ import annotations

import logging

import pytest
import torch

import rayzero
from actckpt_cases import BLOCKS, Block, BlockNet, all_runs
from distributed import run_distributed
from rayzero import activation_checkpointing as ac
from rayzero.config import Config, NotSupportedYetError
from rayzero.zero.stage3 import mark_gather_unit


@pytest.fixture(scope="module")
def runs():
    return run_distributed(all_runs, 2)  # one spawn of 2 gloo ranks for every assert below


@pytest.mark.parametrize("stage", [0, 3])
def test_same_losses_and_weights_with_fewer_saved_activations(runs, stage):
    for rank in range(2):
        plain, ckpt = runs[rank][(stage, False)], runs[rank][(stage, True)]
        assert ckpt["losses"] == pytest.approx(plain["losses"], rel=1e-6, abs=1e-7)
        for name, value in plain["state"].items():
            torch.testing.assert_close(ckpt["state"][name], value, rtol=1e-6, atol=1e-7)
        # the blocks keep only their inputs: the rest of the forward's saved tensors are the
        # input and output layers' and the loss's
        assert ckpt["saved"]["tensors"] < plain["saved"]["tensors"] / 3, (ckpt["saved"], plain["saved"])
        assert ckpt["saved"]["elements"] < plain["saved"]["elements"] / 3, (ckpt["saved"], plain["saved"])
        assert ckpt["wrapped"] == BLOCKS and ckpt["unwrapped"] == 0 and plain["wrapped"] == 0
    # the two ranks trained one model
    torch.testing.assert_close(runs[0][(stage, True)]["state"], runs[1][(stage, True)]["state"])


def test_checkpoint_callable_gives_the_same_gradients_and_saves_less():
    torch.manual_seed(0)
    block = Block().eval()
    x = torch.randn(5, 19, requires_grad=True)
    counts = []
    for fn in (block, lambda t: ac.checkpoint(block, t)):
        n = [0]
        with torch.autograd.graph.saved_tensors_hooks(lambda t: n.__setitem__(0, n[0] + 1) or t, lambda t: t):
            out = fn(x)
        grads = torch.autograd.grad(out.square().sum(), [x, *block.parameters()])
        counts.append((n[0], grads))
    (plain_n, plain_g), (ckpt_n, ckpt_g) = counts
    assert ckpt_n < plain_n
    for a, b in zip(plain_g, ckpt_g):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    with torch.no_grad():  # no graph to keep: runs the function as is
        torch.testing.assert_close(ac.checkpoint(block, x), block(x))


@pytest.mark.parametrize("key", ["partition_activations", "cpu_checkpointing", "contiguous_memory_optimization"])
def test_keys_rayzero_cannot_honour_are_refused_with_the_reason(key):
    with pytest.raises(NotSupportedYetError, match=f"'activation_checkpointing.{key}' = true is not supported yet by rayzero: "):
        Config.from_any({"activation_checkpointing": {key: True}})
    with pytest.raises(NotSupportedYetError, match=f"'activation_checkpointing.{key}'"):
        ac.configure(None, **{{"partition_activations": "partition_activations",
                                "cpu_checkpointing": "checkpoint_in_cpu",
                                "contiguous_memory_optimization": "contiguous_checkpointing"}[key]: True})


def test_deepspeed_keys_at_their_values_are_accepted():
    cfg = Config.from_any({"activation_checkpointing": {
        "partition_activations": False, "contiguous_memory_optimization": False, "cpu_checkpointing": False,
        "number_checkpoints": 8, "synchronize_checkpoint_boundary": True, "profile": True}})
    assert cfg.activation_checkpointing.number_checkpoints == 8
    assert Config.from_any({}).activation_checkpointing is None
    ac.configure(None, deepspeed_config={"activation_checkpointing": {"synchronize_checkpoint_boundary": True}})
    assert ac.is_configured()


def test_a_model_without_repeated_blocks_says_how_to_name_them(caplog):
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Tanh(), torch.nn.Linear(4, 2))
    with caplog.at_level(logging.WARNING, logger="rayzero"):
        engine = rayzero.initialize(model, {"train_micro_batch_size_per_gpu": 1, "activation_checkpointing": {}})
    assert "no repeated block found" in caplog.text and "mark_gather_unit" in caplog.text
    engine.destroy()
    net = BlockNet()
    mark_gather_unit(net.blocks[0], net.blocks[2])  # marks choose the blocks, as for stage 3's units
    engine = rayzero.initialize(net, {"train_micro_batch_size_per_gpu": 1, "activation_checkpointing": {}})
    assert [m for m in net.modules() if ac._WRAPPED_ATTR in m.__dict__] == [net.blocks[0], net.blocks[2]]
    engine.destroy()


def test_a_failed_initialize_leaves_no_block_wrapped():
    """Set-up that fails after the blocks were wrapped (here: OneCycle's betas under graph capture) puts their
    forward back, so a later engine without the section does not checkpoint them."""
    net = BlockNet()
    cfg = {"train_micro_batch_size_per_gpu": 1, "activation_checkpointing": {}, "graph_capture": {"enabled": True},
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
           "scheduler": {"type": "OneCycle", "params": {"cycle_min_lr": 1e-4, "cycle_max_lr": 1e-3}}}
    with pytest.raises(rayzero.ConfigError, match="cycle_momentum"):
        rayzero.initialize(net, cfg)
    assert [m for m in net.modules() if "forward" in m.__dict__] == []
