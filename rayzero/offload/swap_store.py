"""The NVMe swap store: tensors written to and read back from files with O_DIRECT on a thread pool.

The engine keeps fp32 optimizer state (master weights, Adam moments) here between optimizer steps. Each key
is one file in the store's directory. I/O is split into chunks of whole ``block_size`` blocks (up to
``queue_depth`` of them), one ``os.pwritev``/``os.preadv`` each, run by ``thread_count`` worker threads;
the syscalls release the GIL, so the disk works while Python computes.

O_DIRECT needs the buffer address, the file offset and the length all aligned to ``ALIGNMENT``. A tensor
made by :func:`aligned_empty` is used as the I/O buffer itself (but for a read's partial last block, so
bytes past ``out`` are never touched); any other tensor goes through staging buffers from a bounded pool
(at most ``queue_depth`` of ``block_size`` bytes). Files are padded to a multiple of ``ALIGNMENT``; the
true byte size of each key is recorded and reads are trimmed to it.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import ctypes
import errno
import hashlib
import logging
import mmap
import os
import threading
import time
from dataclasses import dataclass, field
from typing import NamedTuple
from urllib.parse import quote

import torch

logger = logging.getLogger(__name__)

ALIGNMENT = 4096
_FULL_ERRNOS = (errno.ENOSPC, errno.EFBIG, errno.EDQUOT)
_IOV_MAX = 1024  # buffers per preadv/pwritev on Linux


class SwapError(OSError):
    """A swap-store I/O failure. The message names the file, the operation and the fix."""

    def __init__(self, message: str, err: int | None = None, filename: str | None = None):
        super().__init__(message)
        self.message = message
        self.errno = err
        self.filename = filename

    def __str__(self) -> str:  # OSError would print "[Errno N] strerror: filename" instead
        return self.message

    def __reduce__(self):  # keep errno and filename across pickling (a Ray worker's error reaches the driver)
        return type(self), (self.message, self.errno, self.filename)


class SwapFullError(SwapError):
    """The swap directory's disk is full (ENOSPC, EDQUOT), a file hit a size limit (EFBIG), or a
    free-space check failed."""


def _round_up(n: int, a: int = ALIGNMENT) -> int:
    return -(-n // a) * a


def aligned_empty(numel: int, dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised 1-D CPU tensor whose data starts on an ``ALIGNMENT`` boundary and whose backing
    memory extends to the next ``ALIGNMENT`` multiple, so the store does O_DIRECT I/O straight from/into it.

    The memory is an anonymous mapping of its own (page-aligned and zero-filled by the kernel), not a block of
    the malloc heap: swap buffers live for many steps, and a long-lived block in the heap keeps the freed
    step buffers around it from ever going back to the OS (the heap can only shrink from its top).  Freeing
    the tensor unmaps it.
    """
    if numel < 0:
        raise ValueError(f"aligned_empty: numel must be >= 0, got {numel}")
    nbytes = numel * dtype.itemsize
    padded = _round_up(nbytes)
    if padded == 0:
        return torch.empty(0, dtype=dtype)
    region = mmap.mmap(-1, padded, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    buf = torch.frombuffer(region, dtype=torch.uint8)  # keeps ``region`` alive while any view of it lives
    assert buf.data_ptr() % ALIGNMENT == 0, "anonymous mappings are page-aligned"
    return buf[:nbytes].view(dtype)


def free_bytes(directory: str | os.PathLike) -> int:
    """Free bytes (for an unprivileged user) on the filesystem that holds ``directory``; a directory that
    does not exist yet is looked up through its nearest existing parent."""
    probe = os.path.abspath(os.fspath(directory))
    while not os.path.exists(probe):
        parent = os.path.dirname(probe)
        if parent == probe:
            break
        probe = parent
    st = os.statvfs(probe)
    return st.f_bavail * st.f_frsize


def _unlink(path: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)


def _cbuf(ptr: int, n: int) -> ctypes.Array:
    # A writable buffer-protocol view of raw memory: os.pwritev/os.preadv take it without copying.
    return (ctypes.c_char * n).from_address(ptr)


def _io(write: bool, fd: int, segs: list[tuple[int, int]], offset: int) -> None:
    """Move the memory segments ``(ptr, length)``, back to back in the file from ``offset``, with one
    vectored syscall (retried after a short count)."""
    end = offset + sum(n for _, n in segs)
    while segs:
        bufs = [_cbuf(p, n) for p, n in segs]
        done = os.pwritev(fd, bufs, offset) if write else os.preadv(fd, bufs, offset)
        if done <= 0:  # a read past the end of the file (a write never returns 0 for a non-empty buffer)
            raise OSError(errno.EIO, f"file ends at byte {offset}, expected {end} bytes")
        offset += done
        while segs and done >= segs[0][1]:
            done -= segs.pop(0)[1]
        if done:
            segs[0] = (segs[0][0] + done, segs[0][1] - done)


class _StagingPool:
    """At most ``count`` aligned buffers of ``size`` bytes, made on first use; ``acquire`` blocks until the
    buffers it asks for are free, which bounds the host memory staging takes."""

    def __init__(self, size: int, count: int):
        self.size, self.count, self.allocated, self.in_use = size, count, 0, 0
        self._cond, self._free = threading.Condition(), []

    def acquire(self, k: int) -> list[torch.Tensor]:
        with self._cond:  # all k at once: a thread holding some while waiting for more could deadlock
            self._cond.wait_for(lambda: self.count - self.in_use >= k)
            self.in_use += k
            bufs = [self._free.pop() for _ in range(min(k, len(self._free)))]
            self.allocated += k - len(bufs)
        return bufs + [aligned_empty(self.size, torch.uint8) for _ in range(k - len(bufs))]

    def release(self, bufs: list[torch.Tensor]) -> None:
        with self._cond:
            self._free.extend(bufs)
            self.in_use -= len(bufs)
            self._cond.notify_all()


class _Chunk(NamedTuple):
    offset: int  # byte offset in the tensor and in the file
    length: int  # bytes of file I/O (padded to whole blocks under O_DIRECT)
    valid: int  # bytes of the tensor it covers (<= length)
    staged: bool  # through a staging buffer rather than straight from/into the tensor


@dataclass(eq=False)
class _Op:
    kind: str  # "write" or "read"
    key: str
    path: str
    tensor: torch.Tensor  # held so the memory outlives the I/O
    nbytes: int
    file_bytes: int
    chunks: list[_Chunk]
    future: concurrent.futures.Future = field(default_factory=concurrent.futures.Future)
    fd: int = -1
    remaining: int = 0
    error: BaseException | None = None
    lock: threading.Lock = field(default_factory=threading.Lock)


class SwapStore:
    """Tensors in files, one per key, written and read asynchronously (see the module docstring).

    Operations on one key run in the order they were submitted (a read waits for an earlier write of the
    same key); operations on different keys overlap. Do not modify a tensor while its write is pending, nor
    use ``out`` before its read's future is done.
    """

    def __init__(self, directory: str | os.PathLike, *, block_size: int = 1 << 20, queue_depth: int = 8,
                 thread_count: int = 1, direct: bool = True):
        if block_size <= 0 or block_size % ALIGNMENT or queue_depth < 1 or thread_count < 1:
            raise ValueError(f"SwapStore: block_size must be a positive multiple of {ALIGNMENT} bytes (got "
                             f"{block_size}, e.g. 1048576), queue_depth and thread_count >= 1 (got "
                             f"{queue_depth}, {thread_count})")
        self.directory = os.path.abspath(os.fspath(directory))
        self._created_dir = not os.path.isdir(self.directory)
        try:
            os.makedirs(self.directory, exist_ok=True)
        except OSError as e:
            raise SwapError(f"cannot create swap directory {self.directory}: {e.strerror}; point nvme_path "
                            f"at a writable directory on a local disk", e.errno, self.directory) from e
        self.block_size, self.queue_depth, self.thread_count = block_size, queue_depth, thread_count
        self.direct = direct and self._probe_direct()
        self.stats: dict = {"bytes_written": 0, "bytes_read": 0, "write_seconds": 0.0, "read_seconds": 0.0}
        self._lock = threading.Lock()
        self._sizes: dict[str, int] = {}  # key -> true byte size of its latest (submitted) write
        self._failed: dict[str, str] = {}  # key -> why its last write failed
        self._tail: dict[str, concurrent.futures.Future] = {}  # key -> future of its latest op
        self._last_write: dict[str, concurrent.futures.Future] = {}  # only its failure marks the key failed
        self._staging = _StagingPool(block_size, queue_depth)
        self._pool = concurrent.futures.ThreadPoolExecutor(thread_count, thread_name_prefix="rayzero-swap")
        self._closed = False

    def _probe_direct(self) -> bool:
        """Whether this filesystem takes O_DIRECT: open and write one aligned block in a probe file."""
        probe = os.path.join(self.directory, f".rayzero-probe-{os.getpid()}-{id(self)}")
        buf = aligned_empty(ALIGNMENT, torch.uint8)
        try:
            fd = os.open(probe, os.O_CREAT | os.O_WRONLY | os.O_DIRECT, 0o600)
            try:
                _io(True, fd, [(buf.data_ptr(), ALIGNMENT)], 0)
            finally:
                os.close(fd)
            return True
        except OSError as e:
            if e.errno != errno.EINVAL:
                raise SwapError(f"cannot write a probe file {probe}: {e.strerror}; point nvme_path at a "
                                f"writable directory on a local disk", e.errno, probe) from e
            logger.warning("swap directory %s refuses O_DIRECT (%s): the swap store uses buffered I/O "
                           "there, which goes through the page cache (slower, takes host memory); point "
                           "nvme_path at a local ext4/xfs disk for direct I/O", self.directory, e.strerror)
            return False
        finally:
            _unlink(probe)

    def write(self, key: str, tensor: torch.Tensor) -> concurrent.futures.Future:
        """Write ``tensor`` (contiguous, CPU) under ``key``, replacing any earlier value. The future's
        result is None; it fails with SwapError (SwapFullError when the disk is full)."""
        nbytes = self._check_tensor("write", key, tensor)
        return self._submit(_Op("write", key, self._path(key), tensor, nbytes, self._file_bytes(nbytes),
                                self._plan(tensor, nbytes, "write")))

    def read(self, key: str, out: torch.Tensor) -> concurrent.futures.Future:
        """Fill ``out`` (contiguous, CPU, same byte size as written) with the value of ``key``. The future's
        result is ``out``."""
        nbytes = self._check_tensor("read", key, out)
        with self._lock:
            if key not in self._sizes:
                raise self._missing(key)
            written = self._sizes[key]
        if nbytes != written:
            raise SwapError(f"swap read of key {key!r}: `out` has {nbytes} bytes ({out.numel()} x {out.dtype}) "
                            f"but {written} bytes were written; pass an `out` of the written size and dtype",
                            filename=self._path(key))
        return self._submit(_Op("read", key, self._path(key), out, nbytes, self._file_bytes(nbytes),
                                self._plan(out, nbytes, "read")))

    def nbytes(self, key: str) -> int:
        with self._lock:
            if key not in self._sizes:
                raise self._missing(key)
            return self._sizes[key]

    def keys(self) -> list[str]:
        with self._lock:
            return list(self._sizes)

    def remove(self, key: str) -> None:
        """Wait for the key's pending I/O, then delete its file."""
        with self._lock:
            if key not in self._sizes and key not in self._failed:
                raise self._missing(key)
            pending = self._tail.get(key)
        concurrent.futures.wait([pending] if pending else [])
        with self._lock:
            self._sizes.pop(key, None)
            self._failed.pop(key, None)
            self._last_write.pop(key, None)
        _unlink(self._path(key))

    def check_free_space(self, needed_bytes: int) -> None:
        free = free_bytes(self.directory)
        if needed_bytes > free:
            raise SwapFullError(f"swap directory {self.directory} needs {needed_bytes} bytes "
                                f"({needed_bytes / 2**30:.2f} GiB) but its disk has {free} bytes "
                                f"({free / 2**30:.2f} GiB) free; free space on {self.directory} or point "
                                f"nvme_path at a larger disk", errno.ENOSPC, self.directory)

    def close(self, remove_files: bool = True) -> None:
        """Wait for all pending I/O, stop the worker threads and (by default) delete the store's files, and
        its directory if the store created it and it is now empty. Closing twice is harmless."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            pending = list(self._tail.values())
        concurrent.futures.wait(pending)
        self._pool.shutdown(wait=True)
        if remove_files:
            for key in list(self._sizes):
                _unlink(self._path(key))
            self._sizes.clear()
            self._last_write.clear()
            if self._created_dir:
                with contextlib.suppress(OSError):  # not empty: it holds files that are not ours
                    os.rmdir(self.directory)

    def __enter__(self) -> SwapStore:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _path(self, key: str) -> str:
        name = quote(key, safe="-_.")
        if len(name) > 200:  # keep under the 255-byte file-name limit
            return os.path.join(self.directory, hashlib.sha1(key.encode()).hexdigest() + ".hswap")
        return os.path.join(self.directory, name + ".swap")

    def _missing(self, key: str) -> SwapError:
        if key in self._failed:
            return SwapError(f"swap key {key!r} has no data: its last write failed ({self._failed[key]}); "
                             f"write it again", filename=self._path(key))
        return SwapError(f"swap key {key!r} was never written to the store at {self.directory} "
                         f"({len(self._sizes)} keys are); write it before reading it", filename=self._path(key))

    def _check_tensor(self, what: str, key: str, t: torch.Tensor) -> int:
        if not isinstance(key, str) or not key:
            raise ValueError(f"swap {what}: key must be a non-empty string, got {key!r}")
        if t.device.type != "cpu":
            raise ValueError(f"swap {what} of key {key!r}: tensor is on {t.device}; copy it into a CPU tensor "
                             f"(ideally one from aligned_empty) first")
        if not t.is_contiguous():
            raise ValueError(f"swap {what} of key {key!r}: tensor is not contiguous (shape {tuple(t.shape)}, "
                             f"stride {t.stride()}); pass t.contiguous()")
        return t.numel() * t.element_size()

    def _file_bytes(self, nbytes: int) -> int:
        return _round_up(nbytes) if self.direct else nbytes  # O_DIRECT lengths are whole blocks

    def _plan(self, t: torch.Tensor, nbytes: int, kind: str) -> list[_Chunk]:
        """Split the I/O into chunks, one syscall each: direct ones of ``queue_depth`` blocks, which the
        kernel splits into block requests kept in flight together (as an aio queue of ``queue_depth``
        requests would); staged ones of ``queue_depth // thread_count`` blocks, one staging buffer per block.
        Few, large syscalls also mean few GIL hand-offs (see _run_chunk)."""
        span = self.block_size * self.queue_depth
        if not self.direct:  # buffered I/O takes any buffer: straight from/into the tensor, unpadded
            return [_Chunk(o, min(span, nbytes - o), min(span, nbytes - o), False) for o in range(0, nbytes, span)]
        padded = _round_up(nbytes)
        if t.data_ptr() % ALIGNMENT:  # unaligned start: every chunk is staged
            # A thread holds its share of the staging buffers for one vectored syscall (at most IOV_MAX).
            step = self.block_size * max(1, min(self.queue_depth // self.thread_count, _IOV_MAX))
            return [_Chunk(o, min(step, padded - o), min(step, nbytes - o), True) for o in range(0, padded, step)]
        body = nbytes - nbytes % ALIGNMENT
        chunks = [_Chunk(o, min(span, body - o), min(span, body - o), False) for o in range(0, body, span)]
        if body < nbytes:
            # The last partial block. A write may read past the tensor when its storage goes on (as with
            # aligned_empty); a read must never write past `out`, so it bounces through staging.
            st = t.untyped_storage()
            inside = st.data_ptr() + st.nbytes() >= t.data_ptr() + padded
            chunks.append(_Chunk(body, ALIGNMENT, nbytes - body, not (kind == "write" and inside)))
        return chunks

    def _submit(self, op: _Op) -> concurrent.futures.Future:
        op.future.set_running_or_notify_cancel()  # the store's futures cannot be cancelled
        with self._lock:
            if self._closed:
                raise SwapError(f"swap {op.kind} of key {op.key!r}: the store at {self.directory} is closed; "
                                f"create a new SwapStore", filename=op.path)
            if op.kind == "write":  # reads submitted from now on expect this size
                self._sizes[op.key] = op.nbytes
                self._failed.pop(op.key, None)
                self._last_write[op.key] = op.future
            prev = self._tail.get(op.key)
            self._tail[op.key] = op.future
        op.future.add_done_callback(lambda f, k=op.key: self._clear_tail(k, f))
        if prev is None:
            self._start(op)
        else:  # same key: run after the earlier op (runs at once if that one is done)
            prev.add_done_callback(lambda _f: self._start(op))
        return op.future

    def _clear_tail(self, key: str, fut: concurrent.futures.Future) -> None:
        with self._lock:
            if self._tail.get(key) is fut:
                del self._tail[key]

    def _start(self, op: _Op) -> None:
        try:
            if op.kind == "write":
                op.fd = os.open(op.path, os.O_CREAT | os.O_RDWR | (os.O_DIRECT if self.direct else 0), 0o600)
                if os.fstat(op.fd).st_size < op.file_bytes:
                    # Reserve the space up front: a full disk fails here, before any data moves, and the
                    # writes then land inside the file (no size change per chunk).
                    try:
                        os.posix_fallocate(op.fd, 0, op.file_bytes)
                    except OSError as e:
                        if e.errno in _FULL_ERRNOS:
                            raise
                        # Filesystem without fallocate: only an optimisation, the writes allocate instead.
            else:
                with self._lock:
                    failed = self._failed.get(op.key)
                if failed is not None:
                    raise SwapError(f"swap read of key {op.key!r}: an earlier write of it failed ({failed}); "
                                    f"write it again", filename=op.path)
                op.fd = os.open(op.path, os.O_RDONLY | (os.O_DIRECT if self.direct else 0))
        except BaseException as e:  # noqa: BLE001 - every failure must reach the future
            op.error = e
            self._finish(op)
            return
        if not op.chunks:
            self._finish(op)
            return
        op.remaining = len(op.chunks)
        for ch in op.chunks:  # the pool is still up: close() waits for every op before shutting it
            self._pool.submit(self._run_chunk, op, ch)

    def _run_chunk(self, op: _Op, ch: _Chunk) -> None:
        # On a worker thread. The syscall releases the GIL; taking it back afterwards can wait up to
        # sys.getswitchinterval() (5 ms) while another thread runs Python, hence few, large direct chunks.
        t0 = time.perf_counter()
        done = 0
        try:
            if op.error is None:  # after a failed chunk the rest of the op is skipped
                mem = op.tensor.data_ptr() + ch.offset
                if not ch.staged:
                    _io(op.kind == "write", op.fd, [(mem, ch.length)], ch.offset)
                else:
                    bs = self.block_size
                    bufs = self._staging.acquire(-(-ch.length // bs))
                    try:  # block i of the chunk <-> staging buffer i; the vector syscall moves them all
                        segs = [(b.data_ptr(), min(bs, ch.length - i * bs)) for i, b in enumerate(bufs)]
                        copies = [(p, mem + i * bs, max(0, min(bs, ch.valid - i * bs)))
                                  for i, (p, _) in enumerate(segs)]
                        if op.kind == "write":
                            for (p, n), (_, m, v) in zip(segs, copies):
                                ctypes.memmove(p, m, v)
                                ctypes.memset(p + v, 0, n - v)  # padding past the tensor's end
                            _io(True, op.fd, segs, ch.offset)
                        else:
                            _io(False, op.fd, list(segs), ch.offset)
                            for p, m, v in copies:
                                ctypes.memmove(m, p, v)
                    finally:
                        self._staging.release(bufs)
                done = ch.valid
        except BaseException as e:  # noqa: BLE001
            err: BaseException = self._translate(op, ch, e) if isinstance(e, OSError) else e
            with op.lock:
                op.error = op.error or err
        finally:
            dt = time.perf_counter() - t0
            with self._lock:
                self.stats["write_seconds" if op.kind == "write" else "read_seconds"] += dt
                self.stats["bytes_written" if op.kind == "write" else "bytes_read"] += done
            with op.lock:
                op.remaining -= 1
                last = op.remaining == 0
            if last:
                self._finish(op)

    def _finish(self, op: _Op) -> None:
        if op.fd >= 0:
            try:
                if op.error is None and op.kind == "write" and os.fstat(op.fd).st_size > op.file_bytes:
                    os.ftruncate(op.fd, op.file_bytes)  # a shorter value overwrote a longer one
            except OSError as e:
                op.error = e
            os.close(op.fd)
        tensor, op.tensor = op.tensor, None  # the store keeps no reference to the caller's memory
        if op.error is None:
            op.future.set_result(tensor if op.kind == "read" else None)
            return
        err = self._translate(op, None, op.error) if isinstance(op.error, OSError) else op.error
        if op.kind == "write":
            # The file holds neither the old nor the new value: drop it (frees space on a full disk).
            with self._lock:
                if self._last_write.get(op.key) is op.future:
                    self._sizes.pop(op.key, None)
                    self._failed[op.key] = str(err)
            _unlink(op.path)
        op.future.set_exception(err)

    def _translate(self, op: _Op, ch: _Chunk | None, e: OSError) -> SwapError:
        if isinstance(e, SwapError):
            return e
        where = f"swap {op.kind} of key {op.key!r} ({op.path}"
        where += f", bytes {ch.offset}..{ch.offset + ch.length})" if ch is not None else ")"
        if e.errno in _FULL_ERRNOS:
            limit = " (the process's file-size limit, `ulimit -f`, or the filesystem's largest file size)" \
                if e.errno == errno.EFBIG else ""
            err: SwapError = SwapFullError(
                f"{where} failed: {e.strerror}{limit}; the write needs {op.file_bytes} bytes on "
                f"{self.directory}, which has {free_bytes(self.directory)} bytes free; free space on "
                f"{self.directory} or point nvme_path at a larger disk", e.errno, op.path)
        elif e.errno == errno.EINVAL and self.direct:
            err = SwapError(f"{where} failed: O_DIRECT rejected the I/O (EINVAL); buffer, offset and length "
                            f"are {ALIGNMENT}-byte aligned, so this disk needs a larger alignment; construct "
                            f"the SwapStore with direct=False there", e.errno, op.path)
        else:
            err = SwapError(f"{where} failed: {e.strerror or e}; check that {self.directory} is a writable "
                            f"local disk and that the store's files were not changed by anything else",
                            e.errno, op.path)
        err.__cause__ = e
        return err
