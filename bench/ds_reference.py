"""Regenerate tests/data/ds_reference.json: DeepSpeed's own numbers that rayzero's tests compare against.

Run in an environment with DeepSpeed installed (not needed by CI), on CPU:

    DS_ACCELERATOR=cpu /work/dsvenv/bin/python bench/ds_reference.py [--out tests/data/ds_reference.json]

It records
- "schedules": for each case, DeepSpeed's scheduler (deepspeed.runtime.lr_schedules) built over a torch AdamW
  with two param groups, driven as DeepSpeed's engine drives it (built once, then step() after every optimizer
  step): the lr (and betas) each optimizer step 0..steps-1 runs at, get_last_lr() and state_dict() at the end;
- "engine_runs": a tiny Linear model trained by deepspeed.initialize at world size 1 with gradient
  accumulation, clipping and a WarmupLR scheduler: per micro-step the loss, lr, boundary flag and the
  counters global_steps, micro_steps, global_samples, skipped_steps, the grad norm at boundaries, the
  inputs, and the initial and final weights;
- "loss_scaler": DeepSpeed's dynamic fp16 loss scale after each update over one overflow pattern, for a few
  windows and hysteresis settings.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

STEPS = 30
BASE_LRS = (0.1, 0.02)
BETAS = (0.9, 0.999)

# (name, scheduler type, params): the shared list rayzero's tests replay.
CASES = [
    ("warmup_default", "WarmupLR", {}),
    ("warmup_issue29", "WarmupLR", {"warmup_min_lr": 0, "warmup_max_lr": 0.001, "warmup_num_steps": 4}),
    ("warmup_linear_lists", "WarmupLR", {"warmup_min_lr": [0.01, 0.001], "warmup_max_lr": [0.1, 0.05],
                                         "warmup_num_steps": 5, "warmup_type": "linear"}),
    ("warmup_one_step", "WarmupLR", {"warmup_max_lr": 0.01, "warmup_num_steps": 1}),
    ("decay_log", "WarmupDecayLR", {"total_num_steps": 20, "warmup_num_steps": 5, "warmup_max_lr": 0.01}),
    ("decay_linear", "WarmupDecayLR", {"total_num_steps": 12, "warmup_num_steps": 4, "warmup_min_lr": 0.001,
                                       "warmup_max_lr": 0.02, "warmup_type": "linear"}),
    ("decay_short", "WarmupDecayLR", {"total_num_steps": 3, "warmup_num_steps": 5}),
    ("cosine_log", "WarmupCosineLR", {"total_num_steps": 20, "warmup_num_steps": 5, "warmup_min_ratio": 0.1,
                                      "cos_min_ratio": 0.05}),
    ("cosine_linear", "WarmupCosineLR", {"total_num_steps": 16, "warmup_num_steps": 3, "warmup_type": "linear"}),
    ("cosine_short", "WarmupCosineLR", {"total_num_steps": 4, "warmup_num_steps": 6}),
    ("onecycle_decay", "OneCycle", {"cycle_min_lr": 0.001, "cycle_max_lr": 0.01, "cycle_first_step_size": 4,
                                    "cycle_second_step_size": 6, "decay_lr_rate": 0.5, "decay_step_size": 2,
                                    "cycle_min_mom": 0.85, "cycle_max_mom": 0.95, "decay_mom_rate": 0.1}),
    ("onecycle_stairs", "OneCycle", {"cycle_min_lr": [0.001, 0.002], "cycle_max_lr": [0.01, 0.004],
                                     "cycle_first_step_size": 6, "cycle_second_step_size": 9,
                                     "cycle_first_stair_count": 2, "cycle_second_stair_count": 3}),
    ("onecycle_no_mom", "OneCycle", {"cycle_min_lr": 0.002, "cycle_max_lr": 0.02, "cycle_first_step_size": 5,
                                     "cycle_momentum": False, "decay_lr_rate": 1.0, "decay_step_size": 3}),
    ("range_linear", "LRRangeTest", {"lr_range_test_min_lr": 0.001, "lr_range_test_step_size": 3,
                                     "lr_range_test_step_rate": 2.0}),
    ("range_staircase", "LRRangeTest", {"lr_range_test_min_lr": [0.001, 0.0005], "lr_range_test_step_size": 4,
                                        "lr_range_test_staircase": True}),
]

# The engine runs: world size 1, 8 micro-batches of 2 samples, Linear(4, 2), MSE-like loss.
ENGINE_MICRO_STEPS = 8
ENGINE_CONFIGS = {
    "stage0_warmup_clip": {
        "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2,
        "optimizer": {"type": "Adam", "params": {"lr": 0.01}},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_max_lr": 0.01, "warmup_num_steps": 4}},
        "gradient_clipping": 0.05,
    },
    "stage2_cosine_clip": {
        "train_batch_size": 4, "gradient_accumulation_steps": 2,
        "zero_optimization": {"stage": 2},
        "optimizer": {"type": "AdamW", "params": {"lr": 0.01, "weight_decay": 0.01}},
        "scheduler": {"type": "WarmupCosineLR", "params": {"total_num_steps": 4, "warmup_num_steps": 2}},
        "gradient_clipping": 0.05,
    },
}


def _schedule_case(lr_schedules, torch, kind: str, params: dict) -> dict:
    weights = [torch.nn.Parameter(torch.zeros(1)) for _ in BASE_LRS]
    opt = torch.optim.AdamW([{"params": [w], "lr": lr} for w, lr in zip(weights, BASE_LRS)], betas=BETAS)
    sched = getattr(lr_schedules, kind)(opt, **params)
    lrs, betas = [], []
    for _ in range(STEPS):
        lrs.append([float(g["lr"]) for g in opt.param_groups])
        betas.append([list(g["betas"]) for g in opt.param_groups])
        opt.step()
        sched.step()
    return {"type": kind, "params": params, "lrs": lrs, "betas": betas,
            "last_lr": [float(x) for x in sched.get_last_lr()] if kind != "OneCycle" else None,
            "state_dict": sched.state_dict()}


# DeepSpeed's DynamicLossScaler: (window, hysteresis, consecutive_hysteresis), driven by one overflow pattern
LOSS_SCALER_CASES = [(3, 2, False), (4, 1, False), (2, 3, True), (5, 2, True), (1, 2, False)]
OVERFLOWS = [i in (0, 1, 9, 10, 11, 20, 26, 27, 28, 29, 30, 41) for i in range(48)]


def _loss_scales(window: int, hysteresis: int, consecutive: bool) -> list[float]:
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler

    scaler = DynamicLossScaler(init_scale=2.0 ** 8, scale_window=window, min_scale=1.0, delayed_shift=hysteresis,
                               consecutive_hysteresis=consecutive, raise_error_at_min_scale=False)
    out = []
    for overflow in OVERFLOWS:
        scaler.update_scale(overflow)
        out.append(float(scaler.cur_scale))
    return out


def _engine_run(deepspeed, torch, config: dict) -> dict:
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    init = {k: v.tolist() for k, v in model.state_dict().items()}
    gen = torch.Generator().manual_seed(1)
    inputs = [torch.randn(2, 4, generator=gen) for _ in range(ENGINE_MICRO_STEPS)]
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=dict(config))
    rows = []
    for x in inputs:
        boundary = engine.is_gradient_accumulation_boundary()
        lr = [float(v) for v in engine.get_lr()]
        loss = engine(x).pow(2).mean()
        engine.backward(loss)
        engine.step()
        norm = engine.get_global_grad_norm() if boundary else None
        rows.append({"loss": float(loss.detach()), "lr": lr, "boundary": boundary, "global_steps": engine.global_steps,
                     "micro_steps": engine.micro_steps, "global_samples": engine.global_samples,
                     "skipped_steps": engine.skipped_steps,
                     "grad_norm": None if norm is None else float(norm)})
    final = {k: v.tolist() for k, v in engine.module.state_dict().items()}
    batch = {"train_batch_size": engine.train_batch_size(),
             "train_micro_batch_size_per_gpu": engine.train_micro_batch_size_per_gpu(),
             "gradient_accumulation_steps": engine.gradient_accumulation_steps()}
    engine.destroy()
    return {"config": config, "init": init, "inputs": [x.tolist() for x in inputs], "steps": rows,
            "final": final, "batch": batch}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "..", "tests", "data",
                                                      "ds_reference.json"))
    args = parser.parse_args()
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    for key, value in (("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", "29617"), ("RANK", "0"),
                       ("WORLD_SIZE", "1"), ("LOCAL_RANK", "0")):
        os.environ.setdefault(key, value)
    import deepspeed
    import torch
    from deepspeed.runtime import lr_schedules

    torch.set_num_threads(1)
    out = {
        "generator": "bench/ds_reference.py",
        "deepspeed": deepspeed.__version__, "torch": torch.__version__,
        "steps": STEPS, "base_lrs": list(BASE_LRS), "betas": list(BETAS),
        "schedules": {name: _schedule_case(lr_schedules, torch, kind, params) for name, kind, params in CASES},
        "engine_runs": {name: _engine_run(deepspeed, torch, cfg) for name, cfg in ENGINE_CONFIGS.items()},
    }
    deepspeed.init_distributed(dist_backend="gloo")  # the scaler logs its overflows with the rank
    out["loss_scaler"] = {"overflows": OVERFLOWS, "init_scale": 2.0 ** 8, "min_scale": 1.0, "cases": [
        {"window": w, "hysteresis": h, "consecutive_hysteresis": c, "scales": _loss_scales(w, h, c)}
        for w, h, c in LOSS_SCALER_CASES]}
    with open(args.out, "w") as f:
        json.dump(out, f, indent=None, separators=(",", ":"))
        f.write("\n")
    print(f"wrote {os.path.abspath(args.out)} ({os.path.getsize(args.out)} bytes)", file=sys.stderr)


if __name__ == "__main__":
    main()
