"""Per-step metrics as JSON lines in the run's storage (and TensorBoard when installed), and the loss plot."""

from __future__ import annotations

import json
import os
from typing import Any

from rayzero.checkpoint.storage import Storage

METRICS_FILE = "metrics.jsonl"


class MetricsWriter:
    """Rank 0 appends one JSON object per step.  Local files are appended and flushed line by line;
    object stores get the whole file rewritten every ``flush_every`` lines (they have no append)."""

    def __init__(self, run_dir: str, flush_every: int = 10):
        self.storage = Storage.resolve(run_dir)
        self.storage.makedirs(self.storage.root)
        self.path = self.storage.join(METRICS_FILE)
        self.flush_every = flush_every
        self._lines: list[str] = []
        self._local = open(self.path, "a", encoding="utf-8") if self.storage.local else None
        if not self.storage.local and self.storage.exists(self.path):
            self._lines = self.storage.read_bytes(self.path).decode().splitlines()
        self._tb = None
        try:  # optional: TensorBoard event files next to the JSONL
            from torch.utils.tensorboard import SummaryWriter

            if self.storage.local:
                self._tb = SummaryWriter(os.path.join(self.storage.root, "tensorboard"))
        except Exception:
            self._tb = None

    def write(self, record: dict[str, Any]) -> None:
        line = json.dumps(record, separators=(",", ":"))
        if self._local is not None:
            self._local.write(line + "\n")
            self._local.flush()
        else:
            self._lines.append(line)
            if len(self._lines) % self.flush_every == 0:
                self._flush_remote()
        if self._tb is not None and "step" in record:
            for k, v in record.items():
                if isinstance(v, (int, float)) and k != "step":
                    self._tb.add_scalar(k, v, record["step"])

    def _flush_remote(self) -> None:
        self.storage.write_bytes_atomic(self.path, ("\n".join(self._lines) + "\n").encode())

    def close(self) -> None:
        if self._local is not None:
            self._local.close()
            self._local = None
        elif self._lines:
            self._flush_remote()
        if self._tb is not None:
            self._tb.close()
            self._tb = None


def read_metrics(run_dir: str) -> list[dict]:
    storage = Storage.resolve(run_dir)
    path = storage.join(METRICS_FILE)
    if not storage.exists(path):
        raise FileNotFoundError(f"no {METRICS_FILE} in {run_dir!r}: is it a rayzero run directory?")
    out = []
    for line in storage.read_bytes(path).decode().splitlines():
        if line.strip():
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                continue  # a line cut by a crash
    return out


def plot_loss(run_dir: str, out_png: str) -> str:
    """Draw the loss curve of a run (the last record per step wins, so restarts overwrite) to a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    by_step: dict[int, dict] = {}
    for r in read_metrics(run_dir):
        if "step" in r and "loss" in r:
            by_step[r["step"]] = r
    if not by_step:
        raise ValueError(f"{run_dir!r} has no loss records to plot")
    steps = sorted(by_step)
    fig, ax = plt.subplots(figsize=(7, 4), dpi=110)
    ax.plot(steps, [by_step[s]["loss"] for s in steps], lw=1.5, label="loss")
    worlds = [by_step[s].get("world_size") for s in steps]
    for i in range(1, len(steps)):
        if worlds[i] != worlds[i - 1]:
            ax.axvline(steps[i], color="grey", ls="--", lw=0.8)
            ax.text(steps[i], ax.get_ylim()[1], f" world {worlds[i]}", va="top", fontsize=8, color="grey")
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.set_title(f"rayzero run {os.path.basename(run_dir.rstrip('/'))}")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out_png)
    plt.close(fig)
    return out_png
