"""Crashes inside a checkpoint commit, with real SIGKILLs at exact points (the writer's testing hook,
$RAYZERO_CHECKPOINT_CRASH_AT), real files, and a real local S3 server for the Ray run.

Local re-save of an existing tag: at every crash point a fresh process must load ``latest`` (the old or the
new checkpoint, bitwise), and the next save and load must work and leave no ``.old-``/``.tmp-`` directory.

Object store: a worker killed after rayzero committed ``checkpoint_step4`` but before Ray Train recorded it
must resume from that commit (not redo step 4 and trip over "never overwrite a committed tag").
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest
import torch

import rayzero
from crash_cases import AttemptLog
from distributed import run_distributed
from ray_cases import WORKER_PYTHONPATH, CONFIG, Regression, cpu_fit, model_factory
from rayzero.checkpoint.format import MANIFEST
from rayzero.checkpoint.storage import Storage
from rayzero.checkpoint.writer import CRASH_ENV, CRASH_ONCE_ENV

try:  # the local S3 server (moto, in the test extra) for the Ray run
    from test_checkpoint_s3 import BUCKET, S3_ENV, s3  # noqa: F401  (the moto fixture)
except pytest.skip.Exception as e:
    _no_s3 = str(e)

    @pytest.fixture(scope="module")
    def s3():
        pytest.skip(_no_s3)

TESTS = os.path.dirname(os.path.abspath(__file__))
CASES = os.path.join(TESTS, "crash_cases.py")

# where each crash point of a re-save of the current tag leaves ``latest`` pointing
GIVES = {
    "before_manifest": "old",   # the staging dir has no manifest: never committed
    "manifest_written": "old",  # complete staging dir, <tag> still the old one
    "old_moved_aside": "new",   # <tag> missing: restored from the complete staging dir
    "new_in_place": "new",      # the new <tag> in place, .old-<tag> not yet deleted
    "before_latest": "new",     # .old-<tag> deleted; latest already named the tag
}


def _run(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, CASES, *args], capture_output=True, text=True, timeout=300,
                          env={**os.environ, **(env or {})})


def _assert_same(got: dict, want: dict, what: str) -> None:
    assert got["steps"] == want["steps"], what
    assert list(got["state"]) == list(want["state"]), what
    for k, v in want["state"].items():
        assert torch.equal(got["state"][k], v), f"{what}: {k}"
    keys = sorted(k for k in want if k.startswith(("master", "opt")))
    assert keys and keys == sorted(k for k in got if k.startswith(("master", "opt"))), what
    for k in keys:
        a, b = got[k], want[k]
        assert torch.equal(a, b) if torch.is_tensor(b) else a == b, f"{what}: {k}"


def _crash_then_recover(tmp_path, point: str, order: str) -> dict:
    save_dir, out = tmp_path / "ckpts", tmp_path
    saver = _run("save", str(save_dir), point, str(out))
    assert saver.returncode == -signal.SIGKILL, (point, saver.returncode, saver.stdout, saver.stderr[-3000:])
    left = sorted(os.listdir(save_dir))
    fresh = _run("recover", str(save_dir), str(out), order)
    assert fresh.returncode == 0, f"after a kill at {point} (left {left}):\n{fresh.stderr[-3000:]}"
    return {name: torch.load(out / f"{name}.pt") for name in ("old", "new", "loaded", "after", "reloaded")}


@pytest.mark.parametrize("point", list(GIVES))
def test_sigkill_inside_a_resave_leaves_a_loadable_checkpoint(tmp_path, point):
    """Kill the saver at ``point`` of re-saving tag "ckpt" (which ``latest`` names); a fresh process loads
    ``latest`` and gets the old or the new checkpoint bitwise, then saves and loads again, leaving no
    leftovers."""
    got = _crash_then_recover(tmp_path, point, "load-first")
    which = GIVES[point]
    assert got["loaded"]["client"] == {"which": which}, point
    _assert_same(got["loaded"], got[which], f"loaded after a kill at {point}")
    assert got["reloaded"]["client"] == {"which": "after"}
    _assert_same(got["reloaded"], got["after"], f"re-saved after a kill at {point}")
    assert json.load(open(tmp_path / "listing.json")) == ["ckpt", "latest"]


def test_next_save_keeps_the_only_complete_copy(tmp_path):
    """Killed with <tag> moved aside and the new one not yet in place, then the next save (another tag)
    runs prepare() before anyone loads: it must restore "ckpt", not delete .old-ckpt and .tmp-ckpt."""
    got = _crash_then_recover(tmp_path, "old_moved_aside", "save-first")
    assert got["loaded"]["client"] == {"which": "new"}
    _assert_same(got["loaded"], got["new"], "loaded after the next save")
    _assert_same(got["reloaded"], got["after"], "re-saved")
    assert json.load(open(tmp_path / "listing.json")) == ["ckpt", "latest", "other"]


# ---- object store: killed after the commit, before Ray's report ---------------------------------------
STEPS, EVERY, KILL_TAG = 6, 2, "checkpoint_step00000004"


@pytest.fixture(scope="module")
def ray_on_s3(s3, tmp_path_factory):
    """A 2-CPU Ray cluster whose workers reach the S3 server and carry the one-shot crash hook: rank 0 dies
    right after committing checkpoint_step4 (manifest and ``latest`` written), before ``ray.train.report``."""
    ray = pytest.importorskip("ray")
    once = str(tmp_path_factory.mktemp("crash") / "killed-once")
    env = {"PYTHONPATH": WORKER_PYTHONPATH, **S3_ENV, CRASH_ENV: f"committed:{KILL_TAG}", CRASH_ONCE_ENV: once}
    ray.init(num_cpus=2, include_dashboard=False, runtime_env={"env_vars": env})
    try:
        yield s3, once
    finally:
        ray.shutdown()


def _fit(uri, name: str, attempts: str):
    cluster = {"workers": 2, "storage": uri("crash-runs"), "name": name, "checkpoint_every": EVERY,
               "max_failures": 1, "progress": False}
    return rayzero.fit(model_factory, cluster, config={**CONFIG, "deterministic": True}, data=Regression(),
                       train_step=AttemptLog(attempts), max_steps=STEPS)


def _manifest(checkpoint_uri: str) -> dict:
    storage = Storage.resolve(checkpoint_uri)
    return json.loads(storage.read_bytes(storage.join(MANIFEST)))


def test_object_store_kill_after_commit_before_report_resumes_from_the_commit(ray_on_s3, tmp_path):
    (uri, client), once = ray_on_s3
    attempts = tmp_path / "attempts.jsonl"
    crashed = _fit(uri, "crashed", str(attempts))  # max_failures=1: the kill is the only failure allowed
    assert os.path.exists(once), "rank 0 was never killed"
    starts = [r["start"] for r in map(json.loads, open(attempts)) if r["rank"] == 0]
    # two attempts (one failure used); the second resumed from rayzero's commit of step 4, although Ray
    # had recorded only step 2
    assert starts == [0, 4], starts
    keys = {o["Key"] for o in client.list_objects_v2(Bucket=BUCKET, Prefix="crash-runs/crashed/")["Contents"]}
    assert f"crash-runs/crashed/{KILL_TAG}/manifest.json" in keys
    assert not [k for k in keys if k.endswith((".done.json", ".error.json", ".partial", ".rayzero-incomplete"))]

    # uninterrupted: the worker's own steps without Ray (ray_cases.cpu_fit, which tests/test_ray_fit.py checks
    # against rayzero.fit bit for bit)
    reference = str(tmp_path / "reference")
    run_distributed(cpu_fit, 2, [{"name": "run", "config": {**CONFIG, "deterministic": True}}], STEPS, reference)
    got, want = _manifest(crashed.checkpoint), _manifest(os.path.join(reference, "run", f"checkpoint_step{STEPS:08d}"))
    assert got["global_steps"] == want["global_steps"] == STEPS
    # deterministic run: the fragment files (fp32 masters, optimizer state, buffers) are bitwise the same
    assert [(f["file"], f["size"], f["xxh3"]) for f in got["files"]] == \
        [(f["file"], f["size"], f["xxh3"]) for f in want["files"]]
