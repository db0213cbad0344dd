"""Universal checkpoints on S3, for real: a local S3-compatible server (moto) on 127.0.0.1, reached through
``pyarrow.fs.S3FileSystem`` exactly as a user's ``s3://bucket/prefix?endpoint_override=...`` URI would be.

A 2-rank ZeRO-2 run trains 3 steps, saves to S3 and trains 2 more; fresh engines (2 ranks stage 2, and one
in-process rank at stage 3) load from S3 and train the same 2 steps.  The same world and stage must repeat the
uninterrupted run bitwise; the resharded world-1 stage-3 run must match within 1e-6 relative.  An async save
to S3 must load back bitwise too.  The server is stopped when the module's tests end.
"""

from __future__ import annotations

import json
import logging
import os
import random

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import rayzero
from distributed import run_distributed

try:  # the S3 server; a dependency of the `test` extra, so CI always runs this file
    import boto3
    from moto.server import ThreadedMotoServer
except ImportError as e:
    pytest.skip(f"moto is not importable ({e}); install the test extra (pip install 'moto[server]') to run the S3 "
                "checkpoint tests against a local S3 server", allow_module_level=True)

BUCKET = "rayzero-ckpt"
PREFIX = "runs/job1"
ASYNC_PREFIX = "runs/job1-async"
DIM, HIDDEN, OUT = 12, 40, 6
MICRO = 4  # samples per rank per step at world 2
SAVE_AT, MORE = 3, 2
S3_ENV = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_SESSION_TOKEN": "",
    "AWS_DEFAULT_REGION": "us-east-1",
    "AWS_EC2_METADATA_DISABLED": "true",  # no credential/region lookups against 169.254.169.254
}


# ---- model, data, training loop (module level: the spawned ranks import them) -------------------------
class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = torch.nn.Linear(DIM, HIDDEN)
        self.ln = torch.nn.LayerNorm(HIDDEN)
        self.fc2 = torch.nn.Linear(HIDDEN, OUT)
        self.register_buffer("offset", torch.linspace(-1.0, 1.0, OUT))  # a buffer: saved whole by rank 0

    def forward(self, x):
        return self.fc2(F.gelu(self.ln(self.fc1(x)))) + self.offset


def global_batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(11)
    return [(torch.randn(2 * MICRO, DIM, generator=g), torch.randn(2 * MICRO, OUT, generator=g))
            for _ in range(SAVE_AT + MORE)]


def config(world: int, stage: int) -> dict:
    return {
        "train_batch_size": 2 * MICRO,
        "train_micro_batch_size_per_gpu": 2 * MICRO // world,
        "zero_optimization": {"stage": stage, "reduce_bucket_size": 200, "allgather_bucket_size": 200,
                              "stage3_param_persistence_threshold": 0},
        "optimizer": {"type": "AdamW", "params": {"lr": 3e-3, "weight_decay": 0.01}},
        "gradient_clipping": 1.0,
    }


def train(engine, steps: range, rank: int, world: int) -> list[float]:
    """Train on ``steps`` of the global batches; return each step's loss over the whole global batch."""
    data = global_batches()
    per = 2 * MICRO // world
    losses = []
    for i in steps:
        x, y = data[i]
        loss = F.mse_loss(engine(x[rank * per:(rank + 1) * per]), y[rank * per:(rank + 1) * per])
        engine.backward(loss)
        engine.step()
        t = loss.detach().double().reshape(1)
        if world > 1:
            torch.distributed.all_reduce(t)
        losses.append(t.item() / world)
    return losses


def fresh_engine(world: int, stage: int):
    torch.manual_seed(0)
    model = Net()
    with torch.no_grad():  # different starting weights than the saved run: the load must overwrite them all
        for p in model.parameters():
            p.add_(1.0)
        model.offset.zero_()
    return rayzero.initialize(model, config(world, stage))


def state(engine) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in engine.full_state_dict().items()}


def uninterrupted_with_save(rank: int, world: int, uri: str, async_uri: str) -> dict:
    torch.manual_seed(0)
    engine = rayzero.initialize(Net(), config(world, 2))
    out = {"losses_before": train(engine, range(SAVE_AT), rank, world)}
    out["tag"] = engine.save_checkpoint(uri, client_state={"epoch": 1, "next_batch": SAVE_AT})
    out["state_at_save"] = state(engine)
    out["losses_after"] = train(engine, range(SAVE_AT, SAVE_AT + MORE), rank, world)
    out["state_end"] = state(engine)
    # the final state once more, written by the background thread; destroy() waits for it
    out["async_tag"] = engine.save_checkpoint(async_uri, tag="final", async_save=True)
    engine.destroy()
    return out


def resume(rank: int, world: int, uri: str, stage: int) -> dict:
    engine = fresh_engine(world, stage)
    client_state = engine.load_checkpoint(uri)
    out = {"client_state": client_state, "global_steps_loaded": engine.global_steps,
           "state_loaded": state(engine), "load_report": list(engine.load_report)}
    out["losses_after"] = train(engine, range(client_state["next_batch"], SAVE_AT + MORE), rank, world)
    out["state_end"] = state(engine)
    engine.destroy()
    return out


