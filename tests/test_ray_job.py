"""`ray start --head` on loopback, then `ray job submit -- python examples/train.py`, as a user runs it."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request

import pytest

from ray_cases import stop_head

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BIN = os.path.dirname(sys.executable)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def ray_head():
    """A head node this test owns: token auth, its own ports and session directory, stopped by its PID."""
    if shutil.which("ray", path=BIN) is None:
        pytest.skip("the ray command is not installed next to this Python")
    root = tempfile.mkdtemp(prefix="rzjob", dir="/tmp")  # short: Ray's socket paths must stay < 108 bytes
    env = dict(os.environ, HOME=os.path.join(root, "home"), RAY_TMPDIR=os.path.join(root, "rt"),
               PATH=BIN + os.pathsep + os.environ.get("PATH", ""), RAY_USAGE_STATS_ENABLED="0",
               RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S="0")
    env.pop("RAY_ADDRESS", None)
    os.makedirs(env["HOME"])
    os.makedirs(env["RAY_TMPDIR"])
    subprocess.run([os.path.join(BIN, "ray"), "get-auth-token", "--generate"], env=env, check=True,
                   capture_output=True, timeout=60)
    env["RAY_AUTH_MODE"] = "token"  # head and every client agree on token authentication
    dash = free_port()
    head = subprocess.Popen(
        [os.path.join(BIN, "ray"), "start", "--head", f"--port={free_port()}", "--num-cpus=3",
         "--include-dashboard=true", "--dashboard-host=127.0.0.1", f"--dashboard-port={dash}",
         f"--dashboard-agent-listen-port={free_port()}", f"--dashboard-agent-grpc-port={free_port()}",
         f"--metrics-export-port={free_port()}", f"--runtime-env-agent-port={free_port()}",
         "--disable-usage-stats", "--block"],
        env=env, stdout=open(os.path.join(root, "head.log"), "w"), stderr=subprocess.STDOUT,
        start_new_session=True,  # its own process group: stopping it touches nothing else
    )
    address = f"http://127.0.0.1:{dash}"
    try:
        deadline = time.monotonic() + 90
        while True:
            try:
                urllib.request.urlopen(f"{address}/api/version", timeout=2)
                break
            except urllib.error.HTTPError:
                break  # the dashboard answers (with an auth error): it is up
            except OSError:
                assert head.poll() is None, open(os.path.join(root, "head.log")).read()[-2000:]
                assert time.monotonic() < deadline, "the Ray head did not come up"
                time.sleep(0.5)
        yield address, env, root
    finally:
        stop_head(head, root, 20)


def test_ray_job_submit_runs_the_example(ray_head):
    address, env, root = ray_head
    storage = os.path.join(root, "runs")
    proc = subprocess.run(
        [os.path.join(BIN, "ray"), "job", "submit", "--address", address, "--working-dir", REPO, "--",
         "python", "examples/train.py", "--max-steps", "6", "--workers", "2", "--storage", storage],
        env=env, capture_output=True, text=True, timeout=400, cwd=REPO,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    assert "succeeded" in out, out[-2000:]
    assert "final perplexity on held-out text:" in out
    assert "loss: first" in out
    runs = os.listdir(storage)
    assert len(runs) == 1 and runs[0].startswith("tiny-gpt-")
    assert os.path.exists(os.path.join(storage, runs[0], "metrics.jsonl"))
