"""Make the DeepSpeed checkpoints that tests/test_deepspeed_import.py imports (tests/data/deepspeed_ckpt/).

Needs DeepSpeed (a separate environment; rayzero's tests do not).  Run from the repository root:

    DS_ACCELERATOR=cpu /path/to/deepspeed-venv/bin/python bench/make_ds_checkpoints.py

For each case (tests/deepspeed_import_cases.py: ZeRO stages 1, 2, 3 in fp32, stages 1, 2 in bf16 and a model
in a wrapper, on 2 ranks; stages 2 and 3 on 3 ranks with a frozen layer, a tied weight, a buffer and two param
groups) it starts the ranks with torchrun (gloo), trains a 3-layer MLP with DeepSpeed's AdamW for 3 steps,
saves a checkpoint, and then trains 2 more steps.  It ships, per case, in tests/data/deepspeed_ckpt/<case>/:

  ckpt/            DeepSpeed's checkpoint as saved (`latest`, global_step3/...; its copies of its scripts dropped)
  reference.pt     plain tensors only: DeepSpeed's consolidated fp32 weights (its zero_to_fp32), the
                   per-parameter optimizer state DeepSpeed's ds_to_universal extracts (fp32, exp_avg,
                   exp_avg_sq, step), and the losses of the 2 steps DeepSpeed trained after the save
                   (mean over the ranks)

and, for the cases in UNIVERSAL, DeepSpeed's universal checkpoint of the same save (ds_to_universal's output)
in universal/.  The model, data and config are in tests/deepspeed_import_cases.py, which the tests share.
"""
from __future__ import annotations

import argparse
import glob
import os
import shutil
import subprocess
import sys
import tempfile

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests"))
from deepspeed_import_cases import (CASES, DS_SAVE_STEP, DS_STEPS_AFTER, UNIVERSAL, batches, ds_config,  # noqa: E402
                                    Wrapper, make_model, model_parameters)

OUT = os.path.join(ROOT, "tests", "data", "deepspeed_ckpt")


def rank_main(case: str, save_dir: str, result: str) -> None:
    import deepspeed
    import torch.distributed as dist
    import torch.nn.functional as F

    deepspeed.init_distributed(dist_backend="gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    c = CASES[case]
    model = make_model(c)
    if c.wrapped:
        model = Wrapper(model)
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model_parameters(model, c),
                                           config=ds_config(c, c.stage, world))
    per_rank = engine.train_micro_batch_size_per_gpu()
    compute = torch.bfloat16 if c.dtype == "bf16" else torch.float32
    losses = []
    for i, (x, y) in enumerate(batches(c, DS_SAVE_STEP + DS_STEPS_AFTER)):
        if i == DS_SAVE_STEP:
            # ds_to_universal needs this key; a plain model has nothing to put in it
            engine.save_checkpoint(save_dir, client_state={"universal_checkpoint_info": {}})
        xs, ys = x[rank * per_rank:(rank + 1) * per_rank], y[rank * per_rank:(rank + 1) * per_rank]
        loss = F.mse_loss(engine(xs.to(compute)).float(), ys)
        engine.backward(loss)
        engine.step()
        t = loss.detach().float().reshape(1).clone()
        dist.all_reduce(t)
        losses.append(t.item() / world)
    if rank == 0:
        torch.save({"losses_after": losses[DS_SAVE_STEP:], "losses_before": losses[:DS_SAVE_STEP]}, result)
    dist.barrier()


def universal_reference(ckpt_dir: str, tag: str, work: str) -> dict:
    """DeepSpeed's own per-parameter view of the saved optimizer: ds_to_universal's zero/<name>/*.pt."""
    out = os.path.join(work, "universal")
    subprocess.run([sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal", "--input_folder",
                    os.path.join(ckpt_dir, tag), "--output_folder", out, "--num_extract_workers", "1",
                    "--num_merge_workers", "1"], check=True)
    per_param = {}
    for d in sorted(glob.glob(os.path.join(out, "zero", "*"))):
        if not os.path.isdir(d):  # zero/optimizer_state.pt: the groups' settings, not a parameter
            continue
        name = os.path.basename(d)
        per_param[name] = {}
        for f in sorted(glob.glob(os.path.join(d, "*.pt"))):
            v = torch.load(f, weights_only=False)
            v = v["param"] if isinstance(v, dict) else v
            key = os.path.basename(f)[:-3]
            per_param[name][key] = v.detach().clone() if torch.is_tensor(v) else v
    return {"per_param": per_param, "universal_dir": out}


def make(case: str) -> None:
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    dest = os.path.join(OUT, case)
    shutil.rmtree(dest, ignore_errors=True)
    os.makedirs(dest)
    with tempfile.TemporaryDirectory() as work:
        save_dir, result = os.path.join(work, "ckpt"), os.path.join(work, "result.pt")
        env = dict(os.environ, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1", PYTHONPATH=ROOT)
        subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(CASES[case].world),
                        "--master_port", str(29500 + os.getpid() % 1000), os.path.abspath(__file__),
                        "--rank-main", case, save_dir, result], check=True, env=env)
        tag = open(os.path.join(save_dir, "latest")).read().strip()
        losses = torch.load(result)
        fp32 = get_fp32_state_dict_from_zero_checkpoint(save_dir, tag=tag)
        uni = universal_reference(save_dir, tag, work)
        for f in glob.glob(os.path.join(save_dir, "*.py")):  # DeepSpeed's copies of its conversion scripts
            os.remove(f)
        shutil.copytree(save_dir, os.path.join(dest, "ckpt"))
        if case in UNIVERSAL:
            shutil.copytree(uni["universal_dir"], os.path.join(dest, "universal"))
        torch.save({
            "fp32": {k: v.contiguous().detach().clone() for k, v in fp32.items()},
            "optimizer": uni["per_param"],
            "global_step": DS_SAVE_STEP,
            **losses,
        }, os.path.join(dest, "reference.pt"))
    print(f"{case}: written to {dest}")


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--rank-main":
        rank_main(*sys.argv[2:5])
        sys.exit(0)
    parser = argparse.ArgumentParser()
    parser.add_argument("cases", nargs="*", default=list(CASES))
    for c in parser.parse_args().cases:
        make(c)
