"""Stage-3 weight shards in the swap files (rayzero/offload/params.py): a real swap store under tmp_path.

The reads in flight go through a pool of ``buffer_count`` aligned buffers of ``buffer_size`` elements;
the resident shards are a cache bounded by ``max_in_cpu`` elements.
"""

from __future__ import annotations

import pytest
import torch

from rayzero.config import ConfigError
from rayzero.offload.params import NvmeParamSwap
from rayzero.offload.swap_store import ALIGNMENT, SwapStore
from rayzero.zero.layout import ParamEntry

_INT_VIEW = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}


def bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(_INT_VIEW[a.dtype]), b.view(_INT_VIEW[b.dtype]))


def entries_of(chunks: list[int], group: int = 0) -> list[ParamEntry]:
    """A group's layout on one rank of two: one entry per chunk, back to back in the partition."""
    out, offset = [], 0
    for i, chunk in enumerate(chunks):
        out.append(ParamEntry(f"layer{i}.weight", group, i, torch.Size([2 * chunk]), 2 * chunk, chunk, offset, 2))
        offset += chunk
    return out


def master(entries: list[ParamEntry], seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(sum(e.chunk for e in entries), generator=g) * 100


def expected(e: ParamEntry, source: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return source[e.partition_offset : e.partition_offset + e.chunk].to(dtype)


@pytest.fixture
def store(tmp_path):
    s = SwapStore(tmp_path / "swap", block_size=64 * 1024, queue_depth=4, thread_count=2)
    yield s
    s.close()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16])
def test_values_read_back_bitwise(store, dtype):
    entries = entries_of([1, 1000, 2048, 5000, 333])
    src = master(entries, 0)
    swap = NvmeParamSwap(store, dtype, max_in_cpu=0, buffer_count=2, buffer_size=6000)
    swap.write_from(entries, src)
    swap.prefetch(entries)
    for e in entries:
        got = swap.shard(e)
        assert bits_equal(got, expected(e, src, dtype)), e.name
        assert got.data_ptr() % ALIGNMENT == 0  # written straight from on the next refresh
    assert swap.pool.in_use == 0 and not swap.reading


def test_pool_never_exceeds_buffer_count(store):
    dtype = torch.float32
    entries = entries_of([1000] * 10)
    src = master(entries, 1)
    # a shard takes 1024 elements (one aligned block) of a buffer: three fit in 3072
    swap = NvmeParamSwap(store, dtype, max_in_cpu=10_000, buffer_count=2, buffer_size=3072)
    swap.write_from(entries, src)
    swap.prefetch(entries[:4])  # a unit whose shards do not fit one buffer: two
    assert swap.pool.allocated == 2 and swap.pool.in_use == 2 and len(swap.reading) == 4
    swap.prefetch(entries)  # more than the pool holds: the rest is skipped, nothing more is allocated
    assert len(swap.reading) == 6 and swap.skipped == 4 and swap.pool.allocated == 2
    # a shard asked for while every buffer is busy: the oldest reads go to the cache first
    last = swap.shard(entries[9])
    assert bits_equal(last, expected(entries[9], src, dtype))
    assert swap.pool.allocated <= 2 and swap.pool.peak_in_use <= 2
    for e in entries:
        assert bits_equal(swap.shard(e), expected(e, src, dtype)), e.name
        assert swap.pool.allocated <= 2
    assert swap.pool.in_use == 0


def test_buffers_are_reused(store):
    dtype = torch.bfloat16
    entries = entries_of([2000] * 6)
    src = master(entries, 2)
    swap = NvmeParamSwap(store, dtype, max_in_cpu=0, buffer_count=2, buffer_size=4096)
    swap.write_from(entries, src)
    seen = set()
    for _ in range(3):
        for e in entries:
            swap.prefetch([e])
            seen.add(swap.reading[swap._key(e)][1].untyped_storage().data_ptr())
            assert bits_equal(swap.shard(e), expected(e, src, dtype))
    assert len(seen) <= 2 and swap.pool.allocated <= 2


