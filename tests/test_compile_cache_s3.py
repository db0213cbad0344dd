"""Graph capture's compile cache on object storage (a local S3 server): what a run on s3:// storage gets."""

from __future__ import annotations

import pytest

from distributed import run_distributed

pytest.importorskip("moto.server", reason="moto[server] (in the test extra) provides the local S3 server")
if not __import__("rayzero.accelerator.graphs", fromlist=["x"]).cpu_compiler_available():
    pytest.skip("inductor needs a C++ compiler on PATH", allow_module_level=True)

import capture_cases  # noqa: E402
from test_checkpoint_s3 import BUCKET, s3  # noqa: E402,F401  (the moto fixture)


def test_compile_cache_on_s3_serves_the_next_worker_group(s3, tmp_path):
    """The artifacts are written to and read from the bucket: a new pair of processes, each with an empty
    inductor cache of its own, compiles no graph again and trains the same."""
    uri, client = s3
    cache = uri("run/compile_cache")
    first = run_distributed(capture_cases.cached, 2, cache, env={"TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "a")},
                            timeout=600)
    objects = client.list_objects_v2(Bucket=BUCKET, Prefix="run/")["Contents"]
    keys = [o["Key"] for o in objects if not o["Key"].endswith("/")]  # (not the directory markers)
    assert len(keys) == 1, keys
    assert keys[0].startswith("run/compile_cache/rayzero-compile-torch") and keys[0].endswith("-cpu.bin")
    assert first[0]["cache_saved"] > 0 and first[1]["cache_saved"] == 0
    assert all(r["cache_loaded"] == 0 and r["misses"] > 0 for r in first)
    second = run_distributed(capture_cases.cached, 2, cache, env={"TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "b")},
                             timeout=600)
    for a, b in zip(first, second):
        assert b["cache_loaded"] > 0 and b["misses"] == 0
        assert a["norms"] == b["norms"] and a["losses"] == b["losses"]
