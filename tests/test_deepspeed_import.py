"""`rayzero ckpt import-deepspeed`: DeepSpeed ZeRO 1-3 and universal checkpoints into rayzero checkpoints.

The references are DeepSpeed's own, made once by bench/make_ds_checkpoints.py (tests/data/deepspeed_ckpt/):
its consolidated fp32 weights (zero_to_fp32), its per-parameter optimizer state (ds_to_universal), and the
losses of the 2 steps it trained after the save.  DeepSpeed is not needed here.
"""
from __future__ import annotations

import os
import shutil

import pytest
import torch
import torch.nn.functional as F

import rayzero
from deepspeed_import_cases import (CASES, DS_SAVE_STEP, DS_STEPS_AFTER, LR, UNIVERSAL, WEIGHT_DECAY, batches,
                                    ds_config, make_model, model_parameters)
from distributed import run_distributed
from rayzero.checkpoint.deepspeed_import import import_deepspeed
from rayzero.checkpoint.format import CheckpointError
from rayzero.checkpoint.reader import FragmentIndex, read_manifest, resolve_tag
from rayzero.checkpoint.storage import Storage
from rayzero.checkpoint.tools import verify

DATA = os.path.join(os.path.dirname(__file__), "data", "deepspeed_ckpt")
# every DeepSpeed checkpoint imported: the ZeRO ones, and DeepSpeed's universal checkpoints of some of them
SOURCES = {**{c: os.path.join(DATA, c, "ckpt") for c in CASES},
           **{f"{c}_universal": os.path.join(DATA, c, "universal") for c in UNIVERSAL}}
CASE_OF = {**{c: c for c in CASES}, **{f"{c}_universal": c for c in UNIVERSAL}}
# measured (bench/ds_import_losses.py): within 1.2e-7 of DeepSpeed (fp32) and equal (bf16); the target is 2e-4
LOSS_TOL = {"fp32": 1e-5, "bf16": 1e-3}


def reference(source: str) -> dict:
    ref = torch.load(os.path.join(DATA, CASE_OF[source], "reference.pt"), weights_only=True)
    if CASES[CASE_OF[source]].wrapped:  # DeepSpeed's names are the wrapper's: module.<name>
        for key in ("fp32", "optimizer"):
            assert all(n.startswith("module.") for n in ref[key])
            ref[key] = {n[len("module."):]: v for n, v in ref[key].items()}
    return ref


@pytest.fixture(scope="module")
def imported(tmp_path_factory) -> dict[str, str]:
    """Every source imported once: source name -> rayzero save directory."""
    root = tmp_path_factory.mktemp("imported")
    out = {}
    for name, src in SOURCES.items():
        out[name] = str(root / name)
        import_deepspeed(src, out[name])
    return out


def _read(save_dir: str) -> tuple[dict, dict]:
    """The imported checkpoint read back through rayzero's reader: manifest, {(param, state): tensor}."""
    storage = Storage.resolve(save_dir)
    tag = resolve_tag(storage, None)
    manifest = read_manifest(storage, tag)
    index = FragmentIndex(storage, tag, manifest)
    out = {}
    for p in manifest["params"]:
        for state in ["fp32", *manifest["optimizer"]["state_names"]]:
            t = torch.empty(p["numel"], dtype=torch.float32)
            index.fill(p["name"], state, 0, p["numel"], t)
            out[p["name"], state] = t.view(p["shape"])
    for w in manifest["whole"]:
        t = torch.empty(w["shape"], dtype=getattr(torch, w["dtype"]))
        index.fill(w["name"], "whole", 0, t.numel(), t.view(-1))
        out[w["name"], "whole"] = t
    return manifest, out


