"""The docs' code examples, run for real: when an example in the docs goes wrong, a test here fails.

- docs/checkpoint_format.md: the python block right after ``<!-- tested: tests/test_docs_examples.py -->``
  (reading a checkpoint with pyarrow, numpy and xxhash only), on checkpoints saved by a world-size-1 engine.
- README.md, section "Use": the training loop, the checkpoint save/load block and the ``rayzero ckpt``
  lines, at world size 1 with a tiny model.

The code is taken from the markdown files, never copied here; the tests only provide what the examples
leave to the reader (``model``, ``loader``, ``loss_fn``, the config file) and check what the code produced.
"""

from __future__ import annotations

import ast
import copy
import json
import re
import shlex
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

import rayzero
from ckpt_cases import TiedLM
from rayzero.checkpoint.tools import export

ROOT = Path(__file__).resolve().parent.parent
MARKER = "<!-- tested: tests/test_docs_examples.py -->"
FENCE = re.compile(r"^```(\w*)[ \t]*\n(.*?)^```[ \t]*$", re.S | re.M)
VOCAB, DIM = 11, 6


# ---- reading code out of markdown ----------------------------------------------------------------------
def fenced_blocks(text: str, lang: str) -> list[str]:
    return [m.group(2) for m in FENCE.finditer(text) if m.group(1) == lang]


def marked_blocks(path: Path) -> list[str]:
    """The python blocks that directly follow the marker line."""
    text = path.read_text(encoding="utf-8")
    pattern = re.compile(re.escape(MARKER) + r"[ \t]*\n```python[ \t]*\n(.*?)^```", re.S | re.M)
    blocks = [m.group(1) for m in pattern.finditer(text)]
    assert len(blocks) == text.count(MARKER), f"{path.name}: a {MARKER} line is not followed by a python block"
    return blocks


def section(text: str, heading: str) -> str:
    """The text under ``## heading`` up to the next ``## `` heading."""
    m = re.search(rf"^## {re.escape(heading)}[ \t]*\n(.*?)(?=^## |\Z)", text, re.S | re.M)
    assert m, f"no '## {heading}' section"
    return m.group(1)


def expected_output(code: str) -> str:
    """The ``# ...`` comment lines right after a top-level ``print(...)`` line: what the block prints."""
    out, lines = [], code.splitlines()
    for i, line in enumerate(lines):
        if line.startswith("print("):
            j = i + 1
            while j < len(lines) and lines[j].startswith("# "):
                out.append(lines[j][2:])
                j += 1
    return "".join(f"{line}\n" for line in out)


def run(code: str, where: str, namespace: dict | None = None) -> dict:
    ns = {"__name__": "__doc_example__", **(namespace or {})}
    exec(compile(code, where, "exec"), ns)
    return ns


# ---- models --------------------------------------------------------------------------------------------
class Mixed(torch.nn.Module):
    """Whole tensors in the dtypes the pyarrow reader must convert: bf16, int64, and a zero-element one."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(3, 2)
        self.register_buffer("bits", torch.tensor([[1.5, -2.25, 3e-3], [1e30, -0.0, 7.0]], dtype=torch.bfloat16))
        self.register_buffer("count", torch.tensor([7, -1, 2**40], dtype=torch.int64))
        self.register_buffer("empty", torch.zeros(0, 3))

    def forward(self, x):
        return self.lin(x)


# ---- docs/checkpoint_format.md -------------------------------------------------------------------------
FORMAT_DOC = ROOT / "docs" / "checkpoint_format.md"


def format_doc_block() -> str:
    blocks = marked_blocks(FORMAT_DOC)
    assert len(blocks) == 1, "docs/checkpoint_format.md: expected one tested block"
    return blocks[0]


def _train_and_save(model: torch.nn.Module, inputs: list[torch.Tensor], save_dir: Path) -> tuple[dict, dict]:
    """ZeRO-3 at this process's world size: train on ``inputs``, save to ``save_dir``; return the full state
    dict and (world size 1 only, where this rank owns every element) each parameter's exp_avg."""
    engine = rayzero.initialize(model, {"zero_optimization": {"stage": 3}, "optimizer": {"type": "AdamW",
                                                                                        "params": {"lr": 0.01}}})
    try:
        for x in inputs:
            engine.backward(engine(x).float().pow(2).mean())
            engine.step()
        engine.save_checkpoint(str(save_dir))
        full = {k: v.detach().clone() for k, v in engine.full_state_dict().items()}
        exp_avg = {}
        if engine.world_size == 1:
            for g in engine.partitions.groups:
                state = engine.optimizer.state[g.master]["exp_avg"]
                for e in g.layout.entries:
                    exp_avg[e.name] = state[e.partition_offset : e.partition_offset + e.numel].view(e.full_shape).clone()
    finally:
        engine.destroy()
    return full, exp_avg


