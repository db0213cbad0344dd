"""A rank's fragment file written with direct I/O: bytes go from two aligned buffers straight to the disk,
not through the page cache.

A buffered write of a multi-GB checkpoint first allocates as many page-cache pages as the file has, copies
into them, and then the closing sync waits for their writeback. On a virtual machine whose host takes freed
guest memory back, those fresh pages cost the host's page faults too: on this project's VM a buffered 200 MB
file takes 0.05 s or 0.35 s to write depending on where its pages land. Direct I/O needs no new pages, leaves
the cache to the training job, and takes the same time every save (``python bench/bench_checkpoint.py``).

How: the writer copies what it is given into one of two ``CHUNK``-byte aligned buffers; a full buffer is
written with ``pwrite`` on a thread of its own while the caller fills the other. ``close()`` pads the last
block to the alignment, writes it, cuts the file back to its true size and syncs it. A filesystem that
refuses ``O_DIRECT`` at open or at the first write gets the same bytes buffered (logged once), and so does an
in-memory filesystem (tmpfs: its page cache is the storage). The two buffers are kept for the process's next
save (``2 * CHUNK`` bytes).

``RAYZERO_CHECKPOINT_DIRECT_IO=0`` turns direct writes off (buffered writes with early writeback instead,
``storage.HashingWriter``).
"""

from __future__ import annotations

import concurrent.futures
import errno
import fcntl
import logging
import os
import threading

import torch

from rayzero.offload.swap_store import ALIGNMENT, aligned_empty

logger = logging.getLogger("rayzero")

ENV = "RAYZERO_CHECKPOINT_DIRECT_IO"
CHUNK = 8 << 20  # bytes per write; a multiple of ALIGNMENT

_free_buffers: list[memoryview] = []  # kept between saves (at most two)
_free_lock = threading.Lock()
_warned: set[str] = set()


_TMPFS_MAGIC, _RAMFS_MAGIC = 0x01021994, 0x858458F6


def _in_memory_fs(directory: str) -> bool:
    """Whether ``directory`` is on tmpfs/ramfs (Linux ``statfs``), where the page cache is the storage and
    direct I/O would only add a copy."""
    import ctypes

    try:
        libc = ctypes.CDLL(None, use_errno=True)
        buf = ctypes.create_string_buffer(256)  # struct statfs; f_type is its first word
        if libc.statfs(os.fsencode(directory), buf) != 0:
            return False
        return ctypes.c_long.from_buffer(buf).value in (_TMPFS_MAGIC, _RAMFS_MAGIC)
    except (OSError, AttributeError):
        return False


def enabled(directory: str) -> bool:
    """Whether fragment files under ``directory`` are written with direct I/O: unless
    ``RAYZERO_CHECKPOINT_DIRECT_IO=0``, and not on an in-memory filesystem."""
    if os.environ.get(ENV, "1").strip().lower() in ("0", "false", "no", "off") or not hasattr(os, "O_DIRECT"):
        return False
    return not _in_memory_fs(directory)


def _take_buffer() -> memoryview:
    with _free_lock:
        if _free_buffers:
            return _free_buffers.pop()
    return memoryview(aligned_empty(CHUNK, torch.uint8).numpy())


def _give_back(buf: memoryview) -> None:
    with _free_lock:
        if len(_free_buffers) < 2:
            _free_buffers.append(buf)


def _refused(path: str, err: OSError) -> None:
    where = os.path.dirname(path)
    if where not in _warned:
        _warned.add(where)
        logger.info("checkpoint directory %s refuses direct I/O (%s): fragment files there are written buffered",
                    where, err)


