"""Per-rank runs for the graph-capture tests: the same training eager and captured, side by side."""

from __future__ import annotations

import torch

import rayzero
from ckpt_cases import global_step
from zero_cases import base_config, batches, make_model

SCHEDULER = {"type": "WarmupLR", "params": {"warmup_num_steps": 3, "warmup_max_lr": 1e-2}}


def train(rank: int, world: int, stage: int, steps: int, capture: dict | None, dtype: str = "fp32",
          gas: int = 1, inf_at: int | None = None, ckpt: str | None = None, save_at: int | None = None,
          reload_at: int | None = None) -> dict:
    """Train ``steps`` steps of the zero_cases MLP (clipping, a warm-up lr schedule, ``gas`` micro-steps).

    ``inf_at``: that step's first micro-batch gets an inf input (fp16: the step must be skipped);
    ``ckpt``: a directory the run saves to after step ``save_at`` and loads back after step ``reload_at``
    (the same engine goes back to the saved state and trains on).
    """
    cfg = base_config(stage, world, 8, gas, scheduler=SCHEDULER)
    if dtype != "fp32":
        cfg[dtype] = {"enabled": True, **({"initial_scale_power": 8} if dtype == "fp16" else {})}
    if capture is not None:
        cfg["graph_capture"] = capture
    engine = rayzero.initialize(make_model(), cfg)
    per_rank = 8 // world
    losses, norms, captures = [], [], []
    for i, (x, y) in enumerate(batches(steps, 8)):
        xs, ys = x[rank * per_rank : (rank + 1) * per_rank], y[rank * per_rank : (rank + 1) * per_rank]
        if inf_at == i:
            xs = xs.clone()
            xs[0, 0] = float("inf")
        losses.append(global_step(engine, xs, ys, gas))
        norms.append(engine.global_grad_norm)
        captures.append(engine._capture.captures if engine._capture is not None else None)
        if ckpt and save_at == i:
            engine.save_checkpoint(ckpt, tag="mid")
        if ckpt and reload_at == i:
            engine.load_checkpoint(ckpt, tag="mid")
    cache = engine._capture.cache if engine._capture is not None else None
    out = {
        "cache_loaded": cache.loaded if cache else None,
        "cache_saved": cache.saved_bytes if cache else None,
        "losses": losses,
        "norms": norms,
        "captures": captures,
        "replays": engine._capture.replays if engine._capture is not None else None,
        "skipped": engine.skipped_steps,
        "scale": engine.loss_scale,
        "lr": engine.get_lr(),
        "state": engine.full_state_dict(),
    }
    engine.destroy()
    return out


def pairs(rank: int, world: int, cases: list[dict]) -> list[tuple[dict, dict]]:
    """Each case trained eager and captured, in one process (one spawn for many cases); a case's
    ``capture`` (default ``{"enabled": true}``) is the captured run's section, ``ckpt`` gets a suffix."""
    out = []
    for case in cases:
        case = dict(case)
        capture = case.pop("capture", {"enabled": True})
        ckpt = case.pop("ckpt", None)
        eager = train(rank, world, capture=None, ckpt=ckpt and ckpt + "/eager", **case)
        out.append((eager, train(rank, world, capture=capture, ckpt=ckpt and ckpt + "/captured", **case)))
    return out


def refused(rank: int, world: int, cfg_extra: dict, accelerator: str | None = None) -> str:
    """The error ``initialize`` raises for a config with capture (optionally on a stand-in accelerator)."""
    if accelerator is not None:
        import os

        from rayzero.accelerator import register_accelerator
        from rayzero.accelerator.cpu import CpuAccelerator

        class StandIn(CpuAccelerator):  # the CPU's kernels under another device kind's name
            name = accelerator

        register_accelerator(accelerator, StandIn, replace=True)
        os.environ["RAYZERO_ACCELERATOR"] = accelerator
    cfg = base_config(1, world, 8, **{"graph_capture": {"enabled": True}, **cfg_extra})
    try:
        engine = rayzero.initialize(make_model(), cfg)
    except Exception as e:  # noqa: BLE001 - the test checks the type and the message
        return f"{type(e).__name__}: {e}"
    engine.destroy()
    return "no error"


