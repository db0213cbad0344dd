"""Universal checkpoints: save at one world size and stage, resume at others, exactly."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch

from ckpt_cases import async_vs_sync, load_and_view, resume, save_after, save_and_view, uninterrupted
from distributed import run_distributed
from test_zero import assert_matches_reference
from zero_cases import reference_run

import rayzero
from rayzero.checkpoint.format import CheckpointError, ChecksumError

FIRST, MORE, GLOBAL_BATCH = 5, 5, 12


@pytest.fixture(scope="module")
def saved_w2_s2(tmp_path_factory):
    save_dir = str(tmp_path_factory.mktemp("ckpt") / "run")
    run_distributed(save_after, 2, 2, FIRST, GLOBAL_BATCH, save_dir)
    return save_dir


@pytest.mark.parametrize("world,stage", [(3, 3), (1, 0), (2, 1)])
def test_resume_on_another_world_size_and_stage_matches_reference(saved_w2_s2, world, stage):
    ref = reference_run(FIRST + MORE, GLOBAL_BATCH)
    tail = {"losses": ref["losses"][FIRST:], "norms": ref["norms"][FIRST:], "state": ref["state"]}
    if world == 1:
        r = resume(0, 1, stage, FIRST, MORE, GLOBAL_BATCH, saved_w2_s2)
    else:
        r = run_distributed(resume, world, stage, FIRST, MORE, GLOBAL_BATCH, saved_w2_s2)[0]
    assert_matches_reference(r, tail, what=f"saved at world 2 stage 2, resumed at world {world} stage {stage}")


def test_same_world_and_stage_deterministic_resume_is_bitwise(tmp_path):
    save_dir = str(tmp_path / "run")
    full = run_distributed(uninterrupted, 2, 2, FIRST + MORE, GLOBAL_BATCH, deterministic=True)[0]
    run_distributed(save_after, 2, 2, FIRST, GLOBAL_BATCH, save_dir, deterministic=True)
    resumed = run_distributed(resume, 2, 2, FIRST, MORE, GLOBAL_BATCH, save_dir, deterministic=True)[0]
    assert resumed["losses"] == full["losses"][FIRST:]
    assert resumed["norms"] == full["norms"][FIRST:]
    for name, t in full["state"].items():
        assert torch.equal(resumed["state"][name], t), name


@pytest.mark.parametrize("impl", ["fused", "foreach"])  # capturable runs on accelerators only
def test_optimizer_steps_restored_in_their_own_form(tmp_path, impl):
    """Fused and foreach AdamW: step counts (dtype, device) and the continued updates are exact."""
    save_dir = str(tmp_path / impl)
    opt = {"optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01, impl: True}}}
    before = run_distributed(save_and_view, 2, 2, save_dir, **opt)[0]
    after = run_distributed(load_and_view, 2, 2, save_dir, **opt)[0]
    assert after["view"]["steps"] == before["view"]["steps"]
    assert before["view"]["steps"][0][0] == 3.0
    for key, t in before["view"]["states"].items():
        assert torch.equal(after["view"]["states"][key], t), key
    assert after["more"] == before["more"]  # losses and norms of the continued steps
    for name, t in before["after"].items():
        assert torch.equal(after["after"][name], t), name


def test_bf16_masters_and_moments_come_back_bit_identical(tmp_path):
    save_dir = str(tmp_path / "bf16")
    before = run_distributed(save_and_view, 2, 2, save_dir, bf16={"enabled": True})[0]
    after = run_distributed(load_and_view, 3, 3, save_dir, bf16={"enabled": True})[0]  # other world and stage
    for name, t in before["view"]["master"].items():
        assert t.dtype == torch.float32
        assert torch.equal(after["view"]["master"][name], t), name
    assert before["view"]["states"], "no optimizer state was compared"
    for key, t in before["view"]["states"].items():
        assert t.dtype == torch.float32
        assert torch.equal(after["view"]["states"][key], t), key


def _sha(path):
    return hashlib.sha256(open(path, "rb").read()).hexdigest()


@pytest.mark.parametrize("hold_s", [0.0, 1.0], ids=["prompt", "copies-held"])
def test_async_save_gives_the_same_files_as_sync(tmp_path, hold_s):
    """The async save copies the state on its own thread while training goes on; the next optimizer step
    waits for those copies (held back 1 s in the second case), so the files are the sync save's, bitwise."""
    sync_dir, async_dir = str(tmp_path / "sync"), str(tmp_path / "async")
    first_step_s = run_distributed(async_vs_sync, 2, 2, sync_dir, async_dir, hold_s)
    for r in range(2):
        name = f"rank_{r:05d}.arrow"
        assert _sha(os.path.join(sync_dir, "global_step3", name)) == _sha(os.path.join(async_dir, "global_step3", name))
    m_sync = json.load(open(os.path.join(sync_dir, "global_step3", "manifest.json")))
    m_async = json.load(open(os.path.join(async_dir, "global_step3", "manifest.json")))
    for key in ("params", "optimizer", "scheduler", "global_steps", "files", "rng", "client_state"):
        assert m_sync[key] == m_async[key], key
    assert open(os.path.join(sync_dir, "latest")).read() == "later"
    if hold_s:
        assert min(first_step_s) >= 0.8 * hold_s  # the step waited for the copies


