"""examples/train.py's command line: --help, bad values, the default storage and --resume's run selection.

No Ray: every check here ends before ``rayzero.fit`` is called.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest

import rayzero
from rayzero.train.cluster_config import STORAGE_ENV, default_storage

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "examples", "train.py")
FLAGS = ["--max-steps", "--workers", "--stage", "--storage", "--name", "--resume", "--global-batch", "--context",
         "--lr", "--checkpoint-every", "--cpus-per-worker", "--gpu", "--verbose"]


def _load():
    spec = importlib.util.spec_from_file_location("rayzero_example_train_cli", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


train = _load()


def _script(*argv, env=None):
    env = {**os.environ, **(env or {})}
    env.pop("RAY_ADDRESS", None)
    return subprocess.run([sys.executable, SCRIPT, *argv], capture_output=True, text=True, timeout=120, env=env)


def _fake_run(storage, name, step=None):
    """A run directory as Ray Train leaves it: a checkpoint snapshot naming checkpoint_step<step>, if step."""
    run = storage / name
    run.mkdir(parents=True)
    (run / "metrics.jsonl").write_text("")
    if step is not None:
        tag = f"checkpoint_step{step:08d}"
        (run / tag).mkdir()
        latest = {"version": 0, "checkpoint_dir_name": tag, "metrics": {"step": step}}
        (run / "checkpoint_manager_snapshot.json").write_text(
            json.dumps({"checkpoint_results": [latest], "latest_checkpoint_result": latest}))
    return run


def test_help_lists_every_flag_with_its_default():
    out = _script("--help")
    assert out.returncode == 0, out.stderr
    for flag in FLAGS:
        assert flag in out.stdout
    assert out.stdout.count("(default:") == len(FLAGS)


@pytest.mark.parametrize("argv, flag", [
    (["--workers", "0"], "--workers"),
    (["--workers", "3,1"], "--workers"),
    (["--workers", "1,2,3"], "--workers"),
    (["--workers", "two"], "--workers"),
    (["--max-steps", "-1"], "--max-steps"),
    (["--max-steps", "0"], "--max-steps"),
    (["--max-steps", "ten"], "--max-steps"),
    (["--stage", "5"], "--stage"),
    (["--lr", "abc"], "--lr"),
    (["--lr", "0"], "--lr"),
    (["--lr", "nan"], "--lr"),
    (["--global-batch", "0"], "--global-batch"),
    (["--context", "-3"], "--context"),
    (["--checkpoint-every", "-1"], "--checkpoint-every"),
    (["--cpus-per-worker", "0"], "--cpus-per-worker"),
    (["--name", "a/b"], "--name"),
])
def test_bad_value_is_a_one_line_error(argv, flag, capsys, tmp_path):
    with pytest.raises(SystemExit) as e:
        train.parse_args([*argv, "--storage", str(tmp_path)])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert f": error: argument {flag}: " in err[-1]  # argparse's usage, then the one-line error
    assert "Traceback" not in "\n".join(err)


@pytest.mark.parametrize("argv, flag", [(["--workers", "3,1"], "--workers"), (["--max-steps", "-1"], "--max-steps")])
def test_bad_value_ends_the_script_with_exit_code_2_and_no_traceback(argv, flag, tmp_path):
    out = _script(*argv, "--storage", str(tmp_path))
    assert out.returncode == 2
    assert "Traceback" not in out.stderr + out.stdout
    assert out.stderr.strip().splitlines()[-1].startswith(f"train.py: error: argument {flag}: ")
    assert os.listdir(tmp_path) == []  # it stopped before any run was made


def test_resume_with_nothing_to_resume_is_a_one_line_error(tmp_path):
    _fake_run(tmp_path, "tiny-gpt-20250101-120000")  # stopped before its first checkpoint
    out = _script("--resume", "--storage", str(tmp_path))
    assert out.returncode == 2
    assert "Traceback" not in out.stderr + out.stdout
    last = out.stderr.strip().splitlines()[-1]
    assert last.startswith("train.py: error: argument --resume: no run 'tiny-gpt'") and str(tmp_path) in last


def test_resume_picks_the_latest_run_of_the_name_that_has_a_checkpoint(tmp_path):
    _fake_run(tmp_path, "tiny-gpt-20250101-120000", step=10)
    _fake_run(tmp_path, "tiny-gpt-20250102-080000", step=20)
    _fake_run(tmp_path, "tiny-gpt-20250103-090000")  # newest, but nothing to resume from
    _fake_run(tmp_path, "tiny-gpt-big-20250104-000000", step=30)  # another name
    _fake_run(tmp_path, "tiny-gpt", step=5).rename(tmp_path / "tiny-gptx")  # prefix only, not a run of the name
    (tmp_path / "tiny-gpt-20250105-000000").write_text("a file, not a run")
    assert train.find_resumable(str(tmp_path), "tiny-gpt") == ("tiny-gpt-20250102-080000", 20)
    assert train.find_resumable(str(tmp_path), "tiny-gpt-big") == ("tiny-gpt-big-20250104-000000", 30)
    # a whole run name continues that run
    assert train.find_resumable(str(tmp_path), "tiny-gpt-20250101-120000") == ("tiny-gpt-20250101-120000", 10)
    assert train.find_resumable(str(tmp_path), "other") is None
    assert train.find_resumable(str(tmp_path / "missing"), "tiny-gpt") is None


def test_resume_sets_the_run_and_its_step(tmp_path):
    _fake_run(tmp_path, "tiny-gpt-20250101-120000", step=10)
    args = train.parse_args(["--resume", "--storage", str(tmp_path), "--max-steps", "30"])
    assert (args.name, args.resumed_step) == ("tiny-gpt-20250101-120000", 10)
    fresh = train.parse_args(["--storage", str(tmp_path)])
    assert fresh.resumed_step is None and fresh.name.startswith("tiny-gpt-") and fresh.name != args.name


def test_resume_past_max_steps_is_an_error(tmp_path, capsys):
    _fake_run(tmp_path, "tiny-gpt-20250101-120000", step=60)
    with pytest.raises(SystemExit) as e:
        train.parse_args(["--resume", "--storage", str(tmp_path), "--max-steps", "60"])
    assert e.value.code == 2
    assert "argument --max-steps: run 'tiny-gpt-20250101-120000' is already at step 60" in capsys.readouterr().err


def test_default_storage_is_absolute_and_outside_the_working_dir(monkeypatch, tmp_path):
    monkeypatch.delenv(STORAGE_ENV, raising=False)
    monkeypatch.chdir(tmp_path)  # like Ray's temporary --working-dir copy
    home = os.path.expanduser("~")
    assert default_storage() == os.path.join(home, "rayzero_runs")
    assert rayzero.ClusterConfig().storage == os.path.join(home, "rayzero_runs")
    assert train.parse_args([]).storage == os.path.join(home, "rayzero_runs")
    monkeypatch.setenv(STORAGE_ENV, str(tmp_path / "runs"))
    assert rayzero.ClusterConfig().storage == str(tmp_path / "runs")
    assert train.parse_args([]).storage == str(tmp_path / "runs")
    monkeypatch.setenv(STORAGE_ENV, "s3://bucket/runs")
    assert rayzero.ClusterConfig.from_any({}).storage == "s3://bucket/runs"
    # a relative --storage becomes a full path, so the printed run directory can be plotted from anywhere
    assert train.parse_args(["--storage", "rel"]).storage == str(tmp_path / "rel")


def test_run_path_matches_fit():
    assert train.run_path("/a/runs", "x") == "/a/runs/x"
    assert train.run_path("s3://b/runs/?endpoint_override=h:9", "x") == "s3://b/runs/x?endpoint_override=h:9"
