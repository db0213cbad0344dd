"""Train a tiny GPT-style language model on public-domain text with rayzero on Ray.

    python examples/train.py                                  # local Ray cluster, started by itself
    ray job submit --working-dir . -- python examples/train.py --max-steps 20 --workers 2
    python examples/train.py --workers 1,3 --stage 3          # elastic: 1 to 3 workers, ZeRO-3

The text ships in examples/data/; the tokenizer is byte-level (256 symbols), so nothing is downloaded.
Prints the loss as it falls and the final perplexity on held-out text.
"""

from __future__ import annotations

import argparse
import math
import os

import torch
import torch.nn.functional as F

import rayzero

HERE = os.path.dirname(os.path.abspath(__file__))
TEXT = os.path.join(HERE, "data", "public_domain.txt")
VOCAB = 256  # bytes


class Block(torch.nn.Module):
    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.ln1 = torch.nn.LayerNorm(dim)
        self.attn = torch.nn.MultiheadAttention(dim, heads, batch_first=True)
        self.ln2 = torch.nn.LayerNorm(dim)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(dim, 4 * dim), torch.nn.GELU(), torch.nn.Linear(4 * dim, dim))

    def forward(self, x):
        n = x.shape[1]
        causal = torch.triu(torch.ones(n, n, dtype=torch.bool, device=x.device), diagonal=1)
        h = self.ln1(x)
        x = x + self.attn(h, h, h, attn_mask=causal, need_weights=False)[0]
        return x + self.mlp(self.ln2(x))


class TinyGPT(torch.nn.Module):
    def __init__(self, dim: int = 64, layers: int = 2, heads: int = 4, context: int = 64):
        super().__init__()
        self.tok = torch.nn.Embedding(VOCAB, dim)
        self.pos = torch.nn.Embedding(context, dim)
        self.blocks = torch.nn.ModuleList([Block(dim, heads) for _ in range(layers)])
        self.ln = torch.nn.LayerNorm(dim)
        self.head = torch.nn.Linear(dim, VOCAB, bias=False)
        self.head.weight = self.tok.weight  # tied embedding and output
        self.apply(self._init_weights)

    @staticmethod
    def _init_weights(m):
        if isinstance(m, (torch.nn.Linear, torch.nn.Embedding)):
            torch.nn.init.normal_(m.weight, mean=0.0, std=0.02)
        if isinstance(m, torch.nn.Linear) and m.bias is not None:
            torch.nn.init.zeros_(m.bias)

    def forward(self, idx):
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln(x))


class ByteWindows(torch.utils.data.Dataset):
    """Every window of ``context + 1`` bytes of the text: input and next-byte targets."""

    def __init__(self, data: bytes, context: int):
        self.tokens = torch.tensor(list(data), dtype=torch.long)
        self.context = context

    def __len__(self) -> int:
        return len(self.tokens) - self.context - 1

    def __getitem__(self, i: int):
        chunk = self.tokens[i : i + self.context + 1]
        return chunk[:-1], chunk[1:]


def lm_loss(logits, batch):
    return F.cross_entropy(logits.float().reshape(-1, VOCAB), batch[1].reshape(-1))


def engine_config(args) -> dict:
    """The training config (DeepSpeed-style keys) both examples use."""
    return {
        "train_batch_size": args.global_batch,
        "zero_optimization": {"stage": args.stage},
        "optimizer": {"type": "AdamW", "params": {"lr": args.lr, "weight_decay": 0.01}},
        "scheduler": {
            "type": "WarmupCosineLR",
            "params": {"total_num_steps": args.max_steps, "warmup_num_steps": max(1, args.max_steps // 10)},
        },
        "gradient_clipping": 1.0,
    }


def parse_workers(text: str):
    if "," in text:
        lo, hi = (int(v) for v in text.split(","))
        return (lo, hi)
    return int(text)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--max-steps", type=int, default=60)
    p.add_argument("--workers", type=parse_workers, default=2, help="N, or MIN,MAX for an elastic run")
    p.add_argument("--stage", type=int, default=2, choices=[0, 1, 2, 3])
    p.add_argument("--storage", default=os.path.abspath("rayzero_runs"), help="local path or pyarrow.fs URI")
    p.add_argument("--name", default="tiny-gpt")
    p.add_argument("--resume", action="store_true", help="continue the run called --name from its checkpoint")
    p.add_argument("--global-batch", type=int, default=12)
    p.add_argument("--context", type=int, default=64)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--checkpoint-every", type=int, default=20)
    p.add_argument("--cpus-per-worker", type=int, default=1, help="CPUs each worker reserves (and uses as threads)")
    args = p.parse_args()

    text = open(TEXT, "rb").read()
    split = int(len(text) * 0.9)
    train_data, held_out = ByteWindows(text[:split], args.context), ByteWindows(text[split:], args.context)
    name = args.name
    if not args.resume:  # a fresh run gets a fresh directory; --resume continues the named one
        import time

        name = f"{args.name}-{time.strftime('%Y%m%d-%H%M%S')}"
    cluster = rayzero.ClusterConfig(
        workers=args.workers,
        storage=args.storage,
        name=name,
        checkpoint_every=args.checkpoint_every,
        max_failures=2,
        elastic_check_interval_s=5,
        resources_per_worker={"CPU": args.cpus_per_worker},
    )
    os.environ.setdefault("RAYZERO_THREADS_PER_WORKER", str(args.cpus_per_worker))
    config = engine_config(args)
    context = args.context
    result = rayzero.fit(
        lambda: TinyGPT(context=context),
        cluster,
        config=config,
        data=train_data,
        loss_fn=lm_loss,
        max_steps=args.max_steps,
        seed=0,
    )
    losses = result.losses
    print(f"loss: first {losses[0]:.4f} -> last {losses[-1]:.4f} over {len(losses)} steps, world sizes {result.world_sizes}")

    # Held-out perplexity with the final weights, on this (driver) process.
    from rayzero.checkpoint.tools import export

    weights = os.path.join(result.run_dir, "final_weights.pt")
    export(result.checkpoint, weights)
    model = TinyGPT(context=context)
    model.load_state_dict(torch.load(weights, weights_only=True))
    model.eval()
    loader = torch.utils.data.DataLoader(held_out, batch_size=32)
    total, count = 0.0, 0
    with torch.no_grad():
        for i, batch in enumerate(loader):
            total += lm_loss(model(batch[0]), batch).item() * batch[0].shape[0]
            count += batch[0].shape[0]
            if i == 7:
                break
    print(f"final perplexity on held-out text: {math.exp(total / count):.2f} (a uniform byte model scores 256)")
    print(f"run directory: {result.run_dir}   (plot it: rayzero plot {result.run_dir})")


if __name__ == "__main__":
    main()
