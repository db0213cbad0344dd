"""rayzero launch (rayzero/deepspeed/launch.py) on the suite's local Ray cluster: a DeepSpeed-style script run
on 2 rank actors gives DeepSpeed's recorded losses (tests/data/deepspeed_cifar_style_plain.json, DeepSpeed
0.19.8 on 2 CPU ranks, as tests/test_deepspeed_compat.py compares under torchrun); a rank that raises ends
the run with a non-zero status naming it and its error, and the other rank is ended."""

from __future__ import annotations

import json
import os
import time

import pytest

import shared_ray
from test_deepspeed_compat import TOL, _assert_close, _reference

ray = pytest.importorskip("ray")
SHARED_RAY = True  # runs on the suite's one local cluster (tests/shared_ray.py)
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module", autouse=True)
def ray_cluster():
    yield shared_ray.start()  # the suite's one cluster (tests/shared_ray.py)


def _rank_actors_alive() -> int:
    from ray._private.state import actors

    return sum(a["ActorClassName"] == "RankProcess" for a in actors(actor_state_name="ALIVE").values())


def test_launch_runs_a_deepspeed_script_with_deepspeeds_losses(ray_cluster, tmp_path):
    from rayzero.deepspeed.launch import launch

    out = tmp_path / "record.json"
    args = ["--deepspeed_config", os.path.join(ROOT, "examples", "deepspeed_cifar_style.json"),
            "--ckpt_dir", str(tmp_path / "ckpt"), "--out", str(out)]
    status = launch(os.path.join(ROOT, "examples", "deepspeed_cifar_style.py"), args, workers=2,
                    address=ray_cluster, env={"RAYZERO_DEEPSPEED": "1", "OMP_NUM_THREADS": "1"})
    assert status == 0
    got, ref = json.loads(out.read_text()), _reference("plain")
    assert (got["world_size"], got["local_rank"], got["device"]) == (2, 0, "cpu")
    for rank in range(2):
        _assert_close(got["losses_per_rank"][rank], ref["losses_per_rank"][rank], TOL, f"rank {rank} losses")
        _assert_close(got["resumed_losses_per_rank"][rank], ref["resumed_losses_per_rank"][rank], TOL,
                      f"rank {rank} losses after load_checkpoint")
    assert got["lrs"] == ref["lrs"]
    assert _rank_actors_alive() == 0


# rank 0 records what it was given and sleeps; rank 1 waits for that record, then raises
FAILING = """
import json, os, sys, time
rank = int(os.environ["RANK"])
if rank == 1:
    while not os.path.exists(os.environ["MARK"]):
        time.sleep(0.05)
    raise ValueError("rank one cannot go on")
names = ["RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"]
record = {"env": {k: os.environ[k] for k in names}, "argv": sys.argv, "cwd": os.getcwd(), "name": __name__}
with open(os.environ["MARK"] + ".tmp", "w") as f:
    json.dump(record, f)
os.replace(os.environ["MARK"] + ".tmp", os.environ["MARK"])
time.sleep(120)
"""


def test_a_failing_rank_ends_the_run_with_its_status_and_error(ray_cluster, tmp_path, capsys):
    from rayzero.cli import main
    from rayzero.deepspeed.launch import launch

    script = tmp_path / "fails_on_rank_1.py"
    script.write_text(FAILING)
    mark = tmp_path / "rank0-started"
    started = time.monotonic()
    # through the command line (`rayzero launch`): options after the script are the script's
    status = main(["launch", "--workers", "2", "--address", ray_cluster, "--env", f"MARK={mark}", str(script),
                   "--flag", "x", "--workers", "9"])
    took = time.monotonic() - started
    assert status == 1
    err = capsys.readouterr().err
    assert "rank 1 failed with exit status 1" in err, err
    assert "ValueError: rank one cannot go on" in err, err
    record = json.loads(mark.read_text())
    env = record["env"]
    assert {k: env[k] for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")} == \
        {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "2"}
    assert env["MASTER_ADDR"] == ray.util.get_node_ip_address() and 0 < int(env["MASTER_PORT"]) < 65536
    assert record["argv"] == [str(script), "--flag", "x", "--workers", "9"]
    assert (record["cwd"], record["name"]) == (os.getcwd(), "__main__")
    # rank 0, which would sleep 120 s, was ended: no rank actor is left
    assert took < 60, took
    assert _rank_actors_alive() == 0
    # a script that is not there: every rank says so, and the status is not 0
    status = launch(str(tmp_path / "missing.py"), [], workers=1, address=ray_cluster)
    assert status == 2
    assert "no script" in capsys.readouterr().err
    # more ranks than the local cluster (3 CPUs) holds: refused at once
    with pytest.raises(RuntimeError, match="cannot place 5 ranks"):
        launch(str(script), [], workers=5, address=ray_cluster)
