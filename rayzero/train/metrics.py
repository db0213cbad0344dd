"""Per-step metrics as JSON lines in the run's storage (and TensorBoard when installed), and the loss plot."""

from __future__ import annotations

import json
import os
import re
import time
from collections import OrderedDict
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


# ---- what the driver prints while a run goes: progress lines, start-up phases, workers' output ------------------


def step_rate(records: list[dict], window: int = 10, min_steps: int = 3) -> float | None:
    """Steps per second over the last ``window`` step intervals of ``records`` (their ``time``), counting only the
    trailing run of consecutive steps (a restart that redoes steps starts a new run); None until that run
    holds ``min_steps`` intervals.  Start-up, the first step and checkpoint loads before the run do not count."""
    if not records:
        return None
    tail = [records[-1]]
    for r in reversed(records[:-1]):
        if len(tail) > window or r.get("step") != tail[-1].get("step", 0) - 1 or "time" not in r:
            break
        tail.append(r)
    steps = len(tail) - 1
    if steps < min_steps or "time" not in tail[0]:
        return None
    elapsed = tail[0]["time"] - tail[-1]["time"]
    return steps / elapsed if elapsed > 0 else None


def eta_seconds(records: list[dict], max_steps: int, **kw) -> float | None:
    """Seconds to ``max_steps`` at the recent step rate (``step_rate``): steps left / steps per second."""
    rate = step_rate(records, **kw)
    if rate is None or not records:
        return None
    return max(0, max_steps - records[-1]["step"]) / rate


def format_duration(seconds: float) -> str:
    s = int(round(seconds))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"


def lr_value(lr: Any) -> float | None:
    """The learning rate as a number, whatever carried it: a float, a one-element list (``get_lr()``), a tensor,
    or a tensor's repr (``"tensor(0.0030)"``)."""
    while isinstance(lr, (list, tuple)) and lr:
        lr = lr[0]
    if hasattr(lr, "item"):
        lr = lr.item()
    if isinstance(lr, str):
        m = re.search(r"[-+]?(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?", lr)
        lr = float(m.group(0)) if m else None
    return float(lr) if isinstance(lr, (int, float)) else None


def progress_line(record: dict, max_steps: int, eta: float | None) -> str:
    """``[rayzero] step 40/60  loss 2.3412  lr 3.00e-03  5310 samples/s  world 2  ETA 9s``."""
    line = f"[rayzero] step {record['step']}/{max_steps}  loss {record['loss']:.4f}"
    lr = lr_value(record.get("lr"))
    if lr is not None:
        line += f"  lr {lr:.2e}"
    if "samples_per_s" in record:
        line += f"  {record['samples_per_s']:.0f} samples/s"
    line += f"  world {record.get('world_size', '?')}"
    if eta is not None:
        line += f"  ETA {format_duration(eta)}"
    return line


PHASE_NAMESPACE = "rayzero-phase"


def publish_phase(run: str, text: str, start: bool = False) -> None:
    """From a worker (rank 0): tell the driver that the run ``run`` entered a phase.  It goes through Ray's GCS
    key-value store (one key per phase), so the driver sees it however worker output is routed; ``start`` marks
    the start of a worker group (a restart after the first)."""
    try:
        from ray.experimental.internal_kv import _internal_kv_initialized, _internal_kv_put

        if _internal_kv_initialized():
            value = json.dumps({"text": text, "start": start, "time": time.time()})
            _internal_kv_put(f"{run}/{time.time_ns():020d}-{os.getpid()}", value, namespace=PHASE_NAMESPACE)
    except Exception:  # a phase line is a courtesy: never fail a run for it
        pass


def read_phases(run: str, seen: set) -> list[dict]:
    """The phases of ``run`` not in ``seen`` (keys, updated), oldest first."""
    from ray.experimental.internal_kv import _internal_kv_get, _internal_kv_list

    out = []
    for key in sorted(_internal_kv_list(f"{run}/", namespace=PHASE_NAMESPACE)):
        if key in seen:
            continue
        seen.add(key)
        raw = _internal_kv_get(key, namespace=PHASE_NAMESPACE)
        if raw:
            out.append(json.loads(raw))
    return out


def clear_phases(run: str) -> None:
    from ray.experimental.internal_kv import _internal_kv_del

    _internal_kv_del(f"{run}/", del_by_prefix=True, namespace=PHASE_NAMESPACE)