@pytest.mark.parametrize("source", list(SOURCES))
def test_import_carries_deepspeeds_masters_optimizer_state_and_step(imported, source):
    ref = reference(source)
    save_dir = imported[source]
    assert verify(save_dir) == []
    case = CASES[CASE_OF[source]]
    manifest, tensors = _read(save_dir)
    trainable = [n for n, p in make_model(case).named_parameters() if p.requires_grad]
    assert sorted(p["name"] for p in manifest["params"]) == sorted(trainable)
    owner = {a: p["name"] for p in manifest["params"] for a in p["aliases"]}  # a tied weight's other names
    assert owner == ({"tied.weight": "fc2.weight"} if case.extras else {})
    assert sorted(w["name"] for w in manifest["whole"]) == sorted(set(ref["fp32"]) - set(trainable) - set(owner))
    assert sorted(ref["fp32"]) == sorted(make_model(case).state_dict())
    for name, w in ref["fp32"].items():  # DeepSpeed's zero_to_fp32 (weights, frozen ones, buffers), bit for bit
        name_in = owner.get(name, name)
        got = tensors[name_in, "fp32"] if name_in in trainable else tensors[name, "whole"].float()
        assert torch.equal(got, w), name
    for name in trainable:  # DeepSpeed's ds_to_universal, per parameter
        states = ref["optimizer"][name]
        shape = ref["fp32"][name].shape
        for state in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(tensors[name, state], states[state].reshape(shape)), (name, state)
        if "step" in states:  # (DeepSpeed's universal form of a stage 3 checkpoint has none)
            assert states["step"].item() == DS_SAVE_STEP
    assert manifest["global_steps"] == DS_SAVE_STEP
    assert manifest["global_samples"] == DS_SAVE_STEP * case.batch
    assert manifest["optimizer"]["type"] == "AdamW"
    groups = manifest["optimizer"]["param_groups"]
    # DeepSpeed's param groups, in order, with their members, settings and step
    assert len(groups) == (2 if case.extras else 1)
    for gi, group in enumerate(groups):
        assert group["state"]["step"]["value"] == DS_SAVE_STEP
        members = [p["name"] for p in manifest["params"] if p["group"] == gi]
        assert group["params"] == members
        if case.extras:
            assert members == [n for n in trainable if n.endswith("weight" if gi == 0 else "bias")]
        assert (group["lr"], group["weight_decay"]) == ((LR, WEIGHT_DECAY) if gi == 0 else (2 * LR, 0.0))
    assert manifest["compute_dtype"] == {"fp32": "float32", "bf16": "bfloat16"}[case.dtype]
    assert {p["dtype"] for p in manifest["params"]} == {manifest["compute_dtype"]}
    if source == "zero1_fp32":  # DeepSpeed's WarmupLR had stepped 3 times (its last_batch_iteration 2)
        assert manifest["scheduler"]["last_batch_iteration"] == DS_SAVE_STEP - 1
        assert manifest["scheduler"]["deepspeed"] == {"last_batch_iteration": DS_SAVE_STEP - 1}
    else:
        assert manifest["scheduler"] is None


def continue_training(rank: int, world: int, save_dirs: dict[str, str], stages: dict[str, int]) -> dict:
    """Load each import into a rayzero engine of this world size (at another stage than DeepSpeed's) and
    train DeepSpeed's next steps on this rank's share of the same batches: the mean losses."""
    out = {}
    for source, save_dir in save_dirs.items():
        case = CASES[CASE_OF[source]]
        data = batches(case, DS_SAVE_STEP + DS_STEPS_AFTER)[DS_SAVE_STEP:]
        model = make_model(case, seed=123)  # other weights: the load must replace them all
        engine = rayzero.initialize(model, ds_config(case, stages[source], world),
                                    model_parameters=model_parameters(model, case))
        engine.load_checkpoint(save_dir)
        assert engine.global_steps == DS_SAVE_STEP
        per = case.batch // world
        compute = torch.bfloat16 if case.dtype == "bf16" else torch.float32
        losses = []
        for x, y in data:
            xs, ys = x[rank * per:(rank + 1) * per], y[rank * per:(rank + 1) * per]
            loss = F.mse_loss(engine(xs.to(compute)).float(), ys)
            engine.backward(loss)
            engine.step()
            t = loss.detach().float().reshape(1).clone()
            if world > 1:
                torch.distributed.all_reduce(t)
            losses.append(t.item() / world)
        out[source] = losses
        engine.destroy()
    return out


def _check_losses(got: dict, world: int) -> None:
    for source, losses in got.items():
        ref = reference(source)["losses_after"]
        tol = LOSS_TOL[CASES[CASE_OF[source]].dtype]
        assert losses == pytest.approx(ref, abs=tol), (source, world, losses, ref)


def test_deepspeed_run_continues_under_rayzero_at_world_1(imported):
    # stage 0 here: the import loads whatever stage the engine runs
    _check_losses(continue_training(0, 1, imported, {s: 0 for s in imported}), 1)


def test_deepspeed_run_continues_under_rayzero_at_world_2(imported):
    # each at a stage DeepSpeed did not save it at
    stages = {s: {1: 3, 2: 1, 3: 2}[CASES[CASE_OF[s]].stage] for s in imported}
    (got, _) = run_distributed(continue_training, 2, imported, stages)
    _check_losses(got, 2)


# ---- bad input: a clear error, before anything is written --------------------------------------------------------
def _fails(src, out, match: str, tag=None) -> None:
    before = sorted(os.listdir(out)) if os.path.isdir(out) else None
    with pytest.raises(CheckpointError, match=match):
        import_deepspeed(src, out, tag=tag)
    assert (sorted(os.listdir(out)) if os.path.isdir(out) else None) == before  # nothing written


