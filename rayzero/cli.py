"""The ``rayzero`` command.  ``rayzero ckpt inspect|verify|export|import-deepspeed``, ``rayzero plot``, ``rayzero tune``,
``rayzero launch``; more groups plug in as subparsers.

Exit codes: 0 success, 1 a check failed (``verify`` found problems), 2 an error (bad checkpoint path,
unreadable manifest, bad arguments).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Callable

from rayzero.checkpoint.format import CheckpointError

EXIT_OK, EXIT_FAILED, EXIT_ERROR = 0, 1, 2


def _ckpt_inspect(args: argparse.Namespace) -> int:
    from rayzero.checkpoint.tools import format_inspect, inspect

    summary = inspect(args.dir, tag=args.tag)
    print(json.dumps(summary, indent=1) if args.json else format_inspect(summary))
    return EXIT_OK


def _ckpt_verify(args: argparse.Namespace) -> int:
    from rayzero.checkpoint.tools import inspect, verify

    problems = verify(args.dir, tag=args.tag)
    if problems:
        print(f"FAILED: {len(problems)} problem(s)")
        for p in problems:
            print(f"  {p}")
        return EXIT_FAILED
    s = inspect(args.dir, tag=args.tag)
    print(f"OK: {len(s['files'])} files, {s['num_fragments']} fragments verified (checkpoint {s['tag']})")
    return EXIT_OK


def _ckpt_export(args: argparse.Namespace) -> int:
    from rayzero.checkpoint.tools import export

    out = export(args.dir, args.out, tag=args.tag, fmt=args.format)
    print(f"exported {out['tensors']} tensors ({out['bytes']:,} bytes) of checkpoint {out['tag']} to {out['path']}")
    return EXIT_OK


def _ckpt_import_deepspeed(args: argparse.Namespace) -> int:
    from rayzero.checkpoint.deepspeed_import import import_deepspeed

    s = import_deepspeed(args.dir, args.out, tag=args.tag)
    print(f"imported DeepSpeed {s['kind']} checkpoint {s['source']} (ZeRO stage {s['stage']}, saved by "
          f"{s['saved_world']} ranks, step {s['global_steps']}): {s['params']} parameters with fp32 masters and "
          f"Adam state, written to {s['path']}")
    return EXIT_OK


def _add_ckpt(sub: argparse._SubParsersAction) -> None:
    ckpt = sub.add_parser("ckpt", help="inspect, verify, export and import (from DeepSpeed) universal checkpoints")
    cmds = ckpt.add_subparsers(dest="ckpt_command", metavar="COMMAND", required=True)
    where = "a save directory (tag from its 'latest') or a checkpoint directory; local path or pyarrow.fs URI"

    p = cmds.add_parser("inspect", help="summarize a checkpoint: step, topology, parameters, files")
    p.add_argument("dir", help=where)
    p.add_argument("--tag", help="checkpoint tag (default: the one 'latest' names)")
    p.add_argument("--json", action="store_true", help="print the summary as JSON")
    p.set_defaults(run=_ckpt_inspect)

    p = cmds.add_parser("verify", help="check every file's size and hash and every fragment's hash")
    p.add_argument("dir", help=where)
    p.add_argument("--tag", help="checkpoint tag (default: the one 'latest' names)")
    p.set_defaults(run=_ckpt_verify)

    p = cmds.add_parser("export", help="write consolidated weights as .safetensors or a torch state dict (.pt)")
    p.add_argument("dir", help=where)
    p.add_argument("out", help="output file: *.safetensors, or *.pt / *.pth for torch.save")
    p.add_argument("--tag", help="checkpoint tag (default: the one 'latest' names)")
    p.add_argument("--format", choices=["safetensors", "torch"], help="override the format the suffix implies")
    p.set_defaults(run=_ckpt_export)

    p = cmds.add_parser("import-deepspeed", help="convert a DeepSpeed ZeRO 1-3 or universal checkpoint into a "
                        "rayzero checkpoint (fp32 masters, Adam state, step)")
    p.add_argument("dir", help="DeepSpeed's checkpoint directory (with 'latest'), a tag's folder in it, or "
                   "ds_to_universal's output folder")
    p.add_argument("out", help="rayzero save directory to write (local path or pyarrow.fs URI)")
    p.add_argument("--tag", help="DeepSpeed tag to import (default: the one 'latest' names)")
    p.set_defaults(run=_ckpt_import_deepspeed)


def _plot(args: argparse.Namespace) -> int:
    from rayzero.train.metrics import plot_loss

    out = args.out
    if out is None:
        if "://" in args.run_dir:
            print("rayzero: error: give --out for a run on remote storage", file=sys.stderr)
            return EXIT_ERROR
        out = os.path.join(args.run_dir, "loss.png")
    print(f"wrote {plot_loss(args.run_dir, out)}")
    return EXIT_OK


def _add_plot(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("plot", help="draw a run's loss curve (from its metrics.jsonl) to a PNG")
    p.add_argument("run_dir", metavar="RUN", help="the run directory (<storage>/<name>) holding metrics.jsonl")
    p.add_argument("--out", help="PNG path (default: RUN/loss.png)")
    p.set_defaults(run=_plot)


def load_object(spec: str):
    """``package.module:name`` or ``path/to/file.py:name``: the object it names.  A file's module is sent to
    Ray workers by value (they need not have the file on their import path)."""
    import importlib
    import importlib.util

    where, sep, name = spec.rpartition(":")
    if not sep or not where or not name:
        raise ValueError(f"{spec!r}: write module:name or path/to/file.py:name")
    if where.endswith(".py") or os.sep in where:
        path = os.path.abspath(where)
        if not os.path.isfile(path):
            raise ValueError(f"{spec!r}: no file {path}")
        mod_name = "rayzero_user_" + os.path.splitext(os.path.basename(path))[0]
        module_spec = importlib.util.spec_from_file_location(mod_name, path)
        module = importlib.util.module_from_spec(module_spec)
        sys.modules[mod_name] = module
        module_spec.loader.exec_module(module)
        import ray.cloudpickle as cloudpickle

        cloudpickle.register_pickle_by_value(module)
    else:
        module = importlib.import_module(where)
    try:
        return getattr(module, name)
    except AttributeError:
        raise ValueError(f"{spec!r}: {where} has no {name!r}") from None


def _csv(kind):
    return lambda text: [kind(x) for x in text.split(",") if x.strip()]


def _tune(args: argparse.Namespace) -> int:
    from rayzero.config import ConfigError
    from rayzero.train.cluster_config import ClusterConfig
    from rayzero.train.tune import tune

    try:
        tune(
            load_object(args.model),
            ClusterConfig(workers=args.workers, address=args.address, use_gpu=args.gpu),
            config=args.config,
            data=load_object(args.data),
            loss_fn=load_object(args.loss) if args.loss else None,
            train_step=load_object(args.train_step) if args.train_step else None,
            steps=args.steps,
            warmup=args.warmup,
            stages=args.stages,
            micro_batches=args.micro_batches,
            bucket_factors=tuple(args.bucket_factors),
            offload=args.offload,
            search="grid" if args.grid else "coordinate",
            confirm=args.confirm,
            out=args.out,
        )
    except ConfigError as e:
        print(f"rayzero: error: {e}", file=sys.stderr)
        return EXIT_ERROR
    return EXIT_OK


def _add_tune(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("tune", help="find the fastest stage, micro-batch, buckets and offload with short trials",
                       description="Short training trials on the Ray cluster (run by Ray Tune) over ZeRO stage, "
                       "micro-batch (the global batch stays the config's), bucket sizes and offload; writes the "
                       "fastest config as JSON for rayzero.fit / rayzero.initialize.  See docs/tune.md.")
    p.add_argument("--model", required=True, help="model factory (or module): module:name or file.py:name")
    p.add_argument("--data", required=True, help="data factory (rank, world, micro_batch) -> iterable, or a Dataset")
    p.add_argument("--loss", help="loss_fn(output, batch), as fit takes it")
    p.add_argument("--train-step", help="train_step(engine, batch) -> loss, instead of --loss")
    p.add_argument("--config", required=True, help="the rayzero config (JSON or YAML) to start from")
    p.add_argument("--workers", type=int, default=2, help="workers per trial (default 2)")
    p.add_argument("--address", help="Ray cluster address (default: RAY_ADDRESS, else a local cluster)")
    p.add_argument("--gpu", action="store_true", help="one GPU per worker")
    p.add_argument("--out", default="rayzero_tuned.json", help="where the best config goes (default %(default)s)")
    p.add_argument("--steps", type=int, default=6, help="timed steps a trial (default 6)")
    p.add_argument("--warmup", type=int, default=2, help="warm-up steps a trial, not timed (default 2)")
    p.add_argument("--stages", type=_csv(int), help="ZeRO stages to try (default 1,2,3 and the config's)")
    p.add_argument("--micro-batches", type=_csv(int),
                   help="micro-batch sizes to try (default: divisors of the per-worker batch within 4x of the config's)")
    p.add_argument("--bucket-factors", type=_csv(float), default=[0.25, 0.5, 1.0, 2.0],
                   help="bucket sizes to try, as multiples of the derived size (default 0.25,0.5,1,2)")
    p.add_argument("--offload", type=_csv(str), help="optimizer offload choices: none,cpu,nvme (default: the config's)")
    p.add_argument("--confirm", type=int, default=3,
                   help="after the search, run the N fastest configs once more; each keeps its fastest run (default 3)")
    p.add_argument("--grid", action="store_true", help="run every config of the grid instead of the search")
    p.set_defaults(run=_tune)


def _launch(args: argparse.Namespace) -> int:
    from rayzero.deepspeed.launch import launch

    env = {}
    for item in args.env:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ValueError(f"--env {item!r}: write KEY=VALUE")
        env[key] = value
    try:
        return launch(args.script, args.args, workers=args.workers, address=args.address, env=env,
                      gpus_per_worker=args.gpus_per_worker)
    except RuntimeError as e:  # the cluster cannot place the ranks
        print(f"rayzero: error: {e}", file=sys.stderr)
        return EXIT_ERROR


def _add_launch(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("launch", help="run a DeepSpeed-style script on the Ray cluster, one actor per rank",
                       description="Run SCRIPT as __main__ on N ranks of the Ray cluster (one actor each, placed "
                       "together where they fit) with the variables torchrun sets (RANK, WORLD_SIZE, LOCAL_RANK, "
                       "LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT).  Exit status: 0 when every rank ends 0, else "
                       "the first failing rank's.  See docs/deepspeed.md.")
    p.add_argument("--workers", type=int, default=2, help="ranks to run (default 2)")
    p.add_argument("--address", help="Ray cluster address (default: RAY_ADDRESS, else a local cluster)")
    p.add_argument("--env", action="append", default=[], metavar="KEY=VALUE",
                   help="set in every rank before the script starts (repeatable); the ranks do not inherit this "
                   "shell's environment")
    p.add_argument("--gpus-per-worker", type=float, default=0, help="GPUs each rank holds (default 0)")
    p.add_argument("script", help="the script's path, on every node a rank runs on")
    p.add_argument("args", nargs=argparse.REMAINDER, help="the script's arguments")
    p.set_defaults(run=_launch)


# Each command group registers itself here: (name, function that adds its subparser).
COMMAND_GROUPS: list[tuple[str, Callable[[argparse._SubParsersAction], None]]] = [
    ("ckpt", _add_ckpt),
    ("plot", _add_plot),
    ("tune", _add_tune),
    ("launch", _add_launch),
]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="rayzero", description="rayzero command-line tools")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for _, add in COMMAND_GROUPS:
        add(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.run(args)
    except BrokenPipeError:  # `rayzero ckpt inspect ... | head`: stop quietly
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_FAILED
    except (CheckpointError, OSError, ValueError) as e:  # one clear line, no traceback
        print(f"rayzero: error: {e}", file=sys.stderr)
        return EXIT_ERROR


if __name__ == "__main__":
    sys.exit(main())
