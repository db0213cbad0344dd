"""Clean stops (rayzero/train/stop.py): SIGINT or SIGTERM on the driver of ``rayzero.fit`` stops the workers at
the next step boundary with a checkpoint there, says what was saved and how to resume, and rerunning the same
call resumes from it to the weights of an uninterrupted run.  The driver is its own process
(tests/ray_stop_driver.py), as signals go to the driver; it joins this module's Ray cluster."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time

import pytest
import torch

from distributed import run_distributed
from ray_cases import WORKER_PYTHONPATH, cpu_fit
import shared_ray

ray = pytest.importorskip("ray")
SHARED_RAY = True  # runs on the suite's one local cluster (tests/shared_ray.py)
TESTS = os.path.dirname(os.path.abspath(__file__))
STEPS = 30  # at 0.1 s a step (ray_stop_driver.py) a stop half a second after the first step lands mid-run


@pytest.fixture(scope="module", autouse=True)
def ray_cluster():
    yield shared_ray.start()  # the suite's one cluster (tests/shared_ray.py)


def _driver(storage: str, name: str, *extra: str) -> subprocess.Popen:
    command = [sys.executable, os.path.join(TESTS, "ray_stop_driver.py"), ray.get_runtime_context().gcs_address,
               storage, name, str(STEPS), *extra]
    return subprocess.Popen(command, env=dict(os.environ, PYTHONPATH=WORKER_PYTHONPATH), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


def _signal_after_first_step(proc: subprocess.Popen, run_dir: str, sig: int) -> tuple[int, str, float]:
    """Send ``sig`` to the driver once the run's first metrics record is written; its exit status, its output and
    the seconds from the signal to its exit."""
    metrics = os.path.join(run_dir, "metrics.jsonl")
    deadline = time.monotonic() + 240
    while not (os.path.exists(metrics) and os.path.getsize(metrics) > 0):
        assert proc.poll() is None, proc.stdout.read()
        assert time.monotonic() < deadline, "the run wrote no step"
        time.sleep(0.05)
    proc.send_signal(sig)
    sent = time.monotonic()
    out, _ = proc.communicate(timeout=240)
    return proc.returncode, out, time.monotonic() - sent


def test_sigint_stops_at_a_step_with_a_checkpoint_and_the_same_call_resumes(tmp_path):
    from rayzero.checkpoint.tools import export, verify

    storage, name = str(tmp_path / "runs"), "stopped"
    run_dir = os.path.join(storage, name)
    code, out, took = _signal_after_first_step(_driver(storage, name), run_dir, signal.SIGINT)
    print(f"SIGINT to exit: {took:.1f} s")
    assert code == 1, out  # fit raised rayzero.RunStopped
    found = re.search(r"run stopped stopped by SIGINT after step (\d+): saved checkpoint (checkpoint_step\d{8}) "
                      r"\(step \1\) at (\S+)\. To resume, rerun the same call \(ClusterConfig name 'stopped', "
                      r"storage '([^']+)'\); this driver ran as: (.+)$", out, re.MULTILINE)
    assert found, out
    step, tag, path = int(found.group(1)), found.group(2), found.group(3)
    assert 1 <= step < STEPS and tag == f"checkpoint_step{step:08d}" and path == os.path.join(run_dir, tag), out
    assert "RunStopped" in out and "FINISHED" not in out, out
    assert found.group(4) == storage
    assert found.group(5).endswith(f"ray_stop_driver.py {ray.get_runtime_context().gcs_address} {storage} {name} {STEPS}")
    assert verify(path) == []
    # no step ran after the one that saved: the workers stopped there
    from rayzero.train.metrics import read_metrics

    assert [r["step"] for r in read_metrics(run_dir)] == list(range(1, step + 1))

    proc = _driver(storage, name)  # the same call again
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, out
    assert f"resuming run {name} from step {step} (checkpoint {tag})" in out, out
    final = os.path.join(run_dir, f"checkpoint_step{STEPS:08d}")
    assert f"FINISHED {final} {step}" in out, out
    assert [r["step"] for r in read_metrics(run_dir)] == list(range(1, STEPS + 1))

    # the weights of the run without a stop (ray_cases.cpu_fit: the worker's steps without Ray), bit for bit
    config = {**__import__("ray_cases").CONFIG, "deterministic": True}
    run_distributed(cpu_fit, 2, [{"name": "straight", "config": config}], STEPS, str(tmp_path / "cpu"))
    export(final, str(tmp_path / "fit.pt"))
    export(str(tmp_path / "cpu" / "straight"), str(tmp_path / "cpu.pt"), tag=f"checkpoint_step{STEPS:08d}")
    resumed, straight = torch.load(tmp_path / "fit.pt"), torch.load(tmp_path / "cpu.pt")
    assert list(resumed) == list(straight)
    for key, value in straight.items():
        assert torch.equal(resumed[key], value), key


def test_sigterm_asks_the_workers_to_stop_and_a_second_signal_aborts():
    """The driver's side for SIGTERM (``ray job stop`` sends it), in this process: the request reaches the workers'
    reader through the GCS, and a second signal raises at once."""
    from rayzero.train.stop import StopSignals, StopWatcher, clear_stop, stop_requested

    run, said = "terminated", []
    clear_stop(run)
    before = signal.getsignal(signal.SIGTERM)
    watcher = StopWatcher(run, poll_s=0.05)  # rank 0's reader
    watcher.start()
    try:
        with StopSignals(run, said.append) as signals:
            assert not watcher.requested.wait(0.3)  # nothing asked yet
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(0.1)  # the handler runs in this thread at the next bytecode
            assert signals.signal_name == "SIGTERM" and stop_requested(run) == "SIGTERM"
            assert said == [f"SIGTERM: stopping run {run} at the next step boundary and saving a checkpoint there "
                            "(press Ctrl-C again to abort at once: the checkpoints saved before stay good)"]
            assert watcher.requested.wait(5)
            aborted = (f"run {run} aborted by a second SIGINT while it stopped, without a checkpoint at the stop; "
                       "the checkpoints saved before stay good: rerun the same call to resume from the latest")
            with pytest.raises(KeyboardInterrupt) as raised:
                os.kill(os.getpid(), signal.SIGINT)
                time.sleep(5)
            assert str(raised.value) == aborted and said[-1] == aborted
            # Ray's wait turns a handler's exception into a bare KeyboardInterrupt: leaving the block words it again
            raise KeyboardInterrupt
        pytest.fail("StopSignals swallowed the KeyboardInterrupt")
    except KeyboardInterrupt as e:
        assert str(e) == aborted
    finally:
        watcher.close()
        clear_stop(run)
    assert signal.getsignal(signal.SIGTERM) is before  # the handlers are put back
    assert stop_requested(run) is None


def test_the_stop_message_without_a_save_or_a_name_and_save_on_stop_checked():
    import rayzero
    from rayzero.train.stop import resume_text, stopped_message

    with pytest.raises(rayzero.ConfigError, match=r"ClusterConfig.save_on_stop='no' \(str\): must be True .* or False"):
        rayzero.ClusterConfig(save_on_stop="no").validate()
    # fit named the run from the time: the rerun must name it, or it starts a new run
    how = resume_text("rayzero-20261206-101500", named=False, storage="/runs")
    assert how.startswith("rerun the same call with ClusterConfig(name='rayzero-20261206-101500', storage='/runs') "
                          "(this run's name was made from the time: without it a rerun starts a new run)")
    text = stopped_message("r", "SIGTERM", 7, "/runs/r/checkpoint_step00000005", False, "rerun the same call")
    assert text == ("run r stopped by SIGTERM after step 7: no checkpoint saved at the stop (save_on_stop=False); the "
                    "latest is checkpoint_step00000005 at /runs/r/checkpoint_step00000005, and a rerun redoes the "
                    "steps after it. To resume, rerun the same call")
