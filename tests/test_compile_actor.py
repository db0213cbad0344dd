"""The node's compile cache owner (rayzero/train/compile_actor.py): what one node compiled reaches another
node through the run's storage, built kernels included, so the second node compiles and builds nothing.

The owner's logic runs here as a plain object (two of them, on two directories, stand for two nodes of a
run); tests/test_ray_fit.py runs it as the Ray actor under ``rayzero.fit``."""

from __future__ import annotations

import os

import pytest

from distributed import run_distributed

if not __import__("rayzero.accelerator.graphs", fromlist=["x"]).cpu_compiler_available():
    pytest.skip("inductor needs a C++ compiler on PATH", allow_module_level=True)

import capture_cases  # noqa: E402
from rayzero.capture.cache import cache_file, kernel_archive_name, kernel_dir  # noqa: E402
from rayzero.train.compile_actor import CompileCacheOwner  # noqa: E402


def _built(directory) -> set[str]:
    """The shared objects (built kernels) under an inductor cache directory."""
    return {os.path.join(d, f) for d, _, files in os.walk(directory) for f in files if f.endswith(".so")}


def test_a_new_node_loads_the_kernels_another_node_built(tmp_path):
    run_cache = str(tmp_path / "run" / "compile_cache")
    first = CompileCacheOwner(run_cache, "r", root=str(tmp_path / "node-a"), sync_interval_s=0)
    node_a = first.lease("cpu")
    assert first.info()["fetched"]["cpu"] == {"artifacts_bytes": 0, "kernel_files": 0}  # the run has nothing yet
    cold = run_distributed(capture_cases.cached, 2, node_a, timeout=600)
    assert cold[0]["cache_saved"] > 0 and cold[1]["cache_saved"] == 0  # one writer per host
    assert all(r["misses"] > 0 for r in cold)
    built_a = _built(kernel_dir(node_a, "cpu"))
    assert built_a, "inductor built no kernel into the node's directory"

    assert first.sync() > 0
    stored = sorted(os.listdir(run_cache))
    assert stored == sorted([cache_file(run_cache, "cpu").name, kernel_archive_name("cpu")])
    assert first.sync() == 0  # nothing new: nothing uploaded again

    second = CompileCacheOwner(run_cache, "r", root=str(tmp_path / "node-b"), sync_interval_s=0)
    node_b = second.lease("cpu")
    fetched = second.info()["fetched"]["cpu"]
    assert fetched["artifacts_bytes"] == os.path.getsize(cache_file(node_a, "cpu")) and fetched["kernel_files"] > 0
    kernels_b = kernel_dir(node_b, "cpu")
    before = _built(kernels_b)
    assert len(before) == len(built_a)
    warm = run_distributed(capture_cases.cached, 2, node_b, timeout=600)
    for a, b in zip(cold, warm):
        assert b["cache_loaded"] > 0 and b["misses"] == 0
        assert a["losses"] == b["losses"] and a["norms"] == b["norms"]
    assert _built(kernels_b) == before  # every kernel came from the other node: none was built here

    second.shutdown()
    first.shutdown()
    assert not (tmp_path / "node-a" / "rayzero-compile").exists()
    assert not (tmp_path / "node-b" / "rayzero-compile").exists()
    assert sorted(os.listdir(run_cache)) == stored  # the run keeps its cache


def test_an_unreadable_run_cache_costs_a_compile_not_the_lease(tmp_path):
    run_cache = tmp_path / "run" / "compile_cache"
    run_cache.mkdir(parents=True)
    (run_cache / kernel_archive_name("cpu")).write_bytes(b"not a tar")
    owner = CompileCacheOwner(str(run_cache), "r", root=str(tmp_path / "node"), sync_interval_s=0)
    node = owner.lease("cpu")
    assert os.path.isdir(node) and not os.path.exists(cache_file(node, "cpu"))
    owner.shutdown()
