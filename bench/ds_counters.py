"""DeepSpeed and rayzero side by side on one tiny script at world size 2: counters, lr, losses, norms, weights.

Needs DeepSpeed (CPU accelerator) and rayzero importable in one environment, e.g.

    DS_ACCELERATOR=cpu PYTHONPATH=$PWD /work/dsvenv/bin/python bench/ds_counters.py [--batch-grid]

Each config trains Linear(4, 2) on 8 micro-steps of a global batch of 8 (4 per rank, micro-batch 2, gradient
accumulation 2), first under deepspeed.initialize and then under rayzero.initialize, each in a fresh spawn of
2 gloo ranks, and prints every difference (none expected beyond float rounding). With --batch-grid it compares
instead how both resolve the batch keys (train_batch_size, micro-batch, accumulation) over a grid.
"""

from __future__ import annotations

import os
import socket
import sys

import torch
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(__file__))
from ds_reference import ENGINE_CONFIGS  # noqa: E402

WORLD = 2
STEPS = 8


def _data():
    gen = torch.Generator().manual_seed(1)
    return [torch.randn(2 * WORLD, 4, generator=gen) for _ in range(STEPS)]


def _rank(rank: int, port: int, system: str, config: dict, queue) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(WORLD),
                      LOCAL_RANK=str(rank), DS_ACCELERATOR="cpu")
    torch.set_num_threads(1)
    import torch.distributed as dist

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    if system == "deepspeed":
        import deepspeed

        deepspeed.init_distributed(dist_backend="gloo")
        engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=dict(config))
        norm_of = lambda: engine.get_global_grad_norm()  # noqa: E731
    else:
        import rayzero

        dist.init_process_group("gloo", rank=rank, world_size=WORLD)
        engine = rayzero.initialize(model, dict(config))
        norm_of = lambda: engine.global_grad_norm  # noqa: E731
    rows = []
    for x in _data():
        boundary = engine.is_gradient_accumulation_boundary()
        lr = [float(v) for v in engine.get_lr()]
        loss = engine(x[2 * rank:2 * rank + 2]).pow(2).mean()
        engine.backward(loss)
        engine.step()
        norm = norm_of() if boundary else None
        rows.append({"loss": float(loss.detach()), "lr": lr, "boundary": boundary,
                     "global_steps": engine.global_steps, "micro_steps": engine.micro_steps,
                     "global_samples": engine.global_samples, "skipped_steps": engine.skipped_steps,
                     "grad_norm": None if norm is None else float(norm)})
    if system == "deepspeed":
        from deepspeed.utils import safe_get_full_fp32_param

        final = {n: (safe_get_full_fp32_param(p) if config.get("zero_optimization", {}).get("stage", 0) == 3
                     else p.detach()).tolist() for n, p in engine.module.named_parameters()}
        batch = [engine.train_batch_size(), engine.train_micro_batch_size_per_gpu(),
                 engine.gradient_accumulation_steps()]
    else:
        final = {n: t.tolist() for n, t in engine.full_state_dict().items()}
        batch = [engine.batch.train_batch_size, engine.batch.micro_batch_size, engine.gradient_accumulation_steps]
    queue.put((rank, {"rows": rows, "final": final, "batch": batch}))
    engine.destroy()
    if dist.is_initialized():
        dist.destroy_process_group()


def _spawn(system: str, config: dict) -> list[dict]:
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = [ctx.Process(target=_rank, args=(r, port, system, config, queue)) for r in range(WORLD)]
    for p in procs:
        p.start()
    out = dict(queue.get(timeout=300) for _ in range(WORLD))
    for p in procs:
        p.join()
    return [out[r] for r in range(WORLD)]


def _diff(a, b, path=""):
    if isinstance(a, dict):
        return [d for k in a for d in _diff(a[k], b[k], f"{path}.{k}")]
    if isinstance(a, list):
        return [d for i, (x, y) in enumerate(zip(a, b)) for d in _diff(x, y, f"{path}[{i}]")]
    if isinstance(a, float) and isinstance(b, float):
        return [] if abs(a - b) <= 1e-5 * max(1.0, abs(a)) else [f"{path}: deepspeed {a} rayzero {b}"]
    return [] if a == b else [f"{path}: deepspeed {a} rayzero {b}"]


def batch_grid() -> None:
    """DeepSpeed's and rayzero's resolution of the three batch keys over a grid of given/missing values and
    world sizes 1-4: the same triple, or both refuse."""
    import itertools

    import deepspeed
    from deepspeed.runtime.config import DeepSpeedConfig

    from rayzero.config import Config, ConfigError

    class DataParallel:  # DeepSpeedConfig reads the data-parallel world size from an mpu
        def __init__(self, world):
            self.world = world

        def get_data_parallel_world_size(self):
            return self.world

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()), RANK="0", WORLD_SIZE="1",
                      LOCAL_RANK="0")
    deepspeed.init_distributed(dist_backend="gloo")
    same, differ = 0, []
    for world in (1, 2, 3, 4):
        for tbs, mb, gas in itertools.product([None, 1, 2, 3, 4, 6, 8, 12, 16], [None, 1, 2, 3, 4], [None, 1, 2, 3]):
            cfg = {k: v for k, v in (("train_batch_size", tbs), ("train_micro_batch_size_per_gpu", mb),
                                     ("gradient_accumulation_steps", gas)) if v is not None}
            try:
                d = DeepSpeedConfig(dict(cfg), mpu=DataParallel(world))
                ds = (d.train_batch_size, d.train_micro_batch_size_per_gpu, d.gradient_accumulation_steps)
            except Exception:  # noqa: BLE001 - any refusal counts as one
                ds = "refused"
            try:
                plan = Config.from_any(dict(cfg)).resolve_batch(world)
                rz = (plan.train_batch_size, plan.micro_batch_size, plan.gradient_accumulation_steps)
            except ConfigError:
                rz = "refused"
            if ds == rz:
                same += 1
            else:
                differ.append(f"world {world} {cfg}: deepspeed {ds}, rayzero {rz}")
    print(f"batch keys: {same} of {same + len(differ)} cases resolve the same; differences:\n  " + "\n  ".join(differ))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    if "--batch-grid" in sys.argv:
        batch_grid()
        return
    configs = dict(ENGINE_CONFIGS)
    configs["stage3_warmup_clip"] = {**ENGINE_CONFIGS["stage0_warmup_clip"], "zero_optimization": {"stage": 3}}
    for name, config in configs.items():
        config = {k: v for k, v in config.items() if k != "train_batch_size"}
        config.setdefault("train_micro_batch_size_per_gpu", 2)
        ds, rz = _spawn("deepspeed", config), _spawn("rayzero", config)
        for r in range(WORLD):
            if ds[r]["rows"][1]["grad_norm"] is None:  # DeepSpeed reports no norm without ZeRO
                for row in rz[r]["rows"]:
                    row["grad_norm"] = None
        diffs = [f"rank {r}{d}" for r in range(WORLD) for d in _diff(ds[r], rz[r])]
        last = ds[0]["rows"][-1]
        print(f"{name}: world {WORLD}, batch {ds[0]['batch']}, after {STEPS} micro-steps global_steps "
              f"{last['global_steps']} micro_steps {last['micro_steps']} global_samples {last['global_samples']}, "
              f"last loss rank 0 {last['loss']:.6f}: "
              + ("deepspeed and rayzero agree (floats within 1e-5 relative)" if not diffs else
                 f"{len(diffs)} differences:\n  " + "\n  ".join(diffs[:20])))
        sys.stdout.flush()


if __name__ == "__main__":
    main()
