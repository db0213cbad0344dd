"""Offline checkpoint tools (inspect, verify, export) and the `rayzero ckpt` command, on real checkpoints."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch

import rayzero
from ckpt_cases import TiedLM
from distributed import run_distributed
from rayzero.checkpoint.format import CheckpointError, FragmentFile, manifest_bytes
from rayzero.checkpoint.tools import export, format_inspect, inspect, verify

VOCAB, DIM = 11, 6


def make_mlp() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(7, 13), torch.nn.ReLU(), torch.nn.Linear(13, 5), torch.nn.BatchNorm1d(5)
    )


def make_tied() -> torch.nn.Module:
    torch.manual_seed(0)
    return TiedLM()


def _train_and_save(engine, batches, save_dir, client_state):
    for x in batches:
        out = engine(x)
        engine.backward(out.float().pow(2).mean())
        engine.step()
    engine.save_checkpoint(save_dir, client_state=client_state)
    return {k: v.clone() for k, v in engine.full_state_dict().items()}


def _save_world2(rank: int, world: int, save_dir: str) -> dict:
    """A world-2 ZeRO-3 checkpoint of the tied model; rank 0 returns the engine's full state dict."""
    engine = rayzero.initialize(make_tied(), {"zero_optimization": {"stage": 3}})
    gen = torch.Generator().manual_seed(100 + rank)
    batches = [torch.randint(0, VOCAB, (4, 3), generator=gen) for _ in range(3)]
    full = _train_and_save(engine, batches, save_dir, {"epoch": 3, "rank_hint": "w2"})
    engine.destroy()
    return full if rank == 0 else {}


@pytest.fixture(scope="module")
def ckpt_w1(tmp_path_factory):
    """World 1, stage 2, an MLP with BatchNorm buffers, two steps."""
    save_dir = str(tmp_path_factory.mktemp("w1"))
    engine = rayzero.initialize(make_mlp(), {"zero_optimization": {"stage": 2}})
    torch.manual_seed(1)
    full = _train_and_save(engine, [torch.randn(4, 7), torch.randn(4, 7)], save_dir, {"epoch": 1, "data": [1, 2]})
    engine.destroy()
    return save_dir, full


@pytest.fixture(scope="module")
def ckpt_tied_w1(tmp_path_factory):
    save_dir = str(tmp_path_factory.mktemp("tied1"))
    engine = rayzero.initialize(make_tied(), {"zero_optimization": {"stage": 1}})
    torch.manual_seed(2)
    full = _train_and_save(engine, [torch.randint(0, VOCAB, (4, 3))], save_dir, None)
    engine.destroy()
    return save_dir, full


@pytest.fixture(scope="module")
def ckpt_w2(tmp_path_factory):
    save_dir = str(tmp_path_factory.mktemp("w2"))
    full = run_distributed(_save_world2, 2, save_dir)[0]
    return save_dir, full


def _bits(t: torch.Tensor) -> torch.Tensor:
    t = t.detach().contiguous()
    return t.reshape(-1).view(torch.uint8) if t.numel() else t


def assert_bitwise_equal(got: dict, want: dict) -> None:
    assert list(sorted(got)) == list(sorted(want))
    for k in want:
        assert got[k].dtype == want[k].dtype and got[k].shape == want[k].shape, k
        assert torch.equal(_bits(got[k]), _bits(want[k])), k


# ---- inspect -------------------------------------------------------------------------------------------
def test_inspect_world1(ckpt_w1):
    save_dir, full = ckpt_w1
    s = inspect(save_dir)
    assert (s["tag"], s["step"], s["world_size"], s["stage"]) == ("global_step2", 2, 1, 2)
    assert s["topology"] == {"dp": 1, "tp": 1, "ep": 1}
    model = make_mlp()
    assert [(p["name"], p["shape"]) for p in s["params"]] == [
        (n, list(p.shape)) for n, p in model.named_parameters()
    ]
    assert s["num_elements"] == sum(p.numel() for p in model.parameters())
    assert [w["name"] for w in s["whole"]] == [n for n, _ in model.named_buffers()]
    assert s["states"] == ["fp32", "exp_avg", "exp_avg_sq", "whole"]
    assert all(p["states"] == ["fp32", "exp_avg", "exp_avg_sq"] for p in s["params"])
    assert s["dtypes"] == ["float32"] and s["optimizer"] == "AdamW"
    assert s["client_state_keys"] == ["data", "epoch"]
    assert [f["file"] for f in s["files"]] == ["rank_00000.arrow"]
    ckpt_dir = os.path.join(save_dir, "global_step2")
    assert s["total_bytes"] == os.path.getsize(os.path.join(ckpt_dir, "rank_00000.arrow"))
    assert s["problem"] is None
    json.dumps(s)  # JSON-able as promised
    # the checkpoint directory itself, or an explicit tag, name the same checkpoint
    assert inspect(ckpt_dir) == s
    assert inspect(save_dir, tag="global_step2") == s
    text = format_inspect(s)
    for needle in ("step 2", "world size 1", "ZeRO stage 2", "0.weight", "(13, 7)", "3.running_mean",
                   "fp32,exp_avg,exp_avg_sq", "rank_00000.arrow"):
        assert needle in text, needle