# ---- the S3 server ---------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def s3():
    """A moto S3 server on loopback with one bucket; yields (uri of a prefix, boto3 client). Stopped at the end."""
    saved_env = {k: os.environ.get(k) for k in S3_ENV}
    os.environ.update(S3_ENV)  # the spawned ranks inherit these
    access_log = logging.getLogger("werkzeug")
    log_level = access_log.level
    access_log.setLevel(logging.ERROR)  # one access-log line per request otherwise
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    try:
        host, port = server.get_host_and_port()
        endpoint = f"{host}:{port}"
        client = boto3.client("s3", endpoint_url=f"http://{endpoint}", region_name="us-east-1",
                              aws_access_key_id="testing", aws_secret_access_key="testing")
        client.create_bucket(Bucket=BUCKET)

        def uri(prefix: str) -> str:
            # pyarrow.fs.S3FileSystem options as URI query keys; with endpoint_override pyarrow does not look
            # up the bucket's region, and region= pins it against a developer's AWS config.  Credentials come
            # from the AWS_* variables above (pyarrow's default credential chain).
            return f"s3://{BUCKET}/{prefix}?endpoint_override={endpoint}&scheme=http&region=us-east-1"

        yield uri, client
    finally:
        server.stop()
        access_log.setLevel(log_level)
        for k, v in saved_env.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@pytest.fixture(scope="module")
def saved_run(s3):
    uri, _ = s3
    return run_distributed(uninterrupted_with_save, 2, uri(PREFIX), uri(ASYNC_PREFIX), timeout=120.0)


def _objects(client, prefix: str) -> dict[str, int]:
    pages = client.get_paginator("list_objects_v2").paginate(Bucket=BUCKET, Prefix=prefix)
    return {o["Key"]: o["Size"] for page in pages for o in page.get("Contents", [])}


def _assert_bitwise(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert list(a) == list(b)
    for k in a:
        assert torch.equal(a[k], b[k]), f"{k} differs: max abs {(a[k] - b[k]).abs().max().item():.3e}"


def _assert_rel(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], rel: float) -> None:
    assert list(a) == list(b)
    for k in a:
        err = ((a[k].double() - b[k].double()).norm() / b[k].double().norm().clamp_min(1e-30)).item()
        assert err <= rel, f"{k}: relative difference {err:.3e} > {rel}"


# ---- tests -----------------------------------------------------------------------------------------------
def test_committed_objects_on_s3(s3, saved_run):
    _, client = s3
    tag = saved_run[0]["tag"]
    assert tag == f"global_step{SAVE_AT}" and saved_run[1]["tag"] == tag
    objects = _objects(client, PREFIX + "/")
    assert f"{PREFIX}/latest" in objects, sorted(objects)
    latest = client.get_object(Bucket=BUCKET, Key=f"{PREFIX}/latest")["Body"].read().decode().strip()
    assert latest == tag
    key = f"{PREFIX}/{tag}/manifest.json"
    assert key in objects, sorted(objects)
    manifest = json.loads(client.get_object(Bucket=BUCKET, Key=key)["Body"].read())
    assert manifest["world_size"] == 2 and manifest["stage"] == 2 and manifest["global_steps"] == SAVE_AT
    assert manifest["client_state"] == {"epoch": 1, "next_batch": SAVE_AT}
    for info in manifest["files"]:  # every fragment file is an object of the size the manifest records
        assert objects.get(f"{PREFIX}/{tag}/{info['file']}") == info["size"], (info, sorted(objects))
    assert {i["file"] for i in manifest["files"]} == {"rank_00000.arrow", "rank_00001.arrow"}
    leftovers = [k for k in objects if k.endswith((".done.json", ".error.json", ".partial"))]
    assert not leftovers, leftovers


def test_resume_same_world_and_stage_is_bitwise(s3, saved_run):
    uri, _ = s3
    resumed = run_distributed(resume, 2, uri(PREFIX), 2, timeout=120.0)
    for rank in range(2):
        ref, got = saved_run[rank], resumed[rank]
        assert got["client_state"] == {"epoch": 1, "next_batch": SAVE_AT}
        assert got["global_steps_loaded"] == SAVE_AT and got["load_report"] == []
        _assert_bitwise(got["state_loaded"], ref["state_at_save"])
        assert got["losses_after"] == ref["losses_after"]
        _assert_bitwise(got["state_end"], ref["state_end"])


@pytest.fixture
def one_rank_here(monkeypatch):
    """This test process as a world of one (no process group), its RNG streams restored afterwards."""
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(var, raising=False)
    assert not torch.distributed.is_initialized()
    py_state, np_state = random.getstate(), np.random.get_state()
    with torch.random.fork_rng(devices=[]):  # loading at a new world size re-seeds every stream
        yield
    random.setstate(py_state)
    np.random.set_state(np_state)


def test_resume_world1_stage3_matches(s3, saved_run, one_rank_here):
    uri, _ = s3
    got = resume(0, 1, uri(PREFIX), 3)
    ref = saved_run[0]
    assert got["client_state"] == {"epoch": 1, "next_batch": SAVE_AT}
    assert got["global_steps_loaded"] == SAVE_AT
    _assert_bitwise(got["state_loaded"], ref["state_at_save"])  # resharding moves bytes, changes none
    assert got["losses_after"] == pytest.approx(ref["losses_after"], rel=1e-6)
    _assert_rel(got["state_end"], ref["state_end"], 1e-6)


def test_async_save_to_s3_loads(s3, saved_run, one_rank_here):
    uri, client = s3
    assert saved_run[0]["async_tag"] == "final"
    assert client.get_object(Bucket=BUCKET, Key=f"{ASYNC_PREFIX}/latest")["Body"].read().decode() == "final"
    engine = fresh_engine(1, 2)
    try:
        engine.load_checkpoint(uri(ASYNC_PREFIX))
        assert engine.global_steps == SAVE_AT + MORE
        _assert_bitwise(state(engine), saved_run[0]["state_end"])
    finally:
        engine.destroy()
