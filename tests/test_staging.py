"""Host-to-device staging (rayzero/offload/staging.py) with real tensors.

The host side (fence wait, cast into a buffer, packing) is the same code on every device; with
``through_buffer=True`` a CPU staging runs it whole, its copy to the "device" included.  Most cases here use
one buffer (``buffers=1``) to check its reuse; tests/test_device_streams.py has the two buffers used in turn
and the streams.  The pinned, asynchronous path on a real device runs only where CUDA is available.
"""

from __future__ import annotations

import pytest
import torch

from rayzero.offload.staging import BufferFence, HostStaging

_INT_VIEW = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}


def bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (a.dtype == b.dtype and a.shape == b.shape and a.device == b.device
            and torch.equal(a.view(_INT_VIEW[a.dtype]), b.view(_INT_VIEW[b.dtype])))


def rand(*shape, seed: int = 0, dtype=torch.float32) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * 1e3).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_same_device_and_dtype_is_the_shard_itself(dtype):
    staging = HostStaging("cpu", dtype)
    src = rand(1000, dtype=dtype)
    out = staging.to_device(src)
    assert out is src
    assert staging.buffer.numel() == 0 and staging.grown == 0 and staging.sends == 0
    # a view of a partition stays that view: same storage, no copy
    part = rand(5000, dtype=dtype)
    view = part[1000:2000]
    assert staging.to_device(view).data_ptr() == part.data_ptr() + 1000 * part.element_size()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_cpu_cast_needs_no_buffer(dtype):
    staging = HostStaging("cpu", dtype)
    src = rand(777)
    out = staging.to_device(src)
    assert bits_equal(out, src.to(dtype))
    assert staging.buffer.numel() == 0 and staging.grown == 0


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_through_buffer_reuses_one_buffer_and_grows(dtype):
    staging = HostStaging("cpu", dtype, through_buffer=True, buffers=1)
    first = rand(10, 10, seed=1)
    out1 = staging.to_device(first)
    ptr = staging.buffer.data_ptr()
    assert staging.grown == 1 and staging.buffer.numel() == 100
    assert bits_equal(out1, first.to(dtype))  # the cast into the buffer is torch's cast, bit for bit
    assert out1.data_ptr() != ptr  # what is sent is a copy: the buffer is free for the next shard

    smaller = rand(60, seed=2)
    out2 = staging.to_device(smaller)
    assert staging.buffer.data_ptr() == ptr and staging.grown == 1  # reused
    assert bits_equal(out2, smaller.to(dtype))

    larger = rand(300, seed=3)
    out3 = staging.to_device(larger)
    assert staging.grown == 2 and staging.buffer.numel() == 300  # grown to the larger shard
    grown_ptr = staging.buffer.data_ptr()
    out4 = staging.to_device(rand(300, seed=4))
    assert staging.buffer.data_ptr() == grown_ptr and staging.grown == 2
    assert bits_equal(out3, larger.to(dtype)) and bits_equal(out4, rand(300, seed=4).to(dtype))
    # earlier results are untouched by the buffer's reuse
    assert bits_equal(out1, first.to(dtype)) and bits_equal(out2, smaller.to(dtype))
    assert staging.sends == 4


def test_stage_fills_the_buffer_itself():
    staging = HostStaging("cpu", torch.bfloat16, through_buffer=True, buffers=1)
    a, b = rand(40, seed=5), rand(3, 7, seed=6)
    host = staging.stage([a, b])
    assert host.data_ptr() == staging.buffer.data_ptr() and host.numel() == 61
    assert bits_equal(host, torch.cat([a, b.reshape(-1)]).to(torch.bfloat16))
    again = staging.stage([b])
    assert again.data_ptr() == host.data_ptr()


def test_fence_is_waited_before_every_reuse():
    log: list = []
    staging = HostStaging("cpu", torch.bfloat16, through_buffer=True, fences=[BufferFence(log=log)])
    for seed in range(3):
        staging.to_device(rand(50 + seed, seed=seed))
    staging.pack([rand(8, seed=9), rand(9, seed=10)])
    # each fill of the buffer first waits for the copy recorded before it
    assert log == [("wait", 0), ("record", 1), ("wait", 1), ("record", 2), ("wait", 2), ("record", 3),
                   ("wait", 3), ("record", 4)]
    assert staging.fences[0].pending
    staging.synchronize()
    assert not staging.fences[0].pending and log[-1] == ("wait", 4)


class SnapshotFence(BufferFence):
    """Keeps what the buffer holds each time the staging waits on it, to show it was not yet overwritten."""

    def __init__(self, staging_ref: list):
        super().__init__()
        self.staging_ref = staging_ref
        self.seen: list[torch.Tensor] = []

    def wait(self) -> None:
        if self.pending:
            self.seen.append(self.staging_ref[0].buffer.clone())
        super().wait()