def _small_engine(stage=2):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(7, 13), torch.nn.ReLU(), torch.nn.Linear(13, 5))
    return rayzero.initialize(model, {"zero_optimization": {"stage": stage}})


def _one_step(engine):
    engine.backward(engine(torch.randn(4, 7)).pow(2).mean())
    engine.step()


def test_corrupt_fragment_and_truncated_manifest_give_clear_errors(tmp_path):
    engine = _small_engine()
    _one_step(engine)
    tag = engine.save_checkpoint(str(tmp_path))
    frag = tmp_path / tag / "rank_00000.arrow"
    data = bytearray(frag.read_bytes())
    data[len(data) // 3] ^= 0xFF  # inside the first fragment's data
    frag.write_bytes(bytes(data))
    with pytest.raises(ChecksumError, match="rank_00000.arrow"):
        engine.load_checkpoint(str(tmp_path))
    tag2 = engine.save_checkpoint(str(tmp_path), tag="second")
    manifest = tmp_path / tag2 / "manifest.json"
    manifest.write_bytes(manifest.read_bytes()[:200])
    with pytest.raises(CheckpointError, match="manifest.json.*truncated or corrupt"):
        engine.load_checkpoint(str(tmp_path))
    engine.destroy()


def test_load_reads_fragments_into_the_optimizers_own_tensors_and_checks_every_piece(tmp_path):
    from rayzero.checkpoint.format import READ_PIECE, FragmentFile
    from rayzero.checkpoint.reader import FragmentIndex, read_manifest
    from rayzero.checkpoint.storage import Storage

    torch.manual_seed(0)
    # 3 MiB-element weights: each fragment spans several pread pieces
    model = torch.nn.Sequential(torch.nn.Linear(1536, 2048), torch.nn.ReLU(), torch.nn.Linear(2048, 3))
    engine = rayzero.initialize(model, {"zero_optimization": {"stage": 2}})
    engine.backward(engine(torch.randn(4, 1536)).pow(2).mean())
    engine.step()
    tag = engine.save_checkpoint(str(tmp_path))
    master = engine.partitions.groups[0].master
    state = engine.optimizer.state[master]
    saved = {"fp32": master.clone(), **{k: v.clone() for k, v in state.items() if torch.is_tensor(v)}}
    tensors = {k: state[k] for k in ("exp_avg", "exp_avg_sq")}
    with torch.no_grad():  # a second step, then back
        master.add_(1.0)
        for t in tensors.values():
            t.mul_(3.0)
    engine.load_checkpoint(str(tmp_path))
    state = engine.optimizer.state[master]
    for k, t in tensors.items():
        assert state[k] is t  # read in place: the optimizer keeps its tensor
        assert torch.equal(t, saved[k])
    assert torch.equal(master, saved["fp32"])
    assert state["step"] == saved["step"]

    # the direct read gives the bytes the mapped read gives, and checks the hash of every piece
    storage = Storage.resolve(str(tmp_path))
    index = FragmentIndex(storage, tag, read_manifest(storage, tag))
    ff = index.files["rank_00000.arrow"]
    big = max(range(len(ff.index)), key=lambda i: ff.index[i]["end"] - ff.index[i]["start"])
    entry = ff.index[big]
    assert (entry["end"] - entry["start"]) * 4 > 2 * READ_PIECE
    out = torch.empty(entry["end"] - entry["start"], dtype=torch.float32)
    assert ff.read_into(big, out)
    assert torch.equal(out, ff.read(big))
    # a flipped byte in the last piece of that fragment
    path = tmp_path / tag / "rank_00000.arrow"
    data, lo, hi = ff._data(big)
    at = data.address - ff._map_address() + hi - 5
    raw = bytearray(path.read_bytes())
    raw[at] ^= 0x01
    path.write_bytes(bytes(raw))
    fresh = FragmentFile("rank_00000.arrow", storage.open_random_access(str(path)), str(path))
    with pytest.raises(ChecksumError, match=f"fragment {entry['param']}/{entry['state']}"):
        fresh.read_into(big, out)
    with pytest.raises(ChecksumError):
        fresh.read(big)
    engine.destroy()


def test_other_model_lists_missing_unexpected_and_misshaped_names(tmp_path):
    engine = _small_engine()
    engine.save_checkpoint(str(tmp_path))
    engine.destroy()
    torch.manual_seed(0)
    other = torch.nn.Sequential(torch.nn.Linear(7, 13), torch.nn.ReLU(), torch.nn.Linear(13, 6), torch.nn.Linear(6, 2))
    engine = rayzero.initialize(other, {"zero_optimization": {"stage": 2}})
    with pytest.raises(CheckpointError) as err:
        engine.load_checkpoint(str(tmp_path))
    text = str(err.value)
    assert "missing in the checkpoint: ['3.bias', '3.weight']" in text
    assert "2.weight: checkpoint [5, 13] vs model [6, 13]" in text and "strict=False" in text
    engine.load_checkpoint(str(tmp_path), strict=False)
    got = engine.full_state_dict()
    saved = _small_engine().full_state_dict()  # same seed: what the checkpoint holds for layer 0
    assert torch.equal(got["0.weight"], saved["0.weight"])
    assert any("shape mismatch" in line for line in engine.load_report)
    engine.destroy()


KILL_SCRIPT = textwrap.dedent(
    """
    import sys, time, torch, rayzero
    save_dir = sys.argv[1]
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(2048, 2048) for _ in range(24)])  # 100M params
    engine = rayzero.initialize(model, {"zero_optimization": {"stage": 1}})
    engine.backward(engine(torch.randn(2, 2048)).pow(2).mean()); engine.step()
    engine.save_checkpoint(save_dir, tag="good")
    print("saved good", flush=True)
    engine.backward(engine(torch.randn(2, 2048)).pow(2).mean()); engine.step()
    engine.save_checkpoint(save_dir, tag="partial")
    print("saved partial", flush=True)
    """
)


def test_sigkill_during_save_leaves_previous_checkpoint_valid(tmp_path):
    save_dir = tmp_path / "run"
    script = tmp_path / "kill_me.py"
    script.write_text(KILL_SCRIPT)
    proc = subprocess.Popen([sys.executable, str(script), str(save_dir)], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "saved good"
        partial = save_dir / ".tmp-partial" / "rank_00000.arrow.partial"
        deadline = time.monotonic() + 120
        while not (partial.exists() and partial.stat().st_size > 0):
            assert time.monotonic() < deadline and proc.poll() is None, "the second save never started"
            time.sleep(0.005)
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.wait()
    assert (save_dir / "latest").read_text() == "good"
    assert not (save_dir / "partial").exists()

    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(2048, 2048) for _ in range(24)])
    engine = rayzero.initialize(model, {"zero_optimization": {"stage": 1}})
    engine.load_checkpoint(str(save_dir))  # the previous checkpoint loads
    assert engine.global_steps == 1
    engine.save_checkpoint(str(save_dir), tag="next")
    assert sorted(os.listdir(save_dir)) == ["good", "latest", "next"]  # the partial one is cleaned up
    engine.destroy()


def test_unwritable_save_dir_is_a_clear_error_and_loses_nothing(tmp_path):
    engine = _small_engine()
    _one_step(engine)
    engine.save_checkpoint(str(tmp_path / "ok"))
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    with pytest.raises(CheckpointError, match="cannot create checkpoint directory"):
        engine.save_checkpoint(str(blocker / "sub"))
    assert engine.load_checkpoint(str(tmp_path / "ok")) is None
    engine.destroy()
