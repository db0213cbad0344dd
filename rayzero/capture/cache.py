"""The compile cache: what inductor compiled for a run, kept so the next process does not compile it again.

With ``graph_capture.cache_dir`` set, the engine loads ``torch.compiler`` cache artifacts from there at
set-up (a restarted worker group, or a new node, then reuses the run's compiled kernels), and the first
rank of each host writes what its process compiled after the first captured step.  Under ``rayzero.fit``
the directory is the node's own, leased from the run's ``NodeCompileCache`` actor
(``rayzero/train/compile_actor.py``), which keeps it in step with the run's storage.  The artifacts carry
generated code, not built kernels: on CPU every process would still build the C++ again, so inductor's own cache
directory (where the built kernels live) goes there too, unless TORCHINDUCTOR_CACHE_DIR is set or the
directory is a URI (s3://...): there only the artifacts are kept.  The file is named after the torch
version and the device kind, since artifacts of another torch or device kind do not apply; it is written
to a temporary name and renamed, so a reader never sees half a file.  Artifacts are keyed by the graphs
they compile: loading ones that do not match this model costs a little time and changes nothing.
"""

from __future__ import annotations

import functools
import logging
import os
import re
import time
from pathlib import Path

import torch

logger = logging.getLogger("rayzero")


def _torch_version() -> str:
    return re.sub(r"[^0-9A-Za-z.]+", "_", torch.__version__)


def cache_file(directory: str, device_kind: str) -> Path:
    return Path(directory) / f"rayzero-compile-torch{_torch_version()}-{device_kind}.bin"


def kernel_dir(directory: str, device_kind: str) -> Path:
    """Where inductor keeps its built kernels inside a local cache directory."""
    return Path(directory) / f"inductor-torch{_torch_version()}-{device_kind}"


@functools.lru_cache(maxsize=None)
def host_key() -> str:
    """What built kernels depend on besides torch and the device kind: the CPU architecture, the Python ABI
    and the C++ compiler.  Kernels built on one host load on another with the same key.  Worked out once per
process (it runs the compiler), since the compile cache owner names the archive at every sync."""
    import hashlib
    import platform
    import shutil
    import subprocess
    import sys

    compiler = ""
    for name in (os.environ.get("CXX"), "c++", "g++", "clang++"):
        path = name and shutil.which(name)
        if path:
            try:
                compiler = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=30).stdout
            except (OSError, subprocess.SubprocessError):
                compiler = path
            break
    digest = hashlib.sha256(compiler.encode()).hexdigest()[:10]
    return f"{platform.machine()}-py{sys.version_info.major}{sys.version_info.minor}-cxx{digest}"


def kernel_archive_name(device_kind: str) -> str:
    return f"inductor-torch{_torch_version()}-{device_kind}-{host_key()}.tar"


# inductor's precompiled header (~150 MB on CPU) is only needed to build a kernel, and its locks are per host
_NOT_ARCHIVED = {"precompiled_headers", "locks"}


def pack_kernels(directory: Path) -> bytes:
    """The built kernels of an inductor cache directory as one tar (without what only a build needs)."""
    import io
    import tarfile

    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w") as tar:
        for entry in sorted(Path(directory).iterdir()):
            if entry.name not in _NOT_ARCHIVED:
                tar.add(entry, arcname=entry.name)
    return out.getvalue()


def unpack_kernels(data: bytes, directory: Path) -> int:
    """Extract :func:`pack_kernels`'s tar into ``directory`` (which must stay inside it); returns the files."""
    import io
    import tarfile

    Path(directory).mkdir(parents=True, exist_ok=True)
    with tarfile.open(fileobj=io.BytesIO(data), mode="r") as tar:
        members = [m for m in tar.getmembers() if m.isfile() or m.isdir()]
        tar.extractall(directory, members=members, filter="data")
    return sum(1 for m in members if m.isfile())


def is_cache_writer(rank: int) -> bool:
    """Who writes the artifacts: the first rank of each host (``LOCAL_RANK`` 0, as torchrun and Ray Train set
    it), else global rank 0.  Under ``rayzero.fit`` each node's cache directory is its own, so every node
    keeps what it compiled; on a directory shared by hosts each writes whole files under the same name."""
    local = os.environ.get("LOCAL_RANK")
    return int(local) == 0 if local is not None and local.isdigit() else rank == 0


class CompileCache:
    """One engine's view of the run's compile cache directory: a local path, or a URI the run's storage
    understands (s3://, gs://, ...).  On a URI only the artifacts live there; inductor's built kernels,
    which belong to one host, stay in the process's own inductor cache."""

    def __init__(self, directory: str, device_kind: str, rank: int) -> None:
        from rayzero.checkpoint.storage import Storage

        text = os.fspath(directory)
        self.storage = Storage.resolve(text if "://" in text else os.path.expanduser(text))
        self.path = cache_file(self.storage.root, device_kind)
        self.location = str(self.path) if self.storage.local else self.storage.join(self.path.name)
        self.device_kind = device_kind
        self.writer = is_cache_writer(rank)
        self.loaded = 0  # artifacts loaded at set-up
        self.load_seconds = 0.0
        self.saved_bytes = 0
        self.kernel_dir: Path | None = None

    def use_kernel_directory(self) -> bool:
        """Point inductor's own cache (its compiled kernels: on CPU the C++ shared objects, which the
        artifacts do not carry and which cost most of a CPU compile) into the cache directory, unless
        the process already chose one with TORCHINDUCTOR_CACHE_DIR.  Returns whether it did."""
        from torch._inductor.runtime.cache_dir_utils import default_cache_dir

        if not self.storage.local:
            return False
        chosen = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
        # inductor writes its default into the environment the first time it looks: that is no choice
        if chosen and os.path.abspath(chosen) != os.path.abspath(default_cache_dir()):
            return False
        self.kernel_dir = kernel_dir(self.path.parent, self.device_kind)
        self.kernel_dir.mkdir(parents=True, exist_ok=True)
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(self.kernel_dir)
        return True

    def load(self) -> int:
        """Hot-load the cached artifacts, if there are any; returns how many."""
        start = time.perf_counter()
        try:
            if not self.storage.exists(self.location):
                return 0
            info = torch.compiler.load_cache_artifacts(self.storage.read_bytes(self.location))
        except Exception as e:  # noqa: BLE001 - a bad or unreachable cache file costs a compile, never the run
            logger.warning("rayzero: compile cache %s could not be loaded (%s); compiling afresh", self.location, e)
            return 0
        self.load_seconds = time.perf_counter() - start
        self.loaded = sum(len(v) for v in info.artifacts.values()) if info is not None else 0
        return self.loaded

    def save(self) -> int:
        """The cache writer (:func:`is_cache_writer`) writes what this process compiled (atomically); returns
        the bytes written."""
        if not self.writer:
            return 0
        artifacts = torch.compiler.save_cache_artifacts()
        if artifacts is None:
            return 0
        data = artifacts[0]
        try:
            self.storage.makedirs(self.storage.root)
            # readers see the old file or the new one, never half of one
            self.storage.write_bytes_atomic(self.location, data, durable=False)
        except OSError as e:  # a full or read-only disk, or an unreachable store, loses the cache, not the training
            logger.warning("rayzero: compile cache %s could not be written (%s); training goes on", self.location, e)
            return 0
        self.saved_bytes = len(data)
        return self.saved_bytes
