"""The compile cache: what inductor compiled for a run, kept so the next process does not compile it again.

With ``graph_capture.cache_dir`` set, the engine loads ``torch.compiler`` cache artifacts from there at
set-up (a restarted worker group, or a new node, then reuses the run's compiled kernels), and global rank
0 writes what its process compiled after the first captured step.  The artifacts carry generated code,
not built kernels: on CPU every process would still build the C++ again, so inductor's own cache
directory (where the built kernels live) goes there too, unless TORCHINDUCTOR_CACHE_DIR is set or the
directory is a URI (s3://...): there only the artifacts are kept.  The file is named after the torch
version and the device kind, since artifacts of another torch or device kind do not apply; it is written
to a temporary name and renamed, so a reader never sees half a file.  Artifacts are keyed by the graphs
they compile: loading ones that do not match this model costs a little time and changes nothing.
"""

from __future__ import annotations

import logging
import os
import re
import time
from pathlib import Path

import torch

logger = logging.getLogger("rayzero")


def cache_file(directory: str, device_kind: str) -> Path:
    version = re.sub(r"[^0-9A-Za-z.]+", "_", torch.__version__)
    return Path(directory) / f"rayzero-compile-torch{version}-{device_kind}.bin"


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
        self.rank = rank
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
        self.kernel_dir = self.path.parent / f"inductor-{self.path.stem.removeprefix('rayzero-compile-')}"
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
        """Rank 0 writes what this process compiled (atomically); returns the bytes written."""
        if self.rank != 0:
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
