"""Fragment files written with direct I/O (rayzero/checkpoint/direct_io.py): the same bytes as a buffered
write, none of them in the page cache afterwards, and a full disk (a real EFBIG from the kernel) that fails
the save with a clear error and loses nothing already saved."""

from __future__ import annotations

import ctypes
import errno
import fcntl
import mmap
import os
import random
import resource
import signal
import tempfile

import pytest
import torch
import torch.nn.functional as F
import xxhash

import rayzero
from distributed import run_distributed
from rayzero.checkpoint import direct_io
from rayzero.checkpoint.format import CheckpointError

CHUNK = direct_io.CHUNK
# pytest's tmp_path lies under the temp directory: on a disk here (ext4). Where it is in memory (tmpfs) saves
# are written buffered by design, and the page-cache checks below have nothing to check.
ON_DISK = not direct_io._in_memory_fs(tempfile.gettempdir())
needs_disk = pytest.mark.skipif(not ON_DISK, reason="the temp directory is in memory (tmpfs): no page cache to bypass")
_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]


def _cached_pages(path: str) -> tuple[int, int]:
    """(pages of ``path`` in the page cache, pages in the file), by mincore on a mapping that reads nothing."""
    size = os.path.getsize(path)
    pages = -(-size // mmap.PAGESIZE)
    fd = os.open(path, os.O_RDONLY)
    try:
        addr = _libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        assert addr not in (None, ctypes.c_void_p(-1).value), ctypes.get_errno()
        try:
            vec = (ctypes.c_ubyte * pages)()
            assert _libc.mincore(addr, size, vec) == 0, ctypes.get_errno()
            return sum(b & 1 for b in bytes(vec)), pages
        finally:
            _libc.munmap(addr, size)
    finally:
        os.close(fd)


@pytest.mark.parametrize("size", [0, 1, 4095, 4096, CHUNK - 1, CHUNK, CHUNK + 1, 2 * CHUNK + 12345])
def test_direct_file_holds_exactly_the_bytes_written(tmp_path, size):
    data = os.urandom(size)
    path = str(tmp_path / "f")
    f = direct_io.DirectFile(path)
    if ON_DISK:
        assert f.direct and fcntl.fcntl(f.fd, fcntl.F_GETFL) & os.O_DIRECT  # /tmp takes O_DIRECT here
    rng, pos = random.Random(size), 0
    while pos < size:  # pieces of every size, as the Arrow writer hands them over
        n = min(size - pos, rng.choice([1, 7, 4096, 250_000, 3 << 20]))
        assert f.write(memoryview(data)[pos:pos + n]) == n
        pos += n
    f.close()
    assert f.closed and f.size == size
    with open(path, "rb") as g:
        assert g.read() == data  # the padding of the last block is cut off again


@needs_disk
def test_direct_writes_leave_the_page_cache_alone_and_buffered_ones_fill_it(tmp_path):
    data = os.urandom(3 * CHUNK + 5000)
    direct, buffered = str(tmp_path / "direct"), str(tmp_path / "buffered")
    f = direct_io.DirectFile(direct)
    f.write(data)
    f.close()
    with open(buffered, "wb") as g:
        g.write(data)
        g.flush()
        os.fsync(g.fileno())
    cached, pages = _cached_pages(direct)
    assert pages == -(-len(data) // mmap.PAGESIZE)
    assert cached <= 1, (cached, pages)  # at most the tail block the final truncate touched
    cached_b, _ = _cached_pages(buffered)
    assert cached_b == pages


def _write_past_a_size_limit(rank, world, path):
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, resource.RLIM_INFINITY))
    f = direct_io.DirectFile(path)
    err = None
    try:
        for _ in range(4):
            f.write(bytes(CHUNK))
        f.close()
    except OSError as e:
        err = e.errno
    fd_open = True
    try:
        os.fstat(f.fd)
    except OSError:
        fd_open = False
    return {"errno": err, "closed": f.closed, "fd_open": fd_open, "kept": len(direct_io._free_buffers),
            "size": os.path.getsize(path)}


def test_a_failed_write_is_raised_and_the_buffers_come_back(tmp_path):
    """EFBIG from the kernel (a file size limit, in a process of its own) surfaces at the next write or at
    close; the file descriptor is closed and the two buffers go back for the next save."""

    res, = run_distributed(_write_past_a_size_limit, 1, str(tmp_path / "big"), init_pg=False)
    assert res == {"errno": errno.EFBIG, "closed": True, "fd_open": False, "kept": 2, "size": 1 << 20}, res


