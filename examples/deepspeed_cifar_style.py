"""A DeepSpeedExamples-style training script (the cifar loop's shape) that runs under DeepSpeed or rayzero.

Only the import lines differ between the two: ``RAYZERO_DEEPSPEED=1`` takes DeepSpeed's names from
``rayzero.deepspeed``, anything else from DeepSpeed itself.  The model is a small CNN and the data are
images this script generates from a fixed seed (no downloads).  Run it on 2 ranks with torchrun:

    torchrun --nproc_per_node 2 examples/deepspeed_cifar_style.py \\
        --deepspeed_config examples/deepspeed_cifar_style.json \\
        --ckpt_dir /tmp/ckpt --out losses.json          # under DeepSpeed: DS_ACCELERATOR=cpu on a CPU host
    RAYZERO_DEEPSPEED=1 torchrun --nproc_per_node 2 examples/deepspeed_cifar_style.py ...   # under rayzero

It trains ``--steps`` micro-steps, saves a checkpoint half-way (tag: a float), goes on to the end, loads
the checkpoint back with ``_, client_sd = engine.load_checkpoint(dir)``, runs the second half's batches
again, and consolidates the checkpoint with ``zero_to_fp32``.  Rank 0 writes every per-step loss (both
ranks', and their mean), the learning rates, the global gradient norms and the checkpoint round trip's numbers to ``--out``.
"""

import argparse
import json
import os

import torch
import torch.nn as nn
import torch.nn.functional as F

if os.environ.get("RAYZERO_DEEPSPEED") == "1":
    import rayzero.deepspeed as deepspeed
    from rayzero.deepspeed.accelerator import get_accelerator
    from rayzero.deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
else:
    import deepspeed
    from deepspeed.accelerator import get_accelerator
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint


def add_argument():
    parser = argparse.ArgumentParser(description="CIFAR-style training on generated images")
    parser.add_argument("--steps", type=int, default=8, help="micro-steps to train")
    parser.add_argument("--samples", type=int, default=256, help="images to generate")
    parser.add_argument("--ckpt_dir", type=str, required=True)
    parser.add_argument("--out", type=str, default=None, help="JSON file for rank 0's record")
    parser.add_argument("--local_rank", type=int, default=-1, help="set by the launcher")
    parser = deepspeed.add_config_arguments(parser)
    return parser.parse_args()


def make_data(samples):
    """Images of 3x16x16 whose class a fixed random linear teacher decides: reproducible from a seed."""
    g = torch.Generator().manual_seed(1234)
    images = torch.randn(samples, 3, 16, 16, generator=g)
    teacher = torch.randn(3 * 16 * 16, 10, generator=g)
    labels = (images.reshape(samples, -1) @ teacher).argmax(dim=1)
    return torch.utils.data.TensorDataset(images, labels)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 8, 3, padding=1)
        self.pool = nn.MaxPool2d(2, 2)
        self.conv2 = nn.Conv2d(8, 16, 3, padding=1)
        self.fc1 = nn.Linear(16 * 4 * 4, 32)
        self.fc2 = nn.Linear(32, 10)

    def forward(self, x):
        x = self.pool(F.relu(self.conv1(x)))
        x = self.pool(F.relu(self.conv2(x)))
        x = torch.flatten(x, 1)
        return self.fc2(F.relu(self.fc1(x)))


def main():
    args = add_argument()
    deepspeed.init_distributed()
    torch.manual_seed(0)
    net = Net()
    trainset = make_data(args.samples)
    model_engine, optimizer, trainloader, _ = deepspeed.initialize(
        args=args, model=net, model_parameters=net.parameters(), training_data=trainset)

    local_device = get_accelerator().device_name(model_engine.local_rank)
    local_rank = model_engine.local_rank
    target_dtype = None
    if model_engine.bfloat16_enabled():
        target_dtype = torch.bfloat16
    elif model_engine.fp16_enabled():
        target_dtype = torch.half
    criterion = nn.CrossEntropyLoss()
    world = deepspeed.comm.get_world_size()
    half = args.steps // 2
    if half % model_engine.gradient_accumulation_steps():
        raise SystemExit("--steps / 2 must be a whole number of optimizer steps")

    def train_step(inputs, labels):
        inputs, labels = inputs.to(local_device), labels.to(local_device)
        if target_dtype is not None:
            inputs = inputs.to(target_dtype)
        loss = criterion(model_engine(inputs), labels)
        model_engine.backward(loss)
        model_engine.step()
        return loss.item(), model_engine.get_lr()[0], model_engine.get_global_grad_norm()

    losses, lrs, norms, batches = [], [], [], []
    tag = None
    while len(losses) < args.steps:
        for inputs, labels in trainloader:
            if len(losses) == args.steps:
                break
            batches.append((inputs, labels))
            loss, lr, norm = train_step(inputs, labels)
            losses.append(loss)
            lrs.append(lr)
            norms.append(norm)
            if len(losses) == half:
                tag = float(model_engine.global_steps) + 0.5
                model_engine.save_checkpoint(args.ckpt_dir, tag=tag, client_state={"micro_step": half})
    steps_at_end = model_engine.global_steps

    _, client_sd = model_engine.load_checkpoint(args.ckpt_dir)
    steps_after_load = model_engine.global_steps
    resumed = [train_step(*b)[0] for b in batches[half:]]

    # every rank's losses, for the record (a collective of deepspeed.comm)
    mine = torch.tensor(losses + resumed, dtype=torch.float64)
    every = [torch.zeros_like(mine) for _ in range(world)]
    deepspeed.comm.all_gather(every, mine)
    n = len(losses)

    if model_engine.global_rank == 0:
        fp32 = get_fp32_state_dict_from_zero_checkpoint(args.ckpt_dir)
        check = Net()
        check.load_state_dict(fp32)
        first = trainset[:8]
        with torch.no_grad():
            fp32_loss = criterion(check(first[0]), first[1]).item()
        record = {
            "world_size": world,
            "local_rank": local_rank,
            "device": local_device,
            "train_batch_size": model_engine.train_batch_size(),
            "gradient_accumulation_steps": model_engine.gradient_accumulation_steps(),
            "zero_stage": model_engine.zero_optimization_stage(),
            "bf16": model_engine.bfloat16_enabled(),
            "losses_per_rank": [e[:n].tolist() for e in every],
            "mean_losses": torch.stack([e[:n] for e in every]).mean(0).tolist(),
            "lrs": lrs,
            "grad_norms": [float(x) if x is not None else None for x in norms],
            "tag": str(tag),
            "client_sd_micro_step": client_sd["micro_step"],
            "global_steps_at_end": steps_at_end,
            "global_steps_after_load": steps_after_load,
            "resumed_losses_per_rank": [e[n:].tolist() for e in every],
            "fp32_checkpoint_loss": fp32_loss,
            "fp32_checkpoint_names": sorted(fp32),
        }
        if args.out:
            with open(args.out, "w") as f:
                json.dump(record, f, indent=1)
        print(json.dumps({k: record[k] for k in ("mean_losses", "tag", "client_sd_micro_step")}))
    deepspeed.comm.barrier()


if __name__ == "__main__":
    main()
