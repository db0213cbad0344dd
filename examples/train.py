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
import re
import shlex
import sys
import time

import torch
import torch.nn.functional as F

import rayzero
from rayzero.train.cluster_config import STORAGE_ENV, default_storage
from rayzero.train.fit import ClusterTooSmallError

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


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """--help keeps the docstring's layout and shows every flag's default."""


def parse_workers(text: str):
    """``N`` or ``MIN,MAX`` (an elastic range), with ``1 <= MIN <= MAX``."""
    try:
        if "," in text:
            lo, hi = (int(v) for v in text.split(","))
            value = (lo, hi)
        else:
            value = lo = hi = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not N or MIN,MAX (whole numbers)") from None
    if not 1 <= lo <= hi:
        raise argparse.ArgumentTypeError(f"{text!r}: need N >= 1, or MIN,MAX with 1 <= MIN <= MAX")
    return value


def _number(kind, low: float, strict: bool):
    """An argparse type: a ``kind`` number ``> low`` (strict) or ``>= low``."""

    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a{'' if kind is int else ' real'} number") from None
        if not math.isfinite(value) or (value <= low if strict else value < low):
            bound = f">= {low + 1:g}" if strict and kind is int else f"{'>' if strict else '>='} {low:g}"
            raise argparse.ArgumentTypeError(f"{text!r}: must be {bound}")
        return value

    parse.__name__ = kind.__name__  # argparse names the type in its own messages
    return parse


positive_int = _number(int, 0, strict=True)
non_negative_int = _number(int, 0, strict=False)
positive_float = _number(float, 0.0, strict=True)

RUN_STAMP = re.compile(r"-(\d{8}-\d{6})$")  # the suffix a fresh run gets: <name>-YYYYmmdd-HHMMSS
CHECKPOINT_STEP = re.compile(r"checkpoint_step(\d+)$")


def _filesystem(storage: str):
    """(pyarrow filesystem, root path) for a local path or a pyarrow.fs URI."""
    import pyarrow.fs

    if "://" in storage:
        return pyarrow.fs.FileSystem.from_uri(storage)
    return pyarrow.fs.LocalFileSystem(), os.path.abspath(os.path.expanduser(storage))


def latest_checkpoint_step(fs, run_path: str) -> int | None:
    """The step of the checkpoint Ray Train restores for the run at ``run_path``, or None when it has none.

    Ray Train restores the latest checkpoint listed in the run's ``checkpoint_manager_snapshot.json``.
    """
    import json

    import pyarrow.fs

    snapshot = f"{run_path}/checkpoint_manager_snapshot.json"
    if fs.get_file_info(snapshot).type != pyarrow.fs.FileType.File:
        return None
    try:
        with fs.open_input_stream(snapshot) as f:
            latest = json.loads(f.read().decode()).get("latest_checkpoint_result") or {}
    except (OSError, ValueError):
        return None
    dir_name = latest.get("checkpoint_dir_name") or ""
    if fs.get_file_info(f"{run_path}/{dir_name}").type != pyarrow.fs.FileType.Directory:
        return None
    step = (latest.get("metrics") or {}).get("step")
    if isinstance(step, int):
        return step
    m = CHECKPOINT_STEP.search(dir_name)
    return int(m.group(1)) if m else None


def find_resumable(storage: str, name: str) -> tuple[str, int] | None:
    """The run ``--resume --name NAME`` continues, as ``(run name, checkpoint step)``, or None.

    ``NAME`` is a whole run name (``tiny-gpt-20250101-120000``) when that run has a checkpoint; otherwise the
    latest ``NAME-YYYYmmdd-HHMMSS`` run in ``storage`` that has a checkpoint (runs that stopped before their
    first checkpoint cannot be resumed and are passed over).
    """
    import pyarrow.fs

    fs, root = _filesystem(storage)
    root = root.rstrip("/") or "/"
    exact = latest_checkpoint_step(fs, f"{root}/{name}")
    if exact is not None:
        return name, exact
    try:
        entries = fs.get_file_info(pyarrow.fs.FileSelector(root, allow_not_found=True))
    except OSError:
        return None
    stamped = []
    for info in entries:
        if info.type != pyarrow.fs.FileType.Directory:
            continue
        m = RUN_STAMP.search(info.base_name)
        if m and info.base_name[: m.start()] == name:
            stamped.append((m.group(1), info.base_name))
    for _, run in sorted(stamped, reverse=True):  # the timestamps sort in time order
        step = latest_checkpoint_step(fs, f"{root}/{run}")
        if step is not None:
            return run, step
    return None


def run_path(storage: str, name: str) -> str:
    """``<storage>/<name>`` as ``rayzero.fit`` names the run directory (a URI keeps its scheme and query)."""
    if "://" in storage:
        base, _, query = storage.partition("?")
        return f"{base.rstrip('/')}/{name}" + (f"?{query}" if query else "")
    return os.path.join(storage, name)


