"""Where checkpoints live: a local path or any pyarrow.fs URI (s3://, gs://, hdfs://, file://).

Local storage gets the strongest guarantees (fsync, atomic renames); object stores get the same commit
order (fragment files, then the manifest, then ``latest``), which is what readers rely on.
"""

from __future__ import annotations

import os
import posixpath
from dataclasses import dataclass

import pyarrow as pa
import pyarrow.fs as pafs
import xxhash


@dataclass(frozen=True)
class Storage:
    fs: pafs.FileSystem
    root: str  # path inside ``fs``
    local: bool

    @staticmethod
    def resolve(path_or_uri: "str | os.PathLike | Storage") -> "Storage":
        if isinstance(path_or_uri, Storage):
            return path_or_uri
        text = os.fspath(path_or_uri)
        if "://" in text and not text.startswith("file://"):
            fs, root = pafs.FileSystem.from_uri(text)
            return Storage(fs, root.rstrip("/"), False)
        if text.startswith("file://"):
            text = text[len("file://") :]
        return Storage(pafs.LocalFileSystem(), os.path.abspath(text), True)

    @staticmethod
    def on(fs: pafs.FileSystem, root: str) -> "Storage":
        """A directory on a filesystem someone else opened (for example Ray Train's run storage)."""
        local = isinstance(fs, pafs.LocalFileSystem)
        return Storage(fs, os.path.abspath(root) if local else root.rstrip("/"), local)

    def join(self, *parts: str) -> str:
        return posixpath.join(self.root, *parts) if not self.local else os.path.join(self.root, *parts)

    def uri(self, path: str) -> str:
        return path

    # ---- small files ----------------------------------------------------------------------------------
    def read_bytes(self, path: str) -> bytes:
        with self.fs.open_input_stream(path) as f:
            return f.read()

    def write_bytes_atomic(self, path: str, data: bytes, durable: bool = True) -> None:
        """Write ``data`` so that readers see the old content or the new one, never a mix.

        ``durable=False`` skips the fsyncs, for files whose loss in a crash only loses a save in flight."""
        if self.local:
            tmp = f"{path}.tmp-{os.getpid()}"
            with open(tmp, "wb") as f:
                f.write(data)
                if durable:
                    f.flush()
                    os.fsync(f.fileno())
            os.replace(tmp, path)
            if durable:
                fsync_dir(os.path.dirname(path))
        else:  # object stores publish a whole object at close
            with self.fs.open_output_stream(path) as f:
                f.write(data)

    def exists(self, path: str) -> bool:
        return self.fs.get_file_info(path).type != pafs.FileType.NotFound

    def is_dir(self, path: str) -> bool:
        return self.fs.get_file_info(path).type == pafs.FileType.Directory

    def makedirs(self, path: str) -> None:
        self.fs.create_dir(path, recursive=True)

    def listdir(self, path: str) -> list[str]:
        if not self.exists(path):
            return []
        infos = self.fs.get_file_info(pafs.FileSelector(path, recursive=False))
        return sorted(posixpath.basename(i.path.rstrip("/")) for i in infos)

    def delete_dir(self, path: str) -> None:
        if self.exists(path):
            self.fs.delete_dir(path)

    def move(self, src: str, dst: str) -> None:
        self.fs.move(src, dst)
        if self.local:
            fsync_dir(os.path.dirname(dst))

    def open_output(self, path: str):
        return self.fs.open_output_stream(path)

    def open_random_access(self, path: str):
        """Memory-mapped for local files (only touched pages are read), ranged reads elsewhere."""
        if self.local:
            return pa.memory_map(path, "r")
        return self.fs.open_input_file(path)

    def file_size(self, path: str) -> int:
        return self.fs.get_file_info(path).size


def fsync_dir(path: str) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _sync_file_range():
    """libc's ``sync_file_range`` (Linux), or None where there is none."""
    import ctypes
    import ctypes.util
    import sys

    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        fn = libc.sync_file_range
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    fn.restype = ctypes.c_int
    return fn


_SYNC_FILE_RANGE = _sync_file_range()
_SYNC_FILE_RANGE_WRITE = 2  # start writing the range's dirty pages back; do not wait


class HashingWriter:
    """A file-like sink that hashes every byte on its way to the real stream (one pass, no re-read).

    For a local file it starts the disk writing early: every ``WRITEBACK_EVERY`` bytes it asks the
    kernel (``sync_file_range``) to begin writing back what was written so far, so the disk works while
    the rest is serialized and the closing ``fsync`` waits only for the tail.  The pages stay cached (a
    load right after the save reads from memory)."""

    WRITEBACK_EVERY = 16 << 20

    def __init__(self, raw, local_file=None):
        self.raw = raw
        self.local_file = local_file
        self.hasher = xxhash.xxh3_64()
        # every byte but the fragments' data values (the manifest's frame_xxh3, see format.FragmentFile):
        # the Arrow writer writes each buffer with one write, and a fragment's data values come right after
        # its data column's 16 offset bytes [0, n]
        self.frame = xxhash.xxh3_64()
        self.data_skipped = 0  # data-value writes left out of ``frame``
        self._expect: bytes | None = None  # the offsets of the data column of the batch being written
        self._armed = -1  # the byte count of the data values that come next
        self.size = 0
        self.closed = False
        self._kicked = 0  # bytes already handed to writeback

    def write(self, data) -> int:
        view = memoryview(data).cast("B")
        self.hasher.update(view)
        if view.nbytes == self._armed:
            self._armed, self._expect = -1, None
            self.data_skipped += 1
        else:
            self.frame.update(view)
            if self._expect is not None and view.nbytes == 16 and view == self._expect:
                self._armed = int.from_bytes(self._expect[8:], "little")
        self.raw.write(view)
        self.size += view.nbytes
        if self.local_file is not None and _SYNC_FILE_RANGE is not None \
                and self.size - self._kicked >= self.WRITEBACK_EVERY:
            self.raw.flush()
            _SYNC_FILE_RANGE(self.local_file.fileno(), self._kicked, self.size - self._kicked, _SYNC_FILE_RANGE_WRITE)
            self._kicked = self.size
        return view.nbytes

    def flush(self) -> None:
        self.raw.flush()

    def expect_data(self, nbytes: int) -> None:
        """The next record batch holds a fragment of ``nbytes`` data bytes (none: nothing to leave out)."""
        self._expect = (0).to_bytes(8, "little") + nbytes.to_bytes(8, "little") if nbytes else None
        self._armed = -1

    def tell(self) -> int:
        return self.size

    def writable(self) -> bool:
        return True

    def close(self) -> None:
        if self.closed:
            return
        self.raw.flush()
        if self.local_file is not None:
            os.fsync(self.local_file.fileno())
        self.raw.close()
        self.closed = True

    def abandon(self) -> None:
        """After a failure: close the stream without syncing (a direct-I/O file also waits for its write in
        flight); errors of the close itself are dropped, the failure that led here is what is raised."""
        if self.closed:
            return
        self.closed = True
        try:
            getattr(self.raw, "abandon", self.raw.close)()
        except BaseException:
            pass


def xxh3_of(storage: Storage, path: str, block: int = 8 << 20) -> str:
    """The file's 64-bit XXH3 hash (hex), streamed: what the manifest records per fragment file."""
    h = xxhash.xxh3_64()
    with storage.fs.open_input_stream(path) as f:
        while True:
            chunk = f.read(block)
            if not chunk:
                break
            h.update(chunk)
    return h.hexdigest()
