"""The NVMe swap store (rayzero/offload/swap_store.py): real files under tmp_path, real O_DIRECT, no mocks."""

from __future__ import annotations

import ctypes
import errno
import json
import os
import pickle
import shutil
import subprocess
import sys
import threading

import pytest
import torch

from rayzero.offload.swap_store import (
    ALIGNMENT, SwapError, SwapFullError, SwapStore, aligned_empty, free_bytes,
)

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
SIZES = [1, 1023, 12345, 3_000_001]
_INT_VIEW = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}


def bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and torch.equal(a.view(_INT_VIEW[a.dtype]), b.view(_INT_VIEW[b.dtype]))


def rand(numel: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(numel, generator=g).to(dtype)


@pytest.fixture
def store(tmp_path):
    s = SwapStore(tmp_path / "swap")
    if not s.direct:
        s.close()
        pytest.skip(f"{tmp_path} refuses O_DIRECT; these tests need a disk that takes it")
    yield s
    s.close()


def test_disk_enforces_alignment(tmp_path):
    """The premise of the other tests: this disk rejects an unaligned O_DIRECT buffer with EINVAL."""
    buf = aligned_empty(2 * ALIGNMENT, torch.uint8)
    fd = os.open(tmp_path / "probe", os.O_CREAT | os.O_RDWR | os.O_DIRECT)
    try:
        os.pwrite(fd, (ctypes.c_char * ALIGNMENT).from_address(buf.data_ptr()), 0)  # aligned: fine
        with pytest.raises(OSError) as e:
            os.pwrite(fd, (ctypes.c_char * ALIGNMENT).from_address(buf.data_ptr() + 4), 0)
        assert e.value.errno == errno.EINVAL
    finally:
        os.close(fd)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("numel", [0, 1, 1023, 1024, 12345, 1 << 20])
def test_aligned_empty(dtype, numel):
    t = aligned_empty(numel, dtype)
    nbytes = numel * dtype.itemsize
    padded = -(-nbytes // ALIGNMENT) * ALIGNMENT
    assert t.dtype == dtype and t.shape == (numel,) and t.is_contiguous()
    assert t.data_ptr() % ALIGNMENT == 0
    st = t.untyped_storage()
    assert st.data_ptr() + st.nbytes() >= t.data_ptr() + padded  # the padded range is ours to use
    pad = (ctypes.c_char * (padded - nbytes)).from_address(t.data_ptr() + nbytes)
    assert bytes(pad) == b"\0" * (padded - nbytes)


@pytest.mark.parametrize("dtype", DTYPES)
def test_round_trip_bitwise(store, dtype):
    for numel in SIZES:
        src = rand(numel, dtype, seed=numel)
        aligned = aligned_empty(numel, dtype)
        aligned.copy_(src)
        shifted = torch.cat([torch.zeros(1, dtype=dtype), src])[1:]  # never aligned: the staging path
        assert shifted.data_ptr() % ALIGNMENT != 0
        for key, t in ((f"plain{numel}", src), (f"aligned{numel}", aligned), (f"shifted{numel}", shifted)):
            store.write(key, t).result()
            nbytes = numel * dtype.itemsize
            assert store.nbytes(key) == nbytes
            # The file is padded to the alignment; the true size is what nbytes() and reads use.
            assert os.path.getsize(store._path(key)) == -(-nbytes // ALIGNMENT) * ALIGNMENT
            for out in (torch.full((numel,), 7.0, dtype=dtype), aligned_empty(numel, dtype),
                        torch.full((numel + 1,), 7.0, dtype=dtype)[1:]):
                assert store.read(key, out).result() is out
                assert bits_equal(out, src), (key, numel)


def test_staging_path_unaligned_tensor(tmp_path):
    store = SwapStore(tmp_path / "s", queue_depth=2, thread_count=4, block_size=64 * 1024)
    try:
        base = rand(300_001, torch.float32)
        src = base[1:]  # starts 4 bytes past an allocation: never ALIGNMENT-aligned
        assert src.data_ptr() % ALIGNMENT != 0
        futs = [store.write(f"k{i}", src) for i in range(4)]
        for f in futs:
            f.result()
        holder = torch.zeros(300_001)
        out = holder[1:]
        store.read("k3", out).result()
        assert bits_equal(out, src) and holder[0] == 0
        # The staging pool is bounded: 4 threads and 4 ops in flight, yet at most queue_depth buffers.
        assert 1 <= store._staging.allocated <= 2
    finally:
        store.close()


def test_aligned_tensors_skip_staging(store):
    """aligned_empty tensors are the I/O buffers themselves; only a read's partial last block is staged."""
    for numel, dtype in ((1 << 20, torch.float32), (3_000_001, torch.bfloat16)):
        src = aligned_empty(numel, dtype)
        src.copy_(rand(numel, dtype))
        store.write("k", src).result()
        assert store._staging.allocated == 0
        out = aligned_empty(numel, dtype)
        store.read("k", out).result()
        assert bits_equal(out, src)
        assert store._staging.allocated == (0 if numel * dtype.itemsize % ALIGNMENT == 0 else 1)


def test_read_never_writes_past_out(store):
    """`out` aligned but not a multiple of ALIGNMENT bytes, inside a larger buffer: the bytes after it survive."""
    src = rand(1000, torch.float32)
    store.write("k", src).result()
    base = aligned_empty(2048, torch.float32)
    base.fill_(7.0)
    store.read("k", base[:1000]).result()
    assert bits_equal(base[:1000], src)
    assert torch.all(base[1000:] == 7.0)


def test_async_overlap_and_same_key_order(tmp_path):
    store = SwapStore(tmp_path / "s", thread_count=4, block_size=256 * 1024)
    try:
        srcs = [rand(2_000_000, torch.float32, seed=i) for i in range(6)]
        writes = [store.write(f"k{i}", t) for i, t in enumerate(srcs)]
        assert not all(f.done() for f in writes)  # write() returned before the I/O finished
        outs = [torch.empty(2_000_000) for _ in srcs]
        reads = [store.read(f"k{i}", o) for i, o in enumerate(outs)]  # queued behind their writes
        # Same key, submitted back to back: the first read sees the first value, the second the second.
        first, second = rand(1_000_001, torch.float32, 10), rand(1_000_001, torch.float32, 11)
        o1, o2 = torch.empty(1_000_001), torch.empty(1_000_001)
        chain = [store.write("same", first), store.read("same", o1), store.write("same", second),
                 store.read("same", o2)]
        for f in writes + reads + chain:
            f.result(timeout=60)
        assert all(bits_equal(o, s) for o, s in zip(outs, srcs))
        assert bits_equal(o1, first) and bits_equal(o2, second)
        assert store.stats["bytes_written"] == 6 * 8_000_000 + 2 * 4_000_004
        assert store.stats["bytes_read"] == 6 * 8_000_000 + 2 * 4_000_004
        assert store.stats["write_seconds"] > 0 and store.stats["read_seconds"] > 0
    finally:
        store.close()


def test_threads_submit_concurrently(store):
    errors = []

    def worker(i: int) -> None:
        try:
            for j in range(5):
                src = rand(50_000 + i, torch.bfloat16, seed=i * 10 + j)
                store.write(f"t{i}", src)
                out = torch.empty_like(src)
                store.read(f"t{i}", out).result()
                assert bits_equal(out, src)
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors


def test_overwrite_and_size_mismatch(store):
    store.write("k", rand(3_000_001, torch.float32)).result()
    small = rand(12345, torch.bfloat16, seed=1)
    store.write("k", small).result()
    assert store.nbytes("k") == 24690 and store.keys() == ["k"]
    assert os.path.getsize(store._path("k")) == 7 * 4096  # the larger old file was cut down
    out = torch.empty(12345, dtype=torch.bfloat16)
    store.read("k", out).result()
    assert bits_equal(out, small)
    with pytest.raises(SwapError, match=r"has 49380 bytes .* but 24690 bytes were written"):
        store.read("k", torch.empty(12345))


def test_empty_tensor(store):
    store.write("e", torch.empty(0, dtype=torch.bfloat16)).result()
    assert store.nbytes("e") == 0 and os.path.getsize(store._path("e")) == 0
    out = torch.empty(0, dtype=torch.bfloat16)
    assert store.read("e", out).result() is out


def test_missing_key(store):
    with pytest.raises(SwapError, match=r"'nope' was never written .* write it before reading it"):
        store.read("nope", torch.empty(4))
    with pytest.raises(SwapError, match="'nope'"):
        store.nbytes("nope")
    with pytest.raises(SwapError, match="'nope'"):
        store.remove("nope")


def test_remove_keys_and_odd_names(store):
    names = ["a/b c", "fp32.master/part0", "x" * 300]
    for n in names:
        store.write(n, torch.ones(10)).result()
    assert sorted(store.keys()) == sorted(names)
    assert len(os.listdir(store.directory)) == 3
    store.remove("a/b c")
    assert "a/b c" not in store.keys() and len(os.listdir(store.directory)) == 2


def test_bad_arguments(tmp_path):
    with pytest.raises(ValueError, match="block_size must be a positive multiple of 4096"):
        SwapStore(tmp_path / "s", block_size=1000)
    with SwapStore(tmp_path / "s") as s:
        with pytest.raises(ValueError, match=r"not contiguous .* t.contiguous\(\)"):
            s.write("k", torch.ones(4, 4).t())


def test_close_removes_files(tmp_path):
    s = SwapStore(tmp_path / "new")
    futs = [s.write(f"k{i}", torch.ones(100_000)) for i in range(3)]
    s.close()  # waits for the pending writes first
    assert all(f.done() and f.exception() is None for f in futs)
    assert not (tmp_path / "new").exists()  # it created the directory, so it removes it
    with pytest.raises(SwapError, match="closed"):
        s.write("k", torch.ones(1))
    s.close()  # twice is harmless

    keep = tmp_path / "existing"
    keep.mkdir()
    (keep / "other.txt").write_text("not the store's")
    s = SwapStore(keep)
    s.write("k", torch.ones(10)).result()
    s.close(remove_files=False)
    assert sorted(os.listdir(keep)) == ["k.swap", "other.txt"]
    s = SwapStore(keep)
    s.write("j", torch.ones(10)).result()
    s.close()
    assert sorted(os.listdir(keep)) == ["k.swap", "other.txt"]  # only its own files go


def test_buffered_mode(tmp_path):
    with SwapStore(tmp_path / "b", direct=False) as s:
        assert s.direct is False
        for numel in SIZES[:3]:
            src = rand(numel, torch.float16, seed=numel)[1:]
            s.write("k", src).result()
            assert os.path.getsize(s._path("k")) == src.nbytes  # no padding without O_DIRECT
            out = torch.empty_like(src)
            s.read("k", out).result()
            assert bits_equal(out, src)


@pytest.fixture
def mounted(tmp_path):
    """mounted(fstype, options): a real small filesystem under tmp_path (mounting needs root, else skip)."""
    points = []

    def mount(fstype: str, options: str = "") -> str:
        where = tmp_path / f"{fstype}{len(points)}"
        where.mkdir()
        cmd = ["mount", "-t", fstype, *(["-o", options] if options else []), fstype, str(where)]
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode != 0:
            pytest.skip(f"cannot mount {fstype} here: {done.stderr.strip()}")
        points.append(where)
        return str(where)

    yield mount
    for where in points:
        subprocess.run(["umount", "-l", str(where)], check=False)


def test_filesystem_without_o_direct_falls_back_once(mounted, caplog):
    """ramfs refuses O_DIRECT (EINVAL at open): buffered I/O, one warning, same results."""
    where = mounted("ramfs")
    with caplog.at_level("WARNING", logger="rayzero.offload.swap_store"):
        s = SwapStore(os.path.join(where, "swap"))
    try:
        assert s.direct is False
        warnings = [r for r in caplog.records if "refuses O_DIRECT" in r.getMessage()]
        assert len(warnings) == 1 and where in warnings[0].getMessage()
        for numel in SIZES[:3]:
            src = rand(numel, torch.bfloat16, seed=numel)
            s.write("k", src).result()
            out = torch.empty_like(src)
            s.read("k", out).result()
            assert bits_equal(out, src)
        assert len([r for r in caplog.records if "refuses O_DIRECT" in r.getMessage()]) == 1
    finally:
        s.close()
    assert os.listdir(where) == []  # the probe file is gone too


def test_real_enospc(mounted):
    """A 2 MiB tmpfs filling up: SwapFullError, earlier keys intact, and an in-place rewrite needs no space."""
    where = mounted("tmpfs", "size=2m")
    s = SwapStore(where)
    try:
        small = rand(100_000, torch.float32)  # 400 KB
        s.write("small", small).result()
        with pytest.raises(SwapFullError) as e:
            s.write("big", torch.ones(1 << 20)).result()  # 4 MiB
        msg = str(e.value)
        assert e.value.errno == errno.ENOSPC and "No space left on device" in msg
        assert f"needs {4 << 20} bytes on {where}" in msg and "bytes free" in msg
        assert f"free space on {where} or point nvme_path at a larger disk" in msg
        assert s.keys() == ["small"] and sorted(os.listdir(where)) == ["small.swap"]
        fd = os.open(os.path.join(where, "filler"), os.O_CREAT | os.O_WRONLY)  # something else takes the rest
        with pytest.raises(OSError, match="No space left"):
            while True:
                os.write(fd, b"\0" * 4096)
        os.close(fd)
        s.write("small", small + 1).result()  # same size: overwritten in place
        out = torch.empty(100_000)
        s.read("small", out).result()
        assert bits_equal(out, small + 1)
    finally:
        s.close()


def test_free_space(store, tmp_path):
    free = free_bytes(tmp_path)
    assert abs(free - shutil.disk_usage(tmp_path).free) < 1 << 30
    assert abs(free_bytes(tmp_path / "does" / "not" / "exist") - free) < 1 << 30
    store.check_free_space(1)
    with pytest.raises(SwapFullError) as e:
        store.check_free_space(free + (1 << 40))
    msg = str(e.value)
    assert store.directory in msg and str(free + (1 << 40)) in msg and "free" in msg
    assert f"free space on {store.directory} or point nvme_path at a larger disk" in msg
    assert isinstance(e.value, OSError) and e.value.errno == errno.ENOSPC
    back = pickle.loads(pickle.dumps(e.value))  # as a Ray worker's error reaches the driver
    assert type(back) is SwapFullError and str(back) == msg and back.errno == errno.ENOSPC


_FULL_SCRIPT = r"""
import json, resource, signal, sys, torch
from rayzero.offload.swap_store import SwapStore, SwapError, SwapFullError
s = SwapStore(sys.argv[1], block_size=1 << 20, queue_depth=1)  # one 1 MiB block per syscall
small, big = torch.arange(100_000, dtype=torch.float32), torch.randn(1 << 20)  # 400 KB and 4 MiB
s.write("small", small).result()
s.write("big", big).result()
# Files may not grow past 1 MiB from here on; ignoring SIGXFSZ turns the kill into EFBIG from the kernel.
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, resource.RLIM_INFINITY))
res = {}
for name, key, t in (("new", "new", torch.ones(1 << 20)), ("overwrite", "big", big + 1)):
    try:
        s.write(key, t).result()
        res[name] = "no error"
    except SwapFullError as e:
        res[name] = str(e)
out = torch.empty(100_000)
s.read("small", out).result()
res["small_intact"] = bool(torch.equal(out, small))
res["keys"] = sorted(s.keys())
try:
    s.read("big", torch.empty(1 << 20))
except SwapError as e:
    res["read_failed_key"] = str(e)
s.close()
print(json.dumps(res))
"""


def test_disk_full_is_swap_full_error(tmp_path):
    """A real EFBIG from the kernel (RLIMIT_FSIZE in a subprocess): SwapFullError, other keys intact."""
    d = tmp_path / "full"
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    proc = subprocess.run([sys.executable, "-c", _FULL_SCRIPT, str(d)], capture_output=True, text=True,
                          timeout=60, cwd=repo, env={**os.environ, "PYTHONPATH": repo})
    assert proc.returncode == 0, proc.stderr
    res = json.loads(proc.stdout.strip().splitlines()[-1])
    for name in ("new", "overwrite"):  # at fallocate (a new file), at a chunk's pwrite (in place)
        msg = res[name]
        assert "File too large" in msg and "ulimit -f" in msg, msg
        assert f"needs {4 << 20} bytes on {d}" in msg and "bytes free" in msg, msg
        assert f"free space on {d} or point nvme_path at a larger disk" in msg, msg
    assert "bytes 1048576..2097152" in res["overwrite"]  # the first chunk past the limit
    assert res["small_intact"] is True
    assert res["keys"] == ["small"]  # both failed writes dropped their keys
    assert "'big' has no data: its last write failed" in res["read_failed_key"]
    assert not d.exists()  # close() still cleaned up