class DirectFile:
    """A write-only file sink (``write``/``flush``/``close``) that writes with ``O_DIRECT``.

    Errors of the background write (a full disk, a file size limit) are raised by the next ``write`` or by
    ``close``, which then close the file; ``abandon()`` closes it without syncing after a failure elsewhere."""

    def __init__(self, path: str):
        self.path = path
        flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_CLOEXEC", 0)
        try:
            self.fd = os.open(path, flags | os.O_DIRECT, 0o644)
            self.direct = True
        except OSError as e:
            if e.errno != errno.EINVAL:
                raise
            _refused(path, e)
            self.fd = os.open(path, flags, 0o644)
            self.direct = False
        self.size = 0  # bytes written by the caller
        self._offset = 0  # bytes handed to the disk (whole chunks)
        self._fill = 0  # bytes in the current buffer
        self._bufs: list[memoryview] = []
        self._pending: list[concurrent.futures.Future | None] = [None, None]
        self._cur = 0
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="rayzero-ckpt-write")
        self.closed = False
        try:
            self._bufs = [_take_buffer(), _take_buffer()]
        except BaseException:
            self.abandon()
            raise

    # ---- the disk side (writer thread) -------------------------------------------------------------------
    def _pwrite(self, view: memoryview, offset: int) -> None:
        while len(view):
            try:
                n = os.pwrite(self.fd, view, offset)
            except OSError as e:
                if e.errno != errno.EINVAL or not self.direct:
                    raise
                # Accepted at open, refused at the first write (some filesystems), or a short write (a size
                # limit) left the rest unaligned: go on buffered, where the real error, if any, shows.
                if offset == 0:
                    _refused(self.path, e)
                fcntl.fcntl(self.fd, fcntl.F_SETFL, fcntl.fcntl(self.fd, fcntl.F_GETFL) & ~os.O_DIRECT)
                self.direct = False
                continue
            if n == 0:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), self.path)
            view, offset = view[n:], offset + n

    def _wait(self, i: int) -> None:
        fut, self._pending[i] = self._pending[i], None
        if fut is not None:
            fut.result()

    def _submit(self, length: int) -> None:
        i = self._cur
        self._pending[i] = self._pool.submit(self._pwrite, self._bufs[i][:length], self._offset)
        self._offset += length
        self._cur = i ^ 1
        self._fill = 0
        self._wait(self._cur)  # the other buffer's write is done before it is filled again

    # ---- the caller's side ----------------------------------------------------------------------------------
    def write(self, data) -> int:
        if self.closed:
            raise ValueError(f"write to closed file {self.path}")
        view = memoryview(data).cast("B")
        n, pos = view.nbytes, 0
        while pos < n:
            take = min(CHUNK - self._fill, n - pos)
            self._bufs[self._cur][self._fill:self._fill + take] = view[pos:pos + take]
            self._fill += take
            pos += take
            if self._fill == CHUNK:
                try:
                    self._submit(CHUNK)
                except BaseException:
                    self.abandon()
                    raise
        self.size += n
        return n

    def flush(self) -> None:
        """Nothing to do: a partial block can only be written at ``close()``."""

    def fileno(self) -> int:
        return self.fd

    def close(self) -> None:
        """Write what is left (padded to whole blocks), cut the file to its size, sync it, close it."""
        if self.closed:
            return
        try:
            if self._fill:
                pad = -self._fill % ALIGNMENT
                self._bufs[self._cur][self._fill:self._fill + pad] = bytes(pad)
                self._submit(self._fill + pad)
            self._wait(0)
            self._wait(1)
            if self._offset != self.size:
                os.ftruncate(self.fd, self.size)
            os.fsync(self.fd)
        except BaseException:
            self.abandon()
            raise
        self._release()

    def abandon(self) -> None:
        """Close after a failure: wait for the write in flight (its buffer is about to be reused), no sync."""
        if self.closed:
            return
        for i in (0, 1):
            try:
                self._wait(i)
            except BaseException:
                pass
        self._release()

    def _release(self) -> None:
        self.closed = True
        self._pool.shutdown(wait=True)
        os.close(self.fd)
        for buf in self._bufs:
            _give_back(buf)
        self._bufs = []