def graph_api(rank: int, world: int, accelerator: str) -> dict:
    """The accelerator's graph calls on a small in-place function."""
    from rayzero.accelerator import get_accelerator
    from rayzero.accelerator.graphs import GraphCaptureError

    acc = get_accelerator(accelerator)
    a, b, out = torch.arange(4.0), torch.ones(4), torch.zeros(4)

    def fn(a, b, out):
        out.copy_(torch.sin(a) * 2 + b)

    graph = acc.create_graph()
    errors = []
    try:
        graph.record(fn, a, b, out)  # outside capture_to_graph
    except GraphCaptureError as e:
        errors.append(str(e))
    with acc.capture_to_graph(graph) as recorder:
        recorder.record(fn, a, b, out)
        try:
            acc.replay_graph(graph)
        except GraphCaptureError as e:
            errors.append(str(e))
    after_record = out.clone()
    acc.replay_graph(graph)
    first = out.clone()
    a.add_(1.0)  # replays read the static inputs' current values
    acc.replay_graph(graph)
    second = out.clone()
    try:
        acc.replay_graph(acc.create_graph())
    except GraphCaptureError as e:
        errors.append(str(e))
    return {"after_record": after_record, "first": first, "second": second, "errors": errors,
            "expect_first": torch.sin(torch.arange(4.0)) * 2 + 1, "expect_second": torch.sin(torch.arange(4.0) + 1) * 2 + 1}


def run_code(rank: int, world: int, code: str) -> str:
    """Execute a docs example; return what it printed."""
    import contextlib
    import io

    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        exec(compile(code, "docs/graph_capture.md", "exec"), {"__name__": "__doc_example__"})
    return printed.getvalue()


def cached(rank: int, world: int, cache_dir: str) -> dict:
    """Captured training (step and model) with a compile cache: what was loaded, compiled and written."""
    from torch._dynamo.utils import counters

    run = train(rank, world, stage=2, steps=3, capture={"enabled": True, "targets": ["model"], "cache_dir": cache_dir})
    inductor = counters["inductor"]
    run.update(hits=inductor["fxgraph_cache_hit"], misses=inductor["fxgraph_cache_miss"])
    return run


def sgd_under_capture(rank: int, world: int, params: dict, accelerator: str) -> dict:
    """SGD with graph capture on a CPU stand-in named ``accelerator``: the error ``initialize`` raises, or
    the optimizer's kernel choice, and the host syncs (tests/sync_count.py, every tensor) of the second
    step and of ``get_lr()``.  Capture starts after 100 warm-up steps, so the steps run eagerly, but the lr
    is already the 0-dim tensor the captured step reads, as in the warm-up before a CUDA capture."""
    import os

    from rayzero.accelerator import register_accelerator
    from rayzero.accelerator.cpu import CpuAccelerator
    from sync_count import SyncCounter

    class StandIn(CpuAccelerator):  # the CPU's kernels under another device kind's name
        name = accelerator

    register_accelerator(accelerator, StandIn, replace=True)
    os.environ["RAYZERO_ACCELERATOR"] = accelerator
    cfg = base_config(1, world, 8, scheduler=SCHEDULER,
                      optimizer={"type": "SGD", "params": {"lr": 0.1, **params}},
                      graph_capture={"enabled": True, "warmup_steps": 100})
    try:
        engine = rayzero.initialize(make_model(), cfg)
    except Exception as e:  # noqa: BLE001 - the test checks the type and the message
        return {"error": f"{type(e).__name__}: {e}"}
    group = engine.optimizer.param_groups[0]
    out = {"error": None, "fused": group["fused"], "foreach": group["foreach"],
           "tensor_lr": torch.is_tensor(group["lr"])}
    for i, (x, y) in enumerate(batches(2, 8)):
        counter = SyncCounter("all")
        with counter if i == 1 else _no_count():
            rows = slice(rank * 4, (rank + 1) * 4)
            engine.backward(torch.nn.functional.mse_loss(engine(x[rows]), y[rows]))
            engine.step()
    with SyncCounter("all") as lr_reads:
        lrs = engine.get_lr()
    out.update(step_syncs=counter.summary(), step_count=len(counter), lr=lrs,
               lr_on_device=[float(g["lr"]) for g in engine.optimizer.param_groups], lr_syncs=lr_reads.summary())
    engine.destroy()
    return out


class _no_count:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return None
