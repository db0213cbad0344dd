"""Train a small model with rayzero ZeRO on local processes joined over gloo, printing the loss as it falls.

    python examples/train_local.py                 # 2 processes, ZeRO stage 2, 200 steps
    python examples/train_local.py --stage 3 --bf16 # any stage 0-3, bf16 compute on fp32 masters
    torchrun --nproc-per-node 2 examples/train_local.py # or under any launcher that sets RANK/WORLD_SIZE

The task is generated, not downloaded: a student network learns to imitate a fixed random teacher network,
so the loss has a known floor of zero and falls steadily.
"""

from __future__ import annotations

import argparse
import os
import socket
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

import rayzero

DIM, HIDDEN = 64, 256


def make_model() -> torch.nn.Module:
    blocks = []
    for _ in range(3):
        blocks += [torch.nn.Linear(DIM, HIDDEN), torch.nn.GELU(), torch.nn.Linear(HIDDEN, DIM)]
    return torch.nn.Sequential(*blocks)


def teacher_batches(steps: int, global_batch: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    w1 = torch.randn(DIM, DIM, generator=g) / DIM**0.5
    w2 = torch.randn(DIM, DIM, generator=g) / DIM**0.5
    for _ in range(steps):
        x = torch.randn(global_batch, DIM, generator=g)
        yield x, torch.tanh(x @ w1) @ w2


def train(rank: int, world: int, args: argparse.Namespace) -> None:
    torch.manual_seed(args.seed)  # every rank builds the same initial weights
    config = {
        "train_batch_size": args.global_batch,
        "train_micro_batch_size_per_gpu": args.global_batch // world,
        "zero_optimization": {"stage": args.stage},
        "optimizer": {"type": "AdamW", "params": {"lr": args.lr, "weight_decay": 0.01}},
        "scheduler": {
            "type": "WarmupCosineLR",
            "params": {"total_num_steps": args.steps, "warmup_num_steps": max(1, args.steps // 10)},
        },
        "gradient_clipping": 1.0,
        "bf16": {"enabled": args.bf16},
    }
    if args.stage == 3:
        with rayzero.zero_init():
            model = make_model()
    else:
        model = make_model()
    engine = rayzero.initialize(model, config)
    per_rank = args.global_batch // world
    start = time.perf_counter()
    first = last = None
    for step, (x, y) in enumerate(teacher_batches(args.steps, args.global_batch), start=1):
        xs, ys = x[rank * per_rank : (rank + 1) * per_rank], y[rank * per_rank : (rank + 1) * per_rank]
        loss = F.mse_loss(engine(xs).float(), ys)
        engine.backward(loss)
        engine.step()
        value = loss.detach().reshape(1).clone()
        if world > 1:
            dist.all_reduce(value)
        last = value.item() / world
        first = last if first is None else first
        if rank == 0 and (step == 1 or step % args.log_every == 0 or step == args.steps):
            print(
                f"step {step:4d}  loss {last:.5f}  grad-norm {engine.global_grad_norm:.4f}  "
                f"lr {engine.get_lr()[0]:.2e}",
                flush=True,
            )
    if rank == 0:
        elapsed = time.perf_counter() - start
        print(
            f"done: ZeRO stage {args.stage}, world {world}, {args.steps} steps in {elapsed:.1f}s; "
            f"loss {first:.5f} -> {last:.5f}",
            flush=True,
        )
    engine.destroy()


def _spawned(rank: int, world: int, port: int, args: argparse.Namespace) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        train(rank, world, args)
    finally:
        dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--stage", type=int, default=2, choices=[0, 1, 2, 3])
    p.add_argument("--world", type=int, default=2, help="processes to start when no launcher did")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--global-batch", type=int, default=32)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--bf16", action="store_true")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--log-every", type=int, default=20)
    args = p.parse_args()
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:  # torchrun or another launcher started us
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        if args.global_batch % world:
            p.error(f"--global-batch {args.global_batch} must divide by the world size {world}")
        train(rank, world, args)
        return
    if args.global_batch % args.world:
        p.error(f"--global-batch {args.global_batch} must divide by --world {args.world}")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_spawned, args=(args.world, port, args), nprocs=args.world)


if __name__ == "__main__":
    main()