def test_bad_input_is_refused_before_anything_is_written(tmp_path, imported):
    out = str(tmp_path / "out")
    empty = tmp_path / "empty"
    empty.mkdir()
    _fails(str(empty), out, "is not a DeepSpeed checkpoint directory")
    _fails(imported["zero2_fp32"], out, "is a rayzero checkpoint already")
    _fails(str(tmp_path / "nowhere"), out, "is not a directory")
    _fails(SOURCES["zero2_fp32"], out, r"has no checkpoint tag 'global_step9' \(tags there: \['global_step3'\]\)",
           tag="global_step9")
    # a rank's optimizer-states file missing
    broken = tmp_path / "broken"
    shutil.copytree(SOURCES["zero3_fp32"], broken)
    os.remove(broken / "global_step3" / "zero_pp_rank_1_mp_rank_00_optim_states.pt")
    _fails(str(broken), out, "saved by 2 ranks but holds 1 optimizer-states files")
    os.remove(broken / "global_step3" / "zero_pp_rank_0_mp_rank_00_optim_states.pt")
    _fails(str(broken), out, "has no .*optim_states.pt files")
    # rank files of two different saves
    mixed = tmp_path / "mixed"
    shutil.copytree(SOURCES["zero2_fp32"], mixed)
    shutil.copy(os.path.join(SOURCES["zero2_extras_w3"], "global_step3", "zero_pp_rank_1_mp_rank_00_optim_states.pt"),
                mixed / "global_step3")
    _fails(str(mixed), out, "zero_pp_rank_1_mp_rank_00_optim_states.pt has 2 param groups, the model states list 1")
    # a pickle that names anything but tensors, containers and DeepSpeed's classes is not loaded
    evil = tmp_path / "evil"
    shutil.copytree(SOURCES["zero2_fp32"], evil)
    torch.save({"module": {}, "param_shapes": [], "hook": shutil.rmtree},
               evil / "global_step3" / "mp_rank_00_model_states.pt")
    _fails(str(evil), out, r"names shutil.rmtree, which a DeepSpeed checkpoint has no business holding")
    # an existing import is not overwritten
    _fails(SOURCES["zero2_fp32"], imported["zero2_fp32"], "already holds a checkpoint")
    assert verify(imported["zero2_fp32"]) == []


def test_cli_import_deepspeed(tmp_path, capsys):
    from rayzero.cli import main

    out = str(tmp_path / "out")
    assert main(["ckpt", "import-deepspeed", os.path.join(DATA, "zero3_fp32", "ckpt"), out,
                 "--tag", "global_step3"]) == 0
    printed = capsys.readouterr().out
    assert "ZeRO stage 3, saved by 2 ranks, step 3): 6 parameters" in printed
    assert main(["ckpt", "verify", out]) == 0
    assert main(["ckpt", "import-deepspeed", str(tmp_path), str(tmp_path / "o2")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("rayzero: error: ") and "is not a DeepSpeed checkpoint directory" in err
    assert not os.path.exists(tmp_path / "o2")


def test_placeholders_keep_deepspeeds_values():
    """DeepSpeed's classes load as placeholders carrying their values (read with only torch present)."""
    from rayzero.checkpoint.deepspeed_import import DeepSpeedObject, load_pickle

    osd = load_pickle(os.path.join(SOURCES["zero2_bf16"], "global_step3",
                                   "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt"))["optimizer_state_dict"]
    assert isinstance(osd["zero_stage"], DeepSpeedObject) and osd["zero_stage"].value == 2
    assert osd["zero_stage"].ds_class == "deepspeed.runtime.zero.config.ZeroStageEnum"
    assert vars(osd["loss_scaler"])["cur_scale"] == 1.0
    # rank 1's partition starts with fc2.weight's last 29 elements (rank 0 holds 35 + 7 + 20 = 62)
    addr = osd["param_slice_mappings"][0]["fc2.weight"]
    assert (addr.numel, addr.start) == (29, 0)


def test_dynamic_loss_scaler_state_maps_to_rayzeros():
    """DeepSpeed's DynamicLossScaler fields (runtime/fp16/loss_scaler.py) as rayzero's loss scaler state: an
    fp16 run 4 steps after an overflow at iteration 6, with one unit of hysteresis left."""
    from rayzero.checkpoint.deepspeed_import import Imported, _loss_scaler_state, _placeholder

    scaler = _placeholder("deepspeed.runtime.fp16.loss_scaler", "DynamicLossScaler")()
    scaler.__setstate__({"cur_scale": 1024.0, "cur_iter": 10, "last_overflow_iter": 6, "scale_factor": 2.0,
                         "scale_window": 100, "min_scale": 1.0, "delayed_shift": 2, "cur_hysteresis": 1,
                         "consecutive_hysteresis": False, "dynamic": True})
    state = _loss_scaler_state(Imported(kind="zero", source="", tag=None, stage=2, saved_world=2, loss_scaler=scaler))
    assert {k: state[k] for k in ("scale", "dynamic", "window", "hysteresis", "hysteresis_left", "min_scale",
                                  "scale_factor", "good_steps", "consecutive_hysteresis")} == {
        "scale": 1024.0, "dynamic": True, "window": 100, "hysteresis": 2, "hysteresis_left": 1, "min_scale": 1.0,
        "scale_factor": 2.0, "good_steps": 3, "consecutive_hysteresis": False}