class WorkerOutputFilter:
    """What of the workers' output Ray forwards to the driver reaches the console when ``verbose`` is off.

    Dropped: Ray's own core (C++) log lines (``[2026-01-01 12:00:00,000 E 123 456] core_worker.cc:...``), which
    stay in Ray's log files, and Ray Train's line for every report (``Reporting training result N:
    TrainingReport(...)``).  Warnings (any line that says ``warn``, in any case) are printed once for the whole
    run, however many ranks or restarts repeat them (numbers in them are ignored when comparing, so
    ``rank 3: ...`` and ``rank 5: ...`` are one warning).  Other lines are printed once per distinct text across
    processes: the ranks' identical output shows once, while one process's repeated line still shows each time.
    Ray's node messages (raylet: out-of-memory kills, ...) and autoscaler events pass untouched.  Ray Train's
    housekeeping actor ``PlacementGroupCleaner`` is not heard (it warns on every poll when the cluster runs
    without a dashboard, and outlives the run)."""

    HOUSEKEEPING = ("PlacementGroupCleaner",)

    CORE_LOG = re.compile(r"^(\x1b\[[0-9;]*m)*\[\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} [DIWEF] \d+ \d+\] ")
    TRAIN_REPORT = re.compile(r"Reporting training result \d+: TrainingReport\(")
    WARNING = re.compile(r"warn", re.IGNORECASE)
    NUMBER = re.compile(r"\S*\d\S*")

    REMEMBERED = 4096  # distinct lines (and warnings) remembered, the least recently seen forgotten first

    def __init__(self):
        self.warnings: OrderedDict[str, None] = OrderedDict()
        self.lines: OrderedDict[str, Any] = OrderedDict()  # text -> the process that printed it first

    def new_group(self) -> None:
        """A new worker group started (a restart): its processes' lines are heard again; warnings stay once."""
        self.lines.clear()

    def _remember(self, table: OrderedDict, key: str, value: Any) -> Any:
        """The value ``key`` already has (it becomes the most recent), else ``value``, stored."""
        if key in table:
            table.move_to_end(key)
            return table[key]
        table[key] = value
        while len(table) > self.REMEMBERED:
            table.popitem(last=False)
        return value

    def filter(self, data: dict) -> dict | None:
        """``data`` is one batch of Ray's log stream (``lines``, ``pid``, ``actor_name``, ...): the batch with
        only the lines to print, or None when none is left."""
        if data.get("pid") in ("raylet", "autoscaler"):
            return data
        if data.get("actor_name") in self.HOUSEKEEPING:
            return None
        source = (data.get("ip"), data.get("pid"))
        keep = []
        for line in data.get("lines") or []:
            if self.CORE_LOG.match(line) or self.TRAIN_REPORT.search(line):
                continue
            if self.WARNING.search(line):
                key = " ".join(self.NUMBER.sub("", line).split())
                if key in self.warnings:
                    continue
                self._remember(self.warnings, key, None)
            else:
                if self._remember(self.lines, line, source) != source:
                    continue
            keep.append(line)
        if not keep:
            return None
        return {**data, "lines": keep}


class _Console:
    """The filter Ray's printing of the workers' output on this driver goes through (None: Ray's own printing)."""

    filter: WorkerOutputFilter | None = None


def new_worker_group() -> None:
    """The run's worker group restarted: the quiet console hears its processes' lines again."""
    if _Console.filter is not None:
        _Console.filter.new_group()


def set_worker_output(quiet: bool) -> None:
    """From now on (until the next call, or ``ray.shutdown``), print the workers' output through a fresh
    ``WorkerOutputFilter`` (``quiet``), or as Ray prints it.  It stays after a quiet ``fit`` returns, so Ray Train's
    housekeeping after the run (a placement group cleaner that keeps polling, ...) stays off the console too.

    Ray 2.60 prints that output with the handler ``ray_print_logs`` of ``ray._private.worker``'s stream
    dispatcher, which ``ray.init(log_to_driver=True)`` installs; this wraps it once.  Without that handler
    (``log_to_driver=False``, another Ray) nothing changes."""
    _Console.filter = WorkerOutputFilter() if quiet else None
    try:
        from ray._private.worker import global_worker_stdstream_dispatcher as dispatcher
    except ImportError:
        return
    with dispatcher._lock:
        current = [h for name, h in dispatcher.handlers if name == "ray_print_logs"]
    if not current or getattr(current[0], "_rayzero_console", False):
        return
    original = current[0]

    def filtered(data):
        flt = _Console.filter
        if flt is not None:
            data = flt.filter(data)
        if data is not None:
            original(data)

    filtered._rayzero_console = True
    dispatcher.remove_handler("ray_print_logs")
    dispatcher.add_handler("ray_print_logs", filtered)
