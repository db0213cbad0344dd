"""``rayzero tune`` end to end: real trials (``rayzero.fit`` runs) on a real local Ray cluster, run by Ray Tune."""

from __future__ import annotations

import glob
import json
import os
import subprocess
import sys
import tempfile

import pytest
import torch

import rayzero
from distributed import run_distributed
from rayzero.cli import build_parser
from ray_cases import model_factory, mse, tune_stream
import shared_ray

ray = pytest.importorskip("ray")
SHARED_RAY = True  # runs on the suite's one local cluster (tests/shared_ray.py)
TESTS = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(TESTS)
CONFIG = {"train_batch_size": 12, "train_micro_batch_size_per_gpu": 6, "zero_optimization": {"stage": 2},
          "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}, "gradient_clipping": 1.0}


def _alive_actor_classes() -> list[str]:
    """The live actors' classes, from the GCS's actor table (the state API needs a dashboard)."""
    from ray._private.state import actors

    return sorted(a["ActorClassName"] for a in actors(actor_state_name="ALIVE").values())


def _step_with(rank, world, path):
    torch.manual_seed(0)
    engine = rayzero.initialize(model_factory(), path)
    g = torch.Generator().manual_seed(rank)
    x, y = torch.randn(6, 7, generator=g), torch.randn(6, 5, generator=g)
    engine.backward(mse(engine(x), (x, y)))
    engine.step()
    out = (engine.stage, engine.buckets.reduce_bucket_size, engine.batch.train_batch_size, engine.global_steps)
    engine.destroy()
    return out


def test_tune_runs_trials_on_the_cluster_and_writes_a_config_initialize_takes(tmp_path):
    shared_ray.start()  # the suite's one cluster (tests/shared_ray.py)
    before_dirs = set(glob.glob(os.path.join(tempfile.gettempdir(), "rayzero-tune-*")))
    before_actors = _alive_actor_classes()
    out = tmp_path / "best.json"
    lines: list[str] = []
    result = rayzero.tune(model_factory, {"workers": 2}, config=CONFIG, data=tune_stream, loss_fn=mse,
                          steps=3, warmup=1, stages=[1, 2], micro_batches=[3, 6], bucket_factors=(1.0,),
                          confirm=0, out=str(out), progress=lines.append)
    assert result.grid_size == 4
    # the search: the start (stage 2, micro 6, derived buckets), stage 1, micro-batch 3 (which bucket factors
    # and the confirming reruns add is tests/test_tune_search.py's, without a cluster)
    ran = [t for t in result.trials if t.status != "skipped"]
    assert len(ran) == 3 < result.grid_size
    failed = [t for t in ran if t.status == "failed"]
    assert [t.point["micro_batch"] for t in failed] == [3]
    assert "micro-batch 3 is refused" in failed[0].note
    ok = [t for t in ran if t.status == "ok"]
    assert len(ok) == 2 and all(0 < t.step_s < 5 for t in ok)
    assert len({tuple(t.point.values()) for t in ok}) == 2
    assert result.best.step_s == min(t.step_s for t in ok)
    # progress: one line per trial as it ends, then the table
    assert sum("[rayzero tune] trial " in line for line in lines) == 3
    assert any("| best |" in line for line in lines)
    # the file is the user's config with the tuned keys; the global batch is the user's
    written = json.loads(out.read_text())
    assert written == result.best_config
    assert written["train_batch_size"] == 12 and written["optimizer"] == CONFIG["optimizer"]
    assert written["train_micro_batch_size_per_gpu"] * written["gradient_accumulation_steps"] * 2 == 12
    assert written["zero_optimization"]["stage"] == result.best.point["stage"]
    # nothing left behind: no trial directory, no trial's workers or controller
    assert set(glob.glob(os.path.join(tempfile.gettempdir(), "rayzero-tune-*"))) == before_dirs
    # (the coordinator Ray Train starts once per cluster stays; rayzero's node agents are gone)
    singletons = {"_AutoscalingCoordinatorActor"}
    alive = _alive_actor_classes()
    assert [c for c in alive if c not in before_actors and c not in singletons] == []
    assert all(alive.count(c) <= 1 for c in singletons) and "NodeAgent" not in alive
    # and so does initialize, on 2 ranks
    got = run_distributed(_step_with, 2, str(out))
    stage, bucket = result.best.point["stage"], result.best.point["bucket"]
    assert got == [(stage, bucket, 12, 1)] * 2


def test_tune_command_line(tmp_path):
    shared_ray.stop()  # the command starts a cluster of its own, as a user's would (this module runs last)
    cfg = tmp_path / "cfg.json"
    cfg.write_text(json.dumps(CONFIG))
    out = tmp_path / "tuned.json"
    cases = os.path.join(TESTS, "ray_cases.py")
    cmd = [sys.executable, "-m", "rayzero.cli", "tune", "--model", f"{cases}:model_factory",
           "--data", f"{cases}:tune_stream", "--loss", f"{cases}:mse", "--config", str(cfg), "--workers", "2"]
    bad = subprocess.run(cmd + ["--micro-batches", "5"], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert bad.returncode == 2
    assert "micro-batch sizes [5] do not divide the 6 samples per worker" in bad.stderr
    # one trial: a grid of one point (the search over several is the test above); a list of factors parses
    run = subprocess.run(cmd + ["--stages", "2", "--micro-batches", "6", "--bucket-factors", "0.5", "--steps", "3",
                                "--warmup", "1", "--confirm", "0", "--out", str(out)],
                         capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "[rayzero tune] trial 1 (grid 1)" in run.stdout
    assert "| best |" in run.stdout and f"config written to {out}" in run.stdout
    tuned = rayzero.Config.from_any(str(out))
    assert tuned.zero_optimization.stage == 2 and tuned.train_batch_size == 12
    assert tuned.zero_optimization.reduce_bucket_size == 1_875_000  # half the derived 3_750_000
    parsed = build_parser().parse_args(["tune", "--model", "m:f", "--data", "m:d", "--config", "c.json",
                                        "--stages", "1,2", "--micro-batches", "3,6", "--bucket-factors", "0.5,1"])
    assert (parsed.stages, parsed.micro_batches, parsed.bucket_factors) == ([1, 2], [3, 6], [0.5, 1.0])