# ---- through the engine ----------------------------------------------------------------------------------
def _engine():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 512), torch.nn.GELU(), torch.nn.Linear(512, 64))
    return rayzero.initialize(model, {"train_batch_size": 8, "zero_optimization": {"stage": 2},
                                      "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}})


def _train(engine, rank: int, steps: int) -> None:
    g = torch.Generator().manual_seed(7)
    for _ in range(steps):
        x = torch.randn(8, 64, generator=g)[rank * 4:(rank + 1) * 4]
        loss = F.mse_loss(engine(x), x)
        engine.backward(loss)
        engine.step()


def _file_hashes(d: str) -> dict[str, str]:
    out = {}
    for name in sorted(os.listdir(d)):
        if name.endswith(".arrow"):
            with open(os.path.join(d, name), "rb") as f:
                out[name] = xxhash.xxh3_64(f.read()).hexdigest()
    return out


def _direct_and_buffered(rank: int, world: int, root: str) -> dict:
    engine = _engine()
    _train(engine, rank, 2)
    os.environ[direct_io.ENV] = "0"
    engine.save_checkpoint(os.path.join(root, "buffered"), tag="t")
    os.environ[direct_io.ENV] = "1"
    engine.save_checkpoint(os.path.join(root, "direct"), tag="t")
    async_tag = engine.save_checkpoint(os.path.join(root, "direct_async"), tag="t", async_save=True)
    state = {k: v.clone() for k, v in engine.full_state_dict().items()}
    _train(engine, rank, 1)
    engine.load_checkpoint(os.path.join(root, "direct_async"), tag=async_tag)
    back = engine.full_state_dict()
    engine.destroy()
    return {"same_after_load": all(torch.equal(back[k], v) for k, v in state.items())}


def test_direct_and_buffered_saves_write_the_same_files_and_load_back(tmp_path):
    res = run_distributed(_direct_and_buffered, 2, str(tmp_path))
    assert all(r["same_after_load"] for r in res)
    if ON_DISK:
        cached, pages = _cached_pages(str(tmp_path / "direct" / "t" / "rank_00000.arrow"))  # before reading it
        assert cached <= 1 < pages  # written around the page cache
        cached_b, pages_b = _cached_pages(str(tmp_path / "buffered" / "t" / "rank_00000.arrow"))
        assert cached_b == pages_b
    buffered = _file_hashes(str(tmp_path / "buffered" / "t"))
    assert len(buffered) == 2
    assert _file_hashes(str(tmp_path / "direct" / "t")) == buffered
    assert _file_hashes(str(tmp_path / "direct_async" / "t")) == buffered


def _full_disk(rank: int, world: int, root: str) -> dict:
    engine = _engine()
    _train(engine, rank, 2)
    engine.save_checkpoint(root, tag="a")
    saved = {k: v.clone() for k, v in engine.full_state_dict().items()}
    _train(engine, rank, 1)
    file_bytes = os.path.getsize(os.path.join(root, "a", f"rank_{rank:05d}.arrow"))
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # the kernel's EFBIG instead of the signal's kill
    resource.setrlimit(resource.RLIMIT_FSIZE, (file_bytes // 2 // 4096 * 4096, resource.RLIM_INFINITY))
    error = None
    try:
        engine.save_checkpoint(root, tag="b")
    except CheckpointError as e:
        error = str(e)
    resource.setrlimit(resource.RLIMIT_FSIZE, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
    with open(os.path.join(root, "latest")) as f:
        latest = f.read().strip()
    engine.load_checkpoint(root)  # latest: "a"
    back = engine.full_state_dict()
    engine.save_checkpoint(root, tag="c")  # with room again, the next save works and clears the failed one
    engine.destroy()
    return {"error": error, "latest": latest, "file_bytes": file_bytes,
            "same": all(torch.equal(back[k], v) for k, v in saved.items()), "left": sorted(os.listdir(root))}


def test_a_full_disk_fails_the_save_clearly_and_loses_nothing(tmp_path):
    res = run_distributed(_full_disk, 2, str(tmp_path / "ckpt"))
    for r in res:
        assert r["file_bytes"] > 64 << 10  # the limit cuts a real file in half
        assert r["error"] is not None and "saving checkpoint 'b'" in r["error"], r
        assert "File too large" in r["error"] or "failed on another rank" in r["error"], r
        assert "previous one is intact" in r["error"] or "previous checkpoint (if any) is intact" in r["error"]
        assert r["latest"] == "a" and r["same"], r
    assert res[0]["left"] == ["a", "c", "latest"], res[0]


def test_direct_io_is_used_on_disks_only_and_can_be_turned_off(tmp_path, monkeypatch):
    monkeypatch.delenv(direct_io.ENV, raising=False)
    assert direct_io.enabled(str(tmp_path)) == ON_DISK  # ext4 here
    if os.path.isdir("/dev/shm"):  # tmpfs: its page cache is the storage, direct I/O would only add a copy
        assert not direct_io.enabled("/dev/shm")
    monkeypatch.setenv(direct_io.ENV, "0")
    assert not direct_io.enabled(str(tmp_path))


def _write_past_an_unaligned_limit(rank, world, path):
    """A limit inside a block: the direct write stops short of it, unaligned; the rest goes buffered and
    meets the kernel's real EFBIG (not an EINVAL of the unaligned retry)."""
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, ((1 << 20) + 1000, resource.RLIM_INFINITY))
    f = direct_io.DirectFile(path)
    try:
        f.write(bytes(3 * CHUNK))
        f.close()
    except OSError as e:
        return {"errno": e.errno, "closed": f.closed, "size": os.path.getsize(path)}
    return {"errno": None}


def test_an_unaligned_size_limit_still_reports_file_too_large(tmp_path):
    res, = run_distributed(_write_past_an_unaligned_limit, 1, str(tmp_path / "big"), init_pg=False)
    assert res["errno"] == errno.EFBIG and res["closed"], res
    assert res["size"] <= (1 << 20) + 1000, res
