"""The ``rayzero`` command.  ``rayzero ckpt inspect|verify|export``; more groups plug in as subparsers.

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


def _add_ckpt(sub: argparse._SubParsersAction) -> None:
    ckpt = sub.add_parser("ckpt", help="inspect, verify and export universal checkpoints")
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


# Each command group registers itself here: (name, function that adds its subparser).
COMMAND_GROUPS: list[tuple[str, Callable[[argparse._SubParsersAction], None]]] = [
    ("ckpt", _add_ckpt),
    ("plot", _add_plot),
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