@pytest.fixture(scope="module")
def tied_ckpt(tmp_path_factory):
    where = tmp_path_factory.mktemp("tied")
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(1)
    full, exp_avg = _train_and_save(TiedLM(), [torch.randint(0, VOCAB, (4, 3), generator=gen) for _ in range(3)],
                                    where / "ckpts")
    return where, full, exp_avg


def _save_world2(rank: int, world: int, save_dir: str) -> dict:
    """The doc's own case: the tied model saved by 2 ranks at ZeRO-3, so every tensor has 2 fragments."""
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(10 + rank)
    full, _ = _train_and_save(TiedLM(), [torch.randint(0, VOCAB, (4, 3), generator=gen) for _ in range(3)],
                              Path(save_dir))
    return full if rank == 0 else {}


@pytest.fixture(scope="module")
def tied_ckpt_world2(tmp_path_factory):
    from distributed import run_distributed

    where = tmp_path_factory.mktemp("tied2")
    full = run_distributed(_save_world2, 2, str(where / "ckpts"))[0]
    return where, full


def _bitwise(a: np.ndarray, b: torch.Tensor, name: str) -> None:
    b = b.detach().contiguous().numpy()
    assert a.shape == b.shape and a.dtype == b.dtype, (name, a.shape, a.dtype, b.shape, b.dtype)
    assert a.tobytes() == b.tobytes(), name


def test_format_doc_example_imports_no_rayzero():
    imported = set()
    for node in ast.walk(ast.parse(format_doc_block())):
        if isinstance(node, ast.Import):
            imported |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            imported.add((node.module or "").split(".")[0])
    assert imported and "rayzero" not in imported, imported


def test_format_doc_example_reads_the_checkpoint(tied_ckpt, monkeypatch, capsys, tmp_path):
    where, full, exp_avg = tied_ckpt
    code = format_doc_block()
    monkeypatch.chdir(where)  # the example names its save directory relative to the working directory
    ns = run(code, f"{FORMAT_DOC}:tested block")
    # what it prints is what the doc says it prints
    assert capsys.readouterr().out == expected_output(code)
    assert expected_output(code), "the tested block should show its output as '# ...' lines after print()"
    # every parameter (under each name), buffer and frozen parameter, bit for bit the engine's values
    weights = ns["weights"]
    assert set(weights) == set(full)
    for name, value in full.items():
        _bitwise(weights[name], value, name)
    # the optimizer state it reads is the optimizer's
    manifest = ns["manifest"]
    first = manifest["params"][0]["name"]
    _bitwise(ns["exp_avg"], exp_avg[first], f"{first}/exp_avg")
    assert manifest["global_steps"] == 3
    # and equal to the export, as the doc claims
    out = export(where / "ckpts", tmp_path / "w.pt")
    exported = torch.load(out["path"], weights_only=True)
    assert set(exported) == set(weights)
    for name, value in exported.items():
        _bitwise(weights[name], value, name)


def test_format_doc_example_assembles_fragments_of_every_rank(tied_ckpt_world2, monkeypatch, capsys):
    where, full = tied_ckpt_world2
    code = format_doc_block()
    monkeypatch.chdir(where)
    ns = run(code, f"{FORMAT_DOC}:tested block")
    assert capsys.readouterr().out == expected_output(code)
    assert [f["fragments"] for f in ns["manifest"]["files"]] == [10, 9]  # rank 0 also holds the buffer
    assert set(ns["weights"]) == set(full)
    for name, value in full.items():
        _bitwise(ns["weights"][name], value, name)


def test_format_doc_example_rejects_a_corrupt_fragment(tied_ckpt, monkeypatch, tmp_path):
    where, full, _ = tied_ckpt
    shutil.copytree(where / "ckpts", tmp_path / "ckpts")
    ckpt = tmp_path / "ckpts" / (tmp_path / "ckpts" / "latest").read_text()
    path = ckpt / "rank_00000.arrow"
    data = bytearray(path.read_bytes())
    at = bytes(data).find(full["wte.weight"].numpy().tobytes())  # the master weights' bytes in the file
    assert at > 0
    data[at + 5] ^= 0x10
    path.write_bytes(bytes(data))
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError, match=r"corrupt fragment wte\.weight/fp32"):
        run(format_doc_block(), f"{FORMAT_DOC}:tested block")


def test_format_doc_example_converts_bf16_int64_and_empty_tensors(monkeypatch, capsys, tmp_path):
    torch.manual_seed(0)
    model = Mixed()
    buffers = {k: v.clone() for k, v in model.named_buffers()}
    full, exp_avg = _train_and_save(model, [torch.randn(4, 3), torch.randn(4, 3)], tmp_path / "ckpts")
    monkeypatch.chdir(tmp_path)
    ns = run(format_doc_block(), f"{FORMAT_DOC}:tested block")
    capsys.readouterr()
    weights = ns["weights"]
    assert set(weights) == set(full)
    for name in ("lin.weight", "lin.bias"):
        _bitwise(weights[name], full[name], name)
    _bitwise(weights["bits"], buffers["bits"].float(), "bits")  # bf16 widened to float32, exactly
    _bitwise(weights["count"], buffers["count"], "count")
    assert weights["empty"].shape == (0, 3)
    _bitwise(ns["exp_avg"], exp_avg["lin.weight"], "lin.weight/exp_avg")