def test_buffer_still_holds_the_last_copy_when_waited_on():
    ref: list = []
    fence = SnapshotFence(ref)
    staging = HostStaging("cpu", torch.float16, through_buffer=True, fences=[fence])
    ref.append(staging)
    shards = [rand(64, seed=s) for s in range(4)]
    for s in shards:
        staging.to_device(s)
    # at each wait the buffer still held the shard whose copy was recorded last
    assert len(fence.seen) == 3
    for seen, sent in zip(fence.seen, shards):
        assert bits_equal(seen, sent.to(torch.float16))


@pytest.mark.parametrize("through_buffer", [False, True])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_pack_several_shards(through_buffer, dtype):
    staging = HostStaging("cpu", dtype, through_buffer=through_buffer)
    shards = [rand(n, seed=n) for n in (17, 1, 300, 64)] + [rand(4, 5, seed=99)]
    out = staging.pack(shards)
    expected = torch.cat([s.reshape(-1) for s in shards]).to(dtype)
    assert bits_equal(out, expected)
    if through_buffer:  # packed in the buffer, one copy out
        assert staging.sends == 1 and staging.buffer.numel() == expected.numel()
        assert out.data_ptr() != staging.buffer.data_ptr()
    else:  # the CPU computes: packed straight into the tensor sent, no buffer
        assert staging.sends == 0 and staging.buffer.numel() == 0
    assert staging.pack([]).numel() == 0


def test_stage3_gathers_through_the_buffer_train_bitwise_the_same():
    """One rank, stage 3, bf16: gathers sending the fp32 masters through the staging buffer train exactly
    like gathers that cast them with ``.to``."""
    import rayzero

    def run(through_buffer: bool):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.GELU(), torch.nn.Linear(64, 8))
        engine = rayzero.initialize(model, {
            "train_micro_batch_size_per_gpu": 4, "bf16": {"enabled": True},
            "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}}})
        if through_buffer:
            engine.gatherer.staging = HostStaging("cpu", torch.bfloat16, through_buffer=True)
        x = torch.randn(4, 16, generator=torch.Generator().manual_seed(1))
        losses = []
        for _ in range(3):
            loss = engine(x).float().pow(2).mean()
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
        staging = engine.gatherer.staging
        state = engine.full_state_dict()
        engine.destroy()
        return losses, state, staging

    plain_losses, plain_state, plain_staging = run(False)
    losses, state, staging = run(True)
    assert plain_staging.sends == 0 and plain_staging.grown == 0  # on the CPU nothing goes through it
    assert staging.sends > 0 and staging.grown >= 1
    assert losses == plain_losses
    for name in plain_state:
        assert torch.equal(state[name], plain_state[name]), name


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the pinned, asynchronous path needs CUDA")
def test_pinned_path_on_cuda():
    device = torch.device("cuda", torch.cuda.current_device())
    staging = HostStaging(device, torch.bfloat16)
    assert staging.through_buffer and len(staging.buffers) == 2
    big = [rand(1 << 24, seed=s) for s in range(3)]  # 64 MiB each: the copies take a while
    outs = [staging.to_device(t) for t in big]  # two buffers in turn: the third waits for the first's copy
    assert all(b.is_pinned() for b in staging.buffers) and staging.grown == 2
    ptrs = {b.data_ptr() for b in staging.buffers}
    torch.cuda.synchronize()
    for out, t in zip(outs, big):
        assert out.device == device and bits_equal(out.cpu(), t.to(torch.bfloat16))
    # several shards: packed on the host, one copy
    shards = [rand(n, seed=n) for n in (1000, 3, 70_000)]
    packed = staging.pack(shards)
    torch.cuda.synchronize()
    assert bits_equal(packed.cpu(), torch.cat(shards).to(torch.bfloat16)) and staging.buffer.data_ptr() in ptrs
    # a pinned partition already in the compute dtype is the copy's source itself
    part = rand(5000, dtype=torch.bfloat16).pin_memory()
    sends, grown = staging.sends, staging.grown
    out = staging.to_device(part[1000:3000])
    assert staging.sends == sends + 1 and staging.grown == grown
    staging.synchronize()
    assert not any(f.pending for f in staging.fences + [staging.direct])
    assert bits_equal(out.cpu(), part[1000:3000])
    # on the device already, in the compute dtype: no copy at all
    on_device = torch.ones(10, dtype=torch.bfloat16, device=device)
    assert staging.to_device(on_device) is on_device