def test_inspect_world2_stage3_tied(ckpt_w2):
    save_dir, _ = ckpt_w2
    s = inspect(save_dir)
    assert (s["step"], s["world_size"], s["stage"]) == (3, 2, 3)
    assert [f["file"] for f in s["files"]] == ["rank_00000.arrow", "rank_00001.arrow"]
    by_name = {p["name"]: p for p in s["params"]}
    assert by_name["wte.weight"]["aliases"] == ["head.weight"]
    assert by_name["wte.weight"]["shape"] == [VOCAB, DIM]
    assert sorted(by_name) == ["ln.bias", "ln.weight", "wte.weight"]
    assert [w["name"] for w in s["whole"]] == ["scale"]
    assert "(= head.weight)" in format_inspect(s)


def test_inspect_errors(tmp_path, ckpt_w1):
    with pytest.raises(CheckpointError, match="does not exist"):
        inspect(tmp_path / "nowhere")
    with pytest.raises(CheckpointError, match="latest"):
        inspect(tmp_path)
    with pytest.raises(CheckpointError, match="never committed"):
        inspect(ckpt_w1[0], tag="global_step99")


# ---- verify --------------------------------------------------------------------------------------------
def _copy(src: str, tmp_path) -> str:
    dst = str(tmp_path / "copy")
    shutil.copytree(src, dst)
    return dst


