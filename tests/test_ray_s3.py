"""rayzero.fit with its run storage on S3 (a local S3-compatible server), resumed from there."""

from __future__ import annotations

import os

import pytest

import rayzero
from ray_cases import WORKER_PYTHONPATH, CONFIG, Regression, model_factory, mse

ray = pytest.importorskip("ray")
pytest.importorskip("moto.server", reason="moto[server] (in the test extra) provides the local S3 server")
from test_checkpoint_s3 import S3_ENV, s3  # noqa: E402,F401  (the moto fixture)

TESTS = os.path.dirname(os.path.abspath(__file__))


def test_fit_writes_checkpoints_and_metrics_to_s3_and_resumes_from_there(s3):
    uri, client = s3
    storage = uri("fit-runs")
    ray.init(num_cpus=2, include_dashboard=False,
             runtime_env={"env_vars": {"PYTHONPATH": WORKER_PYTHONPATH, **S3_ENV}})
    try:
        cluster = {"workers": 2, "storage": storage, "name": "s3run", "checkpoint_every": 2, "progress": True}
        first = rayzero.fit(model_factory, cluster, config=CONFIG, data=Regression(), loss_fn=mse, max_steps=4)
        assert first.run_dir.startswith("s3://") and "s3run" in first.run_dir
        assert first.checkpoint.startswith("s3://") and "checkpoint_step00000004" in first.checkpoint
        keys = {o["Key"] for o in client.list_objects_v2(Bucket="rayzero-ckpt", Prefix="fit-runs/s3run/")["Contents"]}
        assert "fit-runs/s3run/metrics.jsonl" in keys
        assert "fit-runs/s3run/checkpoint_step00000004/manifest.json" in keys
        # the same run name continues from its latest checkpoint on S3
        more = rayzero.fit(model_factory, cluster, config=CONFIG, data=Regression(), loss_fn=mse, max_steps=6)
        assert len(more.losses) == 6 and more.losses[:4] == first.losses
        assert "checkpoint_step00000006" in more.checkpoint
        from rayzero.checkpoint.tools import inspect

        assert inspect(more.checkpoint)["step"] == 6  # the Result's checkpoint URI opens as it is
    finally:
        ray.shutdown()