# ---- README.md, "Use" ----------------------------------------------------------------------------------
README = ROOT / "README.md"


def _loss_fn(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cross_entropy(logits.float().reshape(-1, VOCAB), y.reshape(-1))


def test_readme_use_example(tmp_path, monkeypatch, capsys):
    use = section(README.read_text(encoding="utf-8"), "Use")
    python = fenced_blocks(use, "python")
    train = next(b for b in python if "rayzero.initialize(" in b)
    save_load = next(b for b in python if "save_checkpoint(" in b)
    tools = next(b for b in fenced_blocks(use, "bash") if "rayzero ckpt" in b)

    # The loop's block ends with engine.destroy(); the save/load block continues with the same engine, so
    # that last line runs after it.
    lines = train.rstrip().splitlines()
    assert lines[-1].split("#")[0].strip() == "engine.destroy()", lines[-1]
    train, destroy = "\n".join(lines[:-1]) + "\n", lines[-1]

    # What the example leaves to the reader: the model, the loader, the loss and the config file it names.
    torch.manual_seed(0)
    model = TiedLM()
    reference = copy.deepcopy(model)
    gen = torch.Generator().manual_seed(3)
    loader = [(torch.randint(0, VOCAB, (4, 5), generator=gen), torch.randint(0, VOCAB, (4, 5), generator=gen))
              for _ in range(4)]
    config_path = re.search(r"rayzero\.initialize\(\s*model\s*,\s*\"([^\"]+)\"", train).group(1)
    monkeypatch.chdir(tmp_path)
    Path(config_path).write_text(json.dumps({
        "train_micro_batch_size_per_gpu": 4,
        "gradient_accumulation_steps": 2,
        "zero_optimization": {"stage": 2},
        "optimizer": {"type": "AdamW", "params": {"lr": 0.01}},
    }))
    ns = {"model": model, "loader": loader, "loss_fn": _loss_fn}
    try:
        ns = run(train, f"{README}:Use", ns)
        printed = capsys.readouterr().out.split()

        # the same training in plain torch: the loss over 2 accumulated micro-batches, one AdamW step each
        opt = torch.optim.AdamW(reference.parameters(), lr=0.01)
        for k, (x, y) in enumerate(loader):
            (_loss_fn(reference(x), y) / 2).backward()
            if k % 2 == 1:
                norm = torch.stack([p.grad.pow(2).sum() for p in reference.parameters()]).sum().sqrt().item()
                opt.step()
                opt.zero_grad()
        assert printed[0] == "2" and float(printed[1]) == pytest.approx(norm, rel=1e-5), printed
        weights = ns["weights"]
        want = reference.state_dict()
        assert list(weights) == list(want)
        for name in want:
            torch.testing.assert_close(weights[name], want[name], msg=name)

        ns = run(save_load, f"{README}:Use", ns)
        assert ns["client_state"] == {"epoch": 3}
        tag = Path("ckpts", "latest").read_text()
        assert tag == "global_step2"
        assert json.loads(Path("ckpts", tag, "manifest.json").read_text())["client_state"] == {"epoch": 3}
        reloaded = ns["engine"].full_state_dict()
        for name in want:
            assert torch.equal(reloaded[name], weights[name]), name

        # the `rayzero ckpt` lines, run through the command's entry point
        from rayzero.cli import main

        commands = [ln.split("#")[0].strip() for ln in tools.splitlines() if ln.startswith("rayzero ckpt")]
        assert [shlex.split(c)[2] for c in commands] == ["inspect", "verify", "export"]
        for command in commands:
            argv = shlex.split(command)
            if argv[2] == "export" and argv[-1].endswith(".safetensors"):
                pytest.importorskip("safetensors")
            assert main(argv[1:]) == 0, command
            out = capsys.readouterr().out
            if argv[2] == "inspect":
                assert f"checkpoint {tag}" in out and "step 2" in out
            if argv[2] == "verify":
                assert out.startswith("OK: 1 files"), out
            if argv[2] == "export":  # "consolidated weights for model.load_state_dict"
                from safetensors.torch import load_file

                fresh = TiedLM()
                fresh.load_state_dict(load_file(argv[-1]), strict=True)
                for name, value in fresh.state_dict().items():
                    assert torch.equal(value, weights[name]), name

        run(destroy, f"{README}:Use", ns)
    finally:
        if "engine" in ns:
            ns["engine"].destroy()  # harmless when the example already destroyed it