def _flip_middle_of_fragment(ckpt_dir: str, file: str) -> dict:
    """Flip the middle byte of the largest fragment's data in ``file``; return that fragment's index entry."""
    path = os.path.join(ckpt_dir, file)
    with open(path, "rb") as f:
        content = bytearray(f.read())
    ff = FragmentFile(file, pa_input(content))
    i = max(range(len(ff.index)), key=lambda j: ff.index[j]["end"] - ff.index[j]["start"])
    raw = bytes(ff.read(i).view(torch.uint8).numpy())
    where = content.find(raw)
    assert where > 0 and content.count(raw) == 1
    content[where + len(raw) // 2] ^= 0x5A
    with open(path, "wb") as f:
        f.write(content)
    return {"i": i, **ff.index[i]}


def pa_input(content: bytearray):
    import pyarrow as pa

    return pa.BufferReader(bytes(content))


def test_verify_detects_a_flipped_byte_in_file_and_fragment(ckpt_w2, tmp_path):
    save_dir = _copy(ckpt_w2[0], tmp_path)
    assert verify(save_dir) == []
    ckpt_dir = os.path.join(save_dir, "global_step3")
    entry = _flip_middle_of_fragment(ckpt_dir, "rank_00001.arrow")
    problems = verify(save_dir)
    assert any(p.startswith("rank_00001.arrow: file hash mismatch") for p in problems), problems
    frag = f"rank_00001.arrow: fragment {entry['i']} ({entry['param']}/{entry['state']} [{entry['start']}, "
    assert any(p.startswith(frag) and p.endswith("checksum mismatch") for p in problems), problems
    assert len(problems) == 2, problems  # nothing about rank 0's file, no coverage noise
    # the engine's own reader refuses it too
    engine = rayzero.initialize(make_tied(), {"zero_optimization": {"stage": 3}})
    try:
        with pytest.raises(CheckpointError, match="checksum mismatch|corrupt"):
            engine.load_checkpoint(save_dir)
    finally:
        engine.destroy()


def test_verify_flip_at_the_middle_of_the_file(ckpt_w1, tmp_path):
    save_dir = _copy(ckpt_w1[0], tmp_path)
    path = os.path.join(save_dir, "global_step2", "rank_00000.arrow")
    with open(path, "r+b") as f:
        f.seek(os.path.getsize(path) // 2)
        b = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([b[0] ^ 0xFF]))
    problems = verify(save_dir)
    assert problems and problems[0].startswith("rank_00000.arrow: file hash mismatch"), problems


def test_verify_missing_truncated_and_incomplete(ckpt_w2, tmp_path):
    save_dir = _copy(ckpt_w2[0], tmp_path)
    ckpt_dir = os.path.join(save_dir, "global_step3")
    os.remove(os.path.join(ckpt_dir, "rank_00000.arrow"))
    with open(os.path.join(ckpt_dir, "rank_00001.arrow"), "r+b") as f:
        f.truncate(100)
    problems = verify(save_dir)
    assert "rank_00000.arrow: missing" in problems
    assert any(p.startswith("rank_00001.arrow: size 100 bytes") for p in problems), problems
    assert any(p.startswith("rank_00001.arrow: file hash mismatch") for p in problems), problems
    assert any("corrupt or truncated" in p for p in problems), problems
    # a manifest that lists only one of two ranks' files: the missing half shows as uncovered ranges
    save_dir = _copy(ckpt_w2[0], tmp_path / "b")
    manifest_path = os.path.join(save_dir, "global_step3", "manifest.json")
    with open(manifest_path) as f:
        manifest = json.load(f)
    manifest["files"] = manifest["files"][:1]
    with open(manifest_path, "wb") as f:  # sealed with its own hash again, as a save would have written it
        f.write(manifest_bytes(manifest))
    problems = verify(save_dir)
    assert "the manifest lists 1 fragment files for world size 2" in problems
    assert any(p.startswith("wte.weight/fp32: fragments cover [0, ") for p in problems), problems


# ---- export --------------------------------------------------------------------------------------------
def _load_fresh(make, out):
    model = make()
    model.load_state_dict(torch.load(out, weights_only=True))  # strict: every key, nothing extra
    return model


@pytest.mark.parametrize("case", ["w1", "tied_w1", "w2"])
def test_export_torch_loads_into_a_fresh_model_bitwise(case, ckpt_w1, ckpt_tied_w1, ckpt_w2, tmp_path):
    (save_dir, full), make = {"w1": (ckpt_w1, make_mlp), "tied_w1": (ckpt_tied_w1, make_tied),
                              "w2": (ckpt_w2, make_tied)}[case]
    out = str(tmp_path / "model.pt")
    info = export(save_dir, out)
    assert info["path"] == out and info["tensors"] == len(full)
    saved = torch.load(out, weights_only=True)
    assert_bitwise_equal(saved, full)
    model = _load_fresh(make, out)
    assert_bitwise_equal(model.state_dict(), full)
    if make is make_tied:
        assert model.head.weight is model.wte.weight
        assert saved["head.weight"].data_ptr() == saved["wte.weight"].data_ptr()  # stored once


def test_export_safetensors(ckpt_w2, tmp_path):
    safetensors_torch = pytest.importorskip("safetensors.torch")
    save_dir, full = ckpt_w2
    out = str(tmp_path / "model.safetensors")
    export(save_dir, out)
    tensors = safetensors_torch.load_file(out)
    assert_bitwise_equal(tensors, full)
    model = make_tied()
    model.load_state_dict(tensors)
    assert_bitwise_equal(model.state_dict(), full)
    with safetensors_torch.safe_open(out, "pt") as f:
        assert f.metadata()["rayzero.tag"] == "global_step3"


def test_export_casts_to_the_parameter_dtype(tmp_path):
    """bf16 training: masters are fp32, the model (and the export) is bf16; frozen params come whole."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(7, 13), torch.nn.ReLU(), torch.nn.Linear(13, 5))
    model.register_buffer("offset", torch.arange(3.0))
    model[0].bias.requires_grad_(False)
    engine = rayzero.initialize(model, {"zero_optimization": {"stage": 3}, "bf16": {"enabled": True}})
    torch.manual_seed(3)
    full = _train_and_save(engine, [torch.randn(4, 7, dtype=torch.bfloat16)], str(tmp_path), None)
    engine.destroy()
    out = str(tmp_path / "bf16.pt")
    export(str(tmp_path), out)
    saved = torch.load(out, weights_only=True)
    manifest_dtypes = {p["name"]: p["dtype"] for p in inspect(str(tmp_path))["params"]}
    assert set(manifest_dtypes.values()) == {"bfloat16"}
    assert {k: str(v.dtype) for k, v in saved.items() if k in manifest_dtypes} == {
        k: f"torch.{d}" for k, d in manifest_dtypes.items()
    }
    want = {k: v.to(torch.bfloat16) if k in manifest_dtypes else v for k, v in full.items()}
    assert_bitwise_equal(saved, want)  # fp32 masters rounded to bf16; frozen bias and buffer as they were
    model.load_state_dict(saved)


def test_export_errors(ckpt_w1, tmp_path, monkeypatch):
    with pytest.raises(CheckpointError, match=r"\.safetensors or \*\.pt"):
        export(ckpt_w1[0], str(tmp_path / "model.npz"))
    monkeypatch.setitem(sys.modules, "safetensors", None)
    monkeypatch.setitem(sys.modules, "safetensors.torch", None)
    with pytest.raises(CheckpointError, match="pip install safetensors"):
        export(ckpt_w1[0], str(tmp_path / "model.safetensors"))
    assert not os.listdir(tmp_path)  # nothing half-written


# ---- the command ---------------------------------------------------------------------------------------
def rayzero_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "rayzero.cli", *args], capture_output=True, text=True, timeout=120)


def test_cli_inspect_verify_export(ckpt_w2, tmp_path):
    save_dir, full = _copy(ckpt_w2[0], tmp_path), ckpt_w2[1]
    r = rayzero_cli("ckpt", "inspect", save_dir)
    assert r.returncode == 0, r.stderr
    assert "wte.weight (= head.weight)" in r.stdout and "world size 2" in r.stdout and "step 3" in r.stdout
    r = rayzero_cli("ckpt", "inspect", save_dir, "--tag", "global_step3", "--json")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["world_size"] == 2

    n_fragments = sum(f["fragments"] for f in inspect(save_dir)["files"])
    r = rayzero_cli("ckpt", "verify", save_dir)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith(f"OK: 2 files, {n_fragments} fragments verified")

    out = str(tmp_path / "out" / "model.pt")
    r = rayzero_cli("ckpt", "export", save_dir, out)
    assert r.returncode == 0, r.stderr
    assert_bitwise_equal(_load_fresh(make_tied, out).state_dict(), full)

    _flip_middle_of_fragment(os.path.join(save_dir, "global_step3"), "rank_00000.arrow")
    r = rayzero_cli("ckpt", "verify", save_dir)
    assert r.returncode == 1
    assert "rank_00000.arrow: file hash mismatch" in r.stdout and "checksum mismatch" in r.stdout


def test_cli_errors_are_one_line_exit_2(tmp_path):
    r = rayzero_cli("ckpt", "verify", str(tmp_path / "nowhere"))
    assert r.returncode == 2
    assert r.stderr.count("\n") == 1 and r.stderr.startswith("rayzero: error:") and "nowhere" in r.stderr
    r = rayzero_cli("ckpt", "export", str(tmp_path), str(tmp_path / "x.bin"), "--format", "nope")
    assert r.returncode == 2  # argparse: bad choice
    r = rayzero_cli()
    assert r.returncode == 2 and "usage" in r.stderr


def test_export_of_nonpersistent_buffers_and_tied_frozen_params_loads_strictly(tmp_path):
    class Tied(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a = torch.nn.Linear(3, 3)
            self.b = torch.nn.Linear(3, 3)
            self.b.weight = self.a.weight
            self.a.weight.requires_grad_(False)
            self.register_buffer("cache", torch.ones(2), persistent=False)

        def forward(self, x):
            return self.b(self.a(x))

    torch.manual_seed(0)
    engine = rayzero.initialize(Tied(), {"zero_optimization": {"stage": 2}})
    engine.backward(engine(torch.randn(2, 3)).sum())
    engine.step()
    engine.save_checkpoint(str(tmp_path / "ck"))
    expected = engine.full_state_dict()
    engine.destroy()
    out = tmp_path / "w.pt"
    export(str(tmp_path / "ck"), str(out))
    fresh = Tied()
    fresh.load_state_dict(torch.load(out, weights_only=True))  # strict
    for name, t in fresh.state_dict().items():
        assert torch.equal(t, expected[name]), name