def test_no_buffer_is_larger_than_all_shards(store):
    """buffer_size is a bound: with a few small shards the buffers take only what those need."""
    entries = entries_of([100, 200])
    swap = NvmeParamSwap(store, torch.float32, max_in_cpu=0, buffer_count=3, buffer_size=100_000_000)
    swap.write_from(entries, master(entries, 3))
    swap.prefetch(entries)
    assert swap.pool.allocated == 1
    (_, view, buf) = swap.reading[swap._key(entries[0])]
    assert buf.tensor.numel() == 2 * (ALIGNMENT // 4)
    swap.drop()
    assert swap.pool.in_use == 0


def test_shard_larger_than_buffer_size_is_refused_at_set_up(store):
    with pytest.raises(ConfigError) as e:
        NvmeParamSwap(store, torch.bfloat16, max_in_cpu=0, buffer_count=4, buffer_size=1000, largest_shard=1001)
    msg = str(e.value)
    assert "buffer_size is 1000" in msg and "1001 elements" in msg and "at least 1001" in msg
    # without largest_shard: the first write of the shard (at set-up) refuses it, naming the parameter
    swap = NvmeParamSwap(store, torch.bfloat16, max_in_cpu=0, buffer_count=4, buffer_size=1000)
    entries = entries_of([10, 1500])
    with pytest.raises(ConfigError, match=r"'layer1.weight'.*1500 elements.*at least 1500"):
        swap.write_from(entries, master(entries, 4))
    with pytest.raises(ConfigError, match="must be >= 1"):
        NvmeParamSwap(store, torch.bfloat16, max_in_cpu=0, buffer_count=0)


def test_cache_evicts_least_recently_used(store):
    dtype = torch.float32
    entries = entries_of([1000, 1000, 1000])
    src = master(entries, 5)
    swap = NvmeParamSwap(store, dtype, max_in_cpu=2000, buffer_count=1, buffer_size=1024)
    swap.write_from(entries, src)
    store_reads = lambda: store.stats["bytes_read"]
    a, b, c = entries
    swap.shard(a), swap.shard(b)
    before = store_reads()
    swap.shard(a)  # cached: not read again, and now the most recently used
    assert store_reads() == before
    swap.shard(c)  # over max_in_cpu: b, the least recently used, goes
    assert list(swap.cache) == [swap._key(a), swap._key(c)] and swap.cached_elements == 2000
    got = swap.shard(b)  # read again
    assert store_reads() == before + 2 * 4000
    assert bits_equal(got, expected(b, src, dtype))
    # max_in_cpu 0 keeps only the shard just taken
    swap.max_in_cpu = 0
    swap.shard(a)
    assert list(swap.cache) == [swap._key(a)]


def test_writes_and_reads_keep_their_order(store):
    dtype = torch.bfloat16
    entries = entries_of([3000, 700])
    old, new, newer = master(entries, 6), master(entries, 7), master(entries, 8)
    swap = NvmeParamSwap(store, dtype, max_in_cpu=0, buffer_count=1, buffer_size=8192)
    swap.write_from(entries, old)
    # a read of the old value in flight, then a write: the read is dropped and its buffer freed
    swap.prefetch(entries)
    swap.write_from(entries, new)
    assert not swap.reading and swap.pool.in_use == 0
    for e in entries:
        assert bits_equal(swap.shard(e), expected(e, new, dtype))
    # a write right before a read: the read sees the new value
    swap.write_from(entries, newer)
    assert swap.writes
    swap.prefetch(entries)
    assert not swap.writes  # settled before any read starts
    for e in entries:
        assert bits_equal(swap.shard(e), expected(e, newer, dtype))
    # a cached shard is updated in place by a write, and not read again
    swap.max_in_cpu = 10_000
    first = swap.shard(entries[0])
    reads = store.stats["bytes_read"]
    swap.write_from(entries[:1], old)
    again = swap.shard(entries[0])
    assert again is first and store.stats["bytes_read"] == reads
    assert bits_equal(again, expected(entries[0], old, dtype))
    swap.settle_writes()
    # and the file holds it too: forget everything and read it back
    swap.drop()
    assert bits_equal(swap.shard(entries[0]), expected(entries[0], old, dtype))


def test_several_groups_and_drop(store):
    dtype = torch.float16
    g0, g1 = entries_of([500, 1500], group=0), entries_of([800], group=1)
    s0, s1 = master(g0, 9), master(g1, 10)
    swap = NvmeParamSwap(store, dtype, max_in_cpu=100, buffer_count=2, buffer_size=2048)
    swap.write_from(g0, s0)
    swap.write_from(g1, s1)
    swap.prefetch(g0 + g1)
    assert swap.pool.allocated <= 2
    swap.drop()
    assert not swap.reading and not swap.cache and swap.pool.in_use == 0
    for e, src in ((g1[0], s1), (g0[1], s0), (g0[0], s0)):
        assert bits_equal(swap.shard(e), expected(e, src, dtype))