def parse_args(argv=None) -> argparse.Namespace:
    """The command line, checked: a bad value ends in argparse's one-line error (exit code 2), before Ray starts."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    p.add_argument("--max-steps", type=positive_int, default=60, help="optimizer steps for the whole run (>= 1)")
    p.add_argument("--workers", type=parse_workers, default=2, help="N workers, or MIN,MAX for an elastic run")
    p.add_argument("--stage", type=int, default=2, choices=[0, 1, 2, 3], help="ZeRO stage")
    p.add_argument("--storage", default=default_storage(),
                   help=f"local path or pyarrow.fs URI for checkpoints and metrics (${STORAGE_ENV} sets the default)")
    p.add_argument("--name", default="tiny-gpt",
                   help="run name; a fresh run is stored as NAME-YYYYmmdd-HHMMSS under --storage")
    p.add_argument("--resume", action="store_true",
                   help="continue the latest NAME-<timestamp> run in --storage (or the run called exactly NAME) "
                        "from its latest checkpoint")
    p.add_argument("--global-batch", type=positive_int, default=12, help="samples per optimizer step, all workers")
    p.add_argument("--context", type=positive_int, default=64, help="tokens (bytes) per training window")
    p.add_argument("--lr", type=positive_float, default=3e-3, help="peak AdamW learning rate")
    p.add_argument("--checkpoint-every", type=non_negative_int, default=20,
                   help="steps between checkpoints (0: only at the end)")
    p.add_argument("--cpus-per-worker", type=positive_int, default=1,
                   help="CPUs each worker reserves (and uses as threads)")
    p.add_argument("--gpu", action="store_true",
                   help="one GPU per worker (its batches and model on it, NCCL between workers)")
    p.add_argument("--verbose", action="store_true",
                   help="also show Ray's own console output (Ray Train's INFO lines and reports, Ray core log "
                        "lines, every rank's repeated lines); off: start-up phases and one progress line per update")
    args = p.parse_args(argv)
    if "://" not in args.storage:  # a full path: the run directory is printed, and plotted, as one
        args.storage = os.path.abspath(os.path.expanduser(args.storage))
    if not args.name or "/" in args.name or args.name in (".", ".."):
        p.error(f"argument --name: {args.name!r} is not a run name (no '/', not empty)")
    args.resumed_step = None
    if args.resume:
        found = find_resumable(args.storage, args.name)
        if found is None:
            p.error(f"argument --resume: no run {args.name!r} or {args.name}-YYYYmmdd-HHMMSS with a checkpoint "
                    f"in {args.storage}")
        args.name, args.resumed_step = found
        if args.resumed_step >= args.max_steps:
            p.error(f"argument --max-steps: run {args.name!r} is already at step {args.resumed_step}; "
                    f"give --max-steps above it to continue")
    else:  # a fresh run gets a fresh directory
        args.name = f"{args.name}-{time.strftime('%Y%m%d-%H%M%S')}"
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    run_dir = run_path(args.storage, args.name)
    if args.resumed_step is not None:
        print(f"resuming {run_dir} from its checkpoint at step {args.resumed_step}", flush=True)
    else:
        print(f"run directory: {run_dir}", flush=True)

    text = open(TEXT, "rb").read()
    split = int(len(text) * 0.9)
    train_data, held_out = ByteWindows(text[:split], args.context), ByteWindows(text[split:], args.context)
    name = args.name
    cluster = rayzero.ClusterConfig(
        workers=args.workers,
        storage=args.storage,
        name=name,
        checkpoint_every=args.checkpoint_every,
        max_failures=2,
        elastic_check_interval_s=5,
        resources_per_worker={"CPU": args.cpus_per_worker},
        use_gpu=args.gpu,
        verbose=args.verbose,
    )
    os.environ.setdefault("RAYZERO_THREADS_PER_WORKER", str(args.cpus_per_worker))
    config = engine_config(args)
    context = args.context
    try:
        result = rayzero.fit(
            lambda: TinyGPT(context=context),
            cluster,
            config=config,
            data=train_data,
            loss_fn=lm_loss,
            max_steps=args.max_steps,
            seed=0,
        )
    except ClusterTooSmallError as e:  # --workers / --cpus-per-worker the cluster cannot host: one line, no traceback
        sys.exit(f"{os.path.basename(__file__)}: error: {e}")
    except rayzero.RunStopped as e:  # Ctrl-C / SIGTERM: fit printed what it saved; this script's own resume command
        again = [a for a in (sys.argv[1:] if argv is None else argv) if a != "--resume"] + ["--name", e.run, "--resume"]
        sys.exit(f"{os.path.basename(__file__)}: stopped; to resume: python {shlex.join(['examples/train.py', *again])}")
    losses = result.losses
    if result.resumed_from is not None:
        print(f"resumed from step {result.resumed_from}")
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
