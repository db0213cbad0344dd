"""Bucket sizes rayzero derives when the config leaves them out (zero/buckets.py, docs/config.md)."""

from __future__ import annotations

import contextlib
import io

import pytest
import torch

import rayzero
from rayzero.zero.buckets import TRANSPORTS, derive_bucket_sizes, repeated_block

from distributed import run_distributed


def mlp_blocks(dim: int, hidden: int, blocks: int, device: str = "meta") -> torch.nn.Module:
    """bench/bench_zero.py's model: ``blocks`` x [Linear(dim, hidden) -> GELU -> Linear(hidden, dim)]."""
    with torch.device(device):
        return torch.nn.Sequential(*[
            torch.nn.Sequential(torch.nn.Linear(dim, hidden), torch.nn.GELU(), torch.nn.Linear(hidden, dim))
            for _ in range(blocks)
        ])


def derive(model, backend="gloo", comm_bytes=4, reduce=None, allgather=None):
    return derive_bucket_sizes(model, list(model.parameters()), lambda p: p.numel(), backend, comm_bytes,
                               reduce, allgather)


def test_bench_model_gets_eight_buckets_not_one():
    model = mlp_blocks(1024, 4096, 4)
    total = sum(p.numel() for p in model.parameters())
    assert total == 33_574_912
    assert repeated_block(model, lambda p: p.numel()) == ("Sequential", 8_393_728)
    plan = derive(model)
    # 1/8 of the model (smaller than one block, inside gloo's range)
    assert plan.reduce_bucket_size == plan.allgather_bucket_size == -(-total // 8) == 4_196_864
    assert plan.derived == ("reduce_bucket_size", "allgather_bucket_size")
    assert "4,196,864" in plan.message() and "override" in plan.message()


def test_many_blocks_cap_the_bucket_at_one_block():
    # 32 blocks of 262,912 elements: one block is under gloo's floor (20 x 0.5 ms at 1.5 GB/s): the floor
    model = mlp_blocks(256, 512, 32)
    block = 2 * 256 * 512 + 512 + 256
    assert repeated_block(model, lambda p: p.numel())[1] == block
    assert derive(model).reduce_bucket_size == 3_750_000
    assert derive(model, backend="nccl", comm_bytes=2).reduce_bucket_size == 10_000_000  # floor doubles at 2 bytes
    big = mlp_blocks(1024, 2048, 32)  # blocks of 4,197,376: under 1/8 of the model, inside gloo's range
    assert derive(big).reduce_bucket_size == 2 * 1024 * 2048 + 2048 + 1024  # 1/8 would be 4 blocks


def test_transport_range_bounds_the_bucket():
    tiny = mlp_blocks(8, 16, 2)  # the floor is above the whole model: one bucket
    assert derive(tiny).reduce_bucket_size == TRANSPORTS["gloo"].min_bucket_bytes() // 4 == 3_750_000
    huge = mlp_blocks(8192, 32768, 4)  # 2.1e9 elements, blocks of 5.4e8
    assert derive(huge).reduce_bucket_size == 25 * 2**20 // 4  # DDP's 25 MiB over gloo
    assert derive(huge, backend="nccl").reduce_bucket_size == 50_000_000
    assert derive(huge, backend="nccl", comm_bytes=2).reduce_bucket_size == 100_000_000
    assert derive(huge, backend="some-new-backend").reduce_bucket_size == 25 * 2**20 // 4  # gloo's figures


def test_a_value_in_the_config_wins():
    model = mlp_blocks(1024, 4096, 4)
    plan = derive(model, reduce=123)
    assert plan.reduce_bucket_size == 123 and plan.allgather_bucket_size == 4_196_864
    assert plan.derived == ("allgather_bucket_size",)
    assert "reduce_bucket_size" not in plan.message()
    assert derive(model, reduce=5, allgather=7).derived == ()


def test_hf_no_split_modules_names_the_block():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.Qwen3Config(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                                   num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    with torch.device("meta"):
        model = transformers.Qwen3ForCausalLM(cfg)
    name, n = repeated_block(model, lambda p: p.numel())
    assert name == "Qwen3DecoderLayer"
    assert n == sum(p.numel() for p in model.model.layers[0].parameters())


def _engine_run(rank, world, zero: dict, steps: int):
    torch.manual_seed(0)
    model = mlp_blocks(1024, 4096, 4, device="cpu")  # the bench model: 1/8 of it is above gloo's floor
    cfg = {"train_batch_size": 2 * world, "zero_optimization": zero,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}, "gradient_clipping": 1.0}
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        engine = rayzero.initialize(model, cfg)
    g = torch.Generator().manual_seed(1)
    losses, pooled, exposed_in_use = [], [], []
    for _ in range(steps):
        x = torch.randn(2 * world, 1024, generator=g)[rank * 2 : rank * 2 + 2]
        loss = engine(x).pow(2).mean()
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
        # the reducer's freed bucket buffers, by kind: (count, addresses)
        pooled.append({k[0]: sorted(t.data_ptr() for t in v) for k, v in engine.reducer._pool.items()})
        # bucket buffers still allocated from the exposed regions (shared memory) after the step
        exposed_in_use.append(sum(len(r._used) for r in engine.reducer._regions.values() if r is not None))
    regions = [r for r in engine.reducer._regions.values() if r is not None]
    out = dict(losses=losses, regions=len(regions), exposed_in_use=exposed_in_use, weights=engine.full_state_dict(), printed=err.getvalue(), pooled=pooled,
               reduce=engine.buckets.reduce_bucket_size, allgather=engine.buckets.allgather_bucket_size,
               reduce_buckets=len(engine.reducer.buckets), publish_buckets=len(engine.publisher.buckets),
               groups=len(engine.partitions.groups))
    engine.destroy()
    return out


@pytest.mark.parametrize("stage,shm", [(1, "1"), (2, "1"), (3, "1"), (2, "0")], ids=["1", "2", "3", "2-gloo"])
def test_engine_derives_several_buckets_and_trains_bitwise_like_one_bucket(stage, shm):
    env = {"RAYZERO_SHM": shm}
    derived = run_distributed(_engine_run, 2, {"stage": stage}, 2, env=env)
    one = run_distributed(_engine_run, 2, {"stage": stage, "reduce_bucket_size": 10**9,
                                           "allgather_bucket_size": 10**9}, 2, env=env)
    total = 33_574_912
    for r in derived:
        assert r["reduce"] == r["allgather"] == -(-total // 8)
        assert r["reduce_buckets"] >= 6  # several in flight, not one (12: parameters are never split)
    if stage < 3:  # stage 3 publishes only its persistent (small) parameters
        assert derived[0]["publish_buckets"] >= 6
    # one bucket per partition group: one group, except at stages 1-2 on one host in fp32, where each
    # weight matrix (2M elements a rank) has a group of its own (its master aliases the shared weights) and
    # so does each bias between two of them
    groups = 16 if stage < 3 and shm == "1" else 1
    assert [r["groups"] for r in derived + one] == [groups] * 4
    assert [r["reduce_buckets"] for r in one] == [groups, groups]
    from rayzero.zero.reducer import GradientReducer

    for r in derived:
        first, last = r["pooled"][0], r["pooled"][-1]
        assert first == last  # the same buffers, backward after backward
        assert all(1 <= len(v) <= GradientReducer.MAX_INFLIGHT + 1 for v in first.values())
        if shm == "1":
            # the ranks share a host: every bucket's rows come from the exposed region (read in place by the
            # other rank), and all of them are back in it after each step; stage 1 keeps its rows there
            assert r["regions"] == 1 and "rows" not in first
            assert r["exposed_in_use"] == [r["reduce_buckets"] if stage == 1 else 0] * 2
        else:
            # stages 2-3 take each bucket's buffers from a pool of at most MAX_INFLIGHT + 1 and the next
            # backward reuses the same ones (no fresh pages)
            assert r["regions"] == 0 and set(first) == {"rows", "out"}
    # the sizes are printed once, by rank 0, and only when rayzero chose them
    assert derived[0]["printed"].count("rayzero: derived reduce_bucket_size") == 1
    assert f"{-(-total // 8):,}" in derived[0]["printed"]
    assert derived[1]["printed"] == "" and one[0]["printed"] == ""
    # buckets decide when a gradient is reduced, never what it sums to
    assert derived[0]["losses"] == one[0]["losses"]
    for k, v in one[0]["weights"].items():
        assert torch.equal(derived[0]["weights"][k], v), k
