"""The sections of bench/gpu_check.py, each run in a fresh process: ``python bench/gpu_cases.py SECTION ARGS_JSON``.

Every section compares rayzero on the device against the same run on the CPU (or captured against eager,
offloaded against on-device) and writes one JSON result: ``status`` (PASS / FAIL / SKIP), ``reason``,
``numbers`` (one line for the table) and ``details`` (lines for the log). ``device`` is ``cuda`` on a GPU
and ``cpu`` in the dry run (``--cpu-smoke``), where the comparisons run CPU against CPU: that proves the
script, not the GPU.
"""

from __future__ import annotations

import collections
import contextlib
import copy
import json
import math
import os
import socket
import sys
import tempfile
import time
import traceback
import warnings

import torch
import torch.nn.functional as F

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
TEXT = os.path.join(ROOT, "examples", "data", "public_domain.txt")

# Tolerances of a device run against the CPU run of the same config (relative: |a-b| / |b|, and for the
# weights ||a-b|| / ||b|| over every tensor of the state dict). fp32: only reduction order differs (no TF32:
# torch leaves it off for matmuls); a 1% change of the learning rate moves the weights by 4e-4 here. bf16:
# both runs round to bf16, but where differs by kernel; bf16 against fp32 compute is 2e-3 on the CPU, so 1e-2
# catches a wrong scale or a missed clip, not rounding.
TOL = {
    "fp32": {"loss": 1e-4, "weights": 1e-4},
    "bf16": {"loss": 1e-2, "weights": 1e-2},
    "same-device": {"loss": 1e-5, "weights": 1e-5},  # captured against eager, both on the device
}


# ---- shared pieces ----------------------------------------------------------------------------------------

def use_accelerator(name: str) -> None:
    """rayzero picks its accelerator per engine from RAYZERO_ACCELERATOR (one cached instance per name), so
    the CPU reference and the device run can share this process."""
    os.environ["RAYZERO_ACCELERATOR"] = name


def tokens() -> torch.Tensor:
    with open(TEXT, "rb") as f:
        return torch.tensor(list(f.read()), dtype=torch.long)


def lm_batches(steps: int, global_batch: int, context: int, seed: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Random windows of the example text: (inputs, next-byte targets) per step, on the host."""
    data = tokens()
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        start = torch.randint(0, len(data) - context - 1, (global_batch,), generator=g)
        win = torch.stack([data[s : s + context + 1] for s in start.tolist()])
        out.append((win[:, :-1].contiguous(), win[:, 1:].contiguous()))
    return out


def make_gpt(seed: int = 0, dim: int = 64, layers: int = 2, heads: int = 4, context: int = 32):
    from examples.train import TinyGPT

    torch.manual_seed(seed)
    return TinyGPT(dim=dim, layers=layers, heads=heads, context=context)


def zero_config(stage: int, dtype: str, global_batch: int, gas: int, clip: float = 0.5, lr: float = 1e-3,
                optimizer: dict | None = None, **extra) -> dict:
    cfg = {
        "train_batch_size": global_batch,
        "gradient_accumulation_steps": gas,
        "zero_optimization": {
            "stage": stage,
            # small buckets and a low persistence threshold, so the tiny model still has several buckets and
            # partitioned stage-3 parameters
            "reduce_bucket_size": 20000,
            "allgather_bucket_size": 20000,
            "stage3_param_persistence_threshold": 1000,
        },
        "optimizer": optimizer or {"type": "AdamW", "params": {"lr": lr, "weight_decay": 0.01}},
        "gradient_clipping": clip,
    }
    if dtype == "bf16":
        cfg["bf16"] = {"enabled": True}
    for key, value in extra.items():
        if key == "zero_optimization":
            cfg["zero_optimization"].update(value)
        else:
            cfg[key] = value
    return cfg


class SyncCounter:
    """Host syncs as torch's CUDA sync debug mode reports them (a warning per synchronizing call: .item(),
    blocking copies, stream and device synchronize, nonzero ...), plus ``torch.cuda.Event.synchronize``,
    which that mode does not report (torch 2.11). Syncs inside backward's kernels are reported at the line
    that called backward (the autograd engine replays its threads' warnings there). ``mark()`` closes one interval (an optimizer step) and keeps its
    count; ``where`` counts the Python lines that synced. On the CPU nothing is counted (``active`` False)."""

    def __init__(self, active: bool):
        self.active = active
        self.total = 0
        self.last = 0
        self.per_step: list[int] = []
        self.where: collections.Counter = collections.Counter()
        self._stack = contextlib.ExitStack()

    def _on_warning(self, message, category, filename, lineno, file=None, line=None):
        text = str(message)
        if "synchroniz" in text.lower():
            self.total += 1
            self.where[f"{os.path.relpath(filename, ROOT) if filename.startswith(ROOT) else filename}:{lineno}"] += 1
        else:
            self._show(message, category, filename, lineno, file, line)

    def __enter__(self):
        if not self.active:
            return self
        self._stack.enter_context(warnings.catch_warnings())
        warnings.simplefilter("always")
        self._show = warnings.showwarning
        warnings.showwarning = self._on_warning  # restored by catch_warnings on exit
        original = torch.cuda.Event.synchronize
        counter = self

        def synchronize(event):
            before = counter.total
            result = original(event)
            if counter.total == before:  # counted once, should a torch version make the mode report it
                counter.total += 1
                counter.where["torch.cuda.Event.synchronize"] += 1
            return result

        torch.cuda.Event.synchronize = synchronize
        self._stack.callback(setattr, torch.cuda.Event, "synchronize", original)
        torch.cuda.set_sync_debug_mode("warn")
        self._stack.callback(torch.cuda.set_sync_debug_mode, "default")
        self.last = self.total
        return self

    def __exit__(self, *exc):
        self._stack.close()
        return False

    def reset(self) -> None:
        self.last = self.total

    def mark(self) -> None:
        if not self.active:
            return
        self.per_step.append(self.total - self.last)
        self.last = self.total

    def summary(self) -> str:
        if not self.active:
            return "n/a (CPU)"
        if not self.per_step:
            return "none counted"
        lo, hi = min(self.per_step), max(self.per_step)
        return f"{lo}" if lo == hi else f"{lo}-{hi}"

    def top(self, n: int = 4) -> str:
        return ", ".join(f"{k} x{v}" for k, v in self.where.most_common(n))


def rel(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), 1e-12)


def compare(run: dict, ref: dict, tol: dict) -> tuple[bool, str]:
    """Per-step losses and the final fp32 weights of ``run`` against ``ref``."""
    loss = max(rel(a, b) for a, b in zip(run["losses"], ref["losses"]))
    num = den = 0.0
    worst = 0.0
    for k, w in ref["state"].items():
        d = run["state"][k].double() - w.double()
        num += float(d.square().sum())
        den += float(w.double().square().sum())
        worst = max(worst, float(d.abs().max()) if d.numel() else 0.0)
    weights = math.sqrt(num) / max(math.sqrt(den), 1e-30)
    ok = loss <= tol["loss"] and weights <= tol["weights"] and len(run["losses"]) == len(ref["losses"])
    return ok, f"loss rel {loss:.1e}, weights rel {weights:.1e} (max abs {worst:.1e})"


def train(acc: str, stage: int, dtype: str, steps: int = 5, gas: int = 2, micro: int = 4, world: int = 1,
          rank: int = 0, counter: SyncCounter | None = None, warm: int = 2, model=None, batches=None,
          check_engine=None, **cfg_extra) -> dict:
    """rayzero on ``acc`` (cuda or cpu): ``steps`` optimizer steps of ``gas`` micro-batches each; this rank's
    share of the same global batches. Losses stay on the device until the end (reading one is a host sync);
    syncs are counted from optimizer step ``warm`` on (the first steps record buckets, capture, ...)."""
    import rayzero

    use_accelerator(acc)
    global_batch = micro * gas * world
    model = model if model is not None else make_gpt()
    batches = batches if batches is not None else lm_batches(steps, global_batch, 32)
    engine = rayzero.initialize(model, zero_config(stage, dtype, global_batch, gas, **cfg_extra))
    try:
        device = next(iter(engine.module.parameters())).device
        if device.type != acc:
            raise AssertionError(f"the model's parameters are on {device}, expected {acc}")
        if check_engine is not None:
            check_engine(engine)
        per_rank = micro * gas
        losses, norms = [], []
        for i, (x, y) in enumerate(batches):
            x, y = x[rank * per_rank : (rank + 1) * per_rank], y[rank * per_rank : (rank + 1) * per_rank]
            # host batches go to the device before the counted step, as a loader with pinned memory would
            x, y = x.to(device), y.to(device)
            if counter is not None:
                counter.reset()
            step_loss = torch.zeros((), device=device)
            for k in range(gas):
                logits = engine(x[k * micro : (k + 1) * micro])
                loss = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), y[k * micro : (k + 1) * micro].reshape(-1))
                engine.backward(loss)
                engine.step()
                step_loss = step_loss + loss.detach() / gas
            if counter is not None and i >= warm:
                counter.mark()
            losses.append(step_loss)
            norms.append(engine.global_grad_norm)
        if world > 1:
            import torch.distributed as dist

            stacked = torch.stack(losses)
            dist.all_reduce(stacked)
            losses = list(stacked / world)
        state = {k: v.detach().float().cpu() for k, v in engine.full_state_dict().items()}
        return {"losses": [float(v) for v in losses], "norms": norms, "state": state}
    finally:
        engine.destroy()


def sync_line(name: str, counter: SyncCounter) -> str:
    return f"{name}: {counter.summary()} syncs/step" + (f" [{counter.top()}]" if counter.where else "")


# ---- sections ---------------------------------------------------------------------------------------------

def section_train_parity(a: dict) -> dict:
    """Tiny GPT, stages 0-3, fp32 and bf16, 2 micro-batches per step, clipping at 0.5: device against CPU."""
    dev = a["device"]
    steps = a.get("steps", 5)
    details, bad, syncs = [], [], {}
    for dtype in a.get("dtypes", ["fp32", "bf16"]):
        for stage in a.get("stages", [0, 1, 2, 3]):
            name = f"stage {stage} {dtype}"
            ref = train("cpu", stage, dtype, steps)
            counter = SyncCounter(dev == "cuda")
            try:
                with counter:
                    run = train(dev, stage, dtype, steps, counter=counter)
            except Exception as e:  # one failing config must not hide the others
                details.append(f"{name}: FAILED: {type(e).__name__}: {str(e)[:300]}")
                bad.append(name)
                continue
            ok, how = compare(run, ref, TOL[dtype])
            clipped = sum(n > 0.5 for n in ref["norms"])
            details.append(f"{name}: {'ok' if ok else 'DIFFERS'}: {how}; clipped {clipped}/{steps} steps; "
                           f"losses {', '.join(f'{v:.4f}' for v in run['losses'])}")
            details.append("  " + sync_line(name, counter))
            syncs[name] = counter.per_step
            if not ok:
                bad.append(name)
    return {
        "status": "FAIL" if bad else "PASS",
        "reason": f"differs from CPU: {', '.join(bad)}" if bad else "",
        "numbers": f"{len(syncs) + len(bad)} configs; fp32 tol {TOL['fp32']['weights']:g}, bf16 tol {TOL['bf16']['weights']:g}",
        "details": details, "syncs": syncs,
    }


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(rank: int, world: int, ports: list, dev: str, cases: list, out: str, limit: float) -> None:
    import faulthandler

    faulthandler.dump_traceback_later(max(limit - 10, 5), exit=True)  # a hung rank says where, then ends
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1")
    torch.set_num_threads(1)
    results = []
    for case, port in zip(cases, ports):
        # rayzero creates the group (nccl on CUDA, gloo on CPU) from the environment, as under torchrun, and
        # destroys it again; a second group on the same port can hang on the first one's store, so each
        # engine gets a port of its own
        os.environ["MASTER_PORT"] = str(port)
        results.append(train(dev, case["stage"], case["dtype"], case["steps"], gas=1, world=world, rank=rank))
    if rank == 0:
        torch.save(results, out)


def section_train_parity_world2(a: dict) -> dict:
    """Two ranks (NCCL on two GPUs; gloo on the CPU in the dry run) against one CPU process over the same
    global batches."""
    dev = a["device"]
    if dev == "cuda" and torch.cuda.device_count() < 2:
        return {"status": "SKIP", "reason": f"needs 2 GPUs, {torch.cuda.device_count()} visible: NCCL between ranks "
                "(reduce-scatter, all-gather, stage-3 gathers, the norm's all-reduce) is not covered"}
    import torch.multiprocessing as mp

    steps = a.get("steps", 3)
    cases = [{"stage": s, "dtype": d, "steps": steps} for d in a.get("dtypes", ["fp32"]) for s in a.get("stages", [0, 1, 2, 3])]
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "rank0.pt")
        mp.spawn(_rank_main, args=(2, [_free_port() for _ in cases], dev, cases, out, a.get("limit", 120)), nprocs=2, join=True)
        runs = torch.load(out)
    details, bad = [], []
    for case, run in zip(cases, runs):
        # one process with twice the micro-batches sees the same global batches
        ref = train("cpu", case["stage"], case["dtype"], steps, gas=2)
        ok, how = compare(run, ref, TOL[case["dtype"]])
        name = f"stage {case['stage']} {case['dtype']} world 2"
        details.append(f"{name}: {'ok' if ok else 'DIFFERS'}: {how}")
        if not ok:
            bad.append(name)
    return {"status": "FAIL" if bad else "PASS", "reason": f"differs: {', '.join(bad)}" if bad else "",
            "numbers": f"{len(cases)} configs, 2 ranks ({'nccl' if dev == 'cuda' else 'gloo'})", "details": details}


def section_capture(a: dict) -> dict:
    """Graph capture (CUDA graphs on a GPU) against eager on the same device: AdamW at stages 1 and 3; SGD must
    be refused at initialize with a clear error, or capture and equal eager."""
    dev = a["device"]
    steps = a.get("steps", 6)
    details, bad, syncs = [], [], {}
    capture = {"graph_capture": {"enabled": True}}
    for stage in a.get("stages", [1, 3]):
        name = f"AdamW stage {stage} fp32"
        eager = train(dev, stage, "fp32", steps)
        counter = SyncCounter(dev == "cuda")
        try:
            with counter:
                captured = train(dev, stage, "fp32", steps, counter=counter, warm=3, **capture)
        except Exception as e:
            details.append(f"{name}: FAILED: {type(e).__name__}: {str(e)[:300]}")
            bad.append(name)
            continue
        ok, how = compare(captured, eager, TOL["same-device"])
        details.append(f"{name}: {'ok' if ok else 'DIFFERS'}: {how}")
        details.append("  " + sync_line(name, counter))
        syncs[name] = counter.per_step
        if not ok:
            bad.append(name)
    sgd = {"type": "SGD", "params": {"lr": 0.05, "momentum": 0.9}}
    eager = train(dev, 2, "fp32", steps, optimizer=sgd)
    from rayzero.config import ConfigError

    try:
        captured = train(dev, 2, "fp32", steps, optimizer=sgd, **capture)
    except ConfigError as e:  # refused at initialize: fine, if it says why
        sgd_how = f"refused at initialize: {str(e)[:160]}"
        sgd_ok = "sgd" in str(e).lower() or "capturable" in str(e).lower() or "optimizer" in str(e).lower()
    except Exception as e:  # a failure inside the captured step (e.g. .item() while capturing) is the bug
        sgd_ok, sgd_how = False, f"failed while training: {type(e).__name__}: {str(e)[:200]}"
    else:
        sgd_ok, sgd_how = compare(captured, eager, TOL["same-device"])
        sgd_how = "captured: " + sgd_how
    details.append(f"SGD stage 2 fp32: {'ok' if sgd_ok else 'FAILED'}: {sgd_how}")
    if not sgd_ok:
        bad.append("SGD")
    return {"status": "FAIL" if bad else "PASS", "reason": f"failed: {', '.join(bad)}" if bad else "",
            "numbers": f"tol {TOL['same-device']['weights']:g}; SGD {'refused' if 'refused' in sgd_how else 'captured'}",
            "details": details, "syncs": syncs}


def section_offload(a: dict) -> dict:
    """Stage 3 with the optimizer and the parameters offloaded to the CPU, pinned and unpinned, against the
    same run without offload on the device and the CPU run."""
    dev = a["device"]
    steps = a.get("steps", 4)
    details, bad, syncs = [], [], {}
    refs = {}
    for pin, dtype in ((True, "fp32"), (False, "fp32"), (True, "bf16")):
        if dtype not in refs:
            refs[dtype] = (train("cpu", 3, dtype, steps), train(dev, 3, dtype, steps))
        cpu_ref, dev_ref = refs[dtype]
        pinned = []

        def check(engine, pinned=pinned):
            # where the engine keeps its host copies: pinned memory only exists next to an accelerator
            for g in engine.partitions.groups:
                for t in (g.master, getattr(g, "weights", None)):  # optimizer state's masters, offloaded weights
                    if isinstance(t, torch.Tensor) and t.device.type == "cpu" and t.numel():
                        pinned.append(bool(t.is_pinned()))

        off = {"zero_optimization": {"offload_optimizer": {"device": "cpu", "pin_memory": pin},
                                     "offload_param": {"device": "cpu", "pin_memory": pin}}}
        name = f"stage 3 {dtype} offload {'pinned' if pin else 'unpinned'}"
        counter = SyncCounter(dev == "cuda")
        try:
            with counter:
                run = train(dev, 3, dtype, steps, counter=counter, check_engine=check, **off)
        except Exception as e:
            details.append(f"{name}: FAILED: {type(e).__name__}: {str(e)[:300]}")
            bad.append(name)
            continue
        ok1, how1 = compare(run, cpu_ref, TOL[dtype])
        ok2, how2 = compare(run, dev_ref, TOL[dtype])
        want_pinned = pin and dev == "cuda"
        ok3 = bool(pinned) and all(p == want_pinned for p in pinned)
        details.append(f"{name}: vs CPU {'ok' if ok1 else 'DIFFERS'} ({how1}); vs {dev} without offload "
                       f"{'ok' if ok2 else 'DIFFERS'} ({how2}); host copies pinned {pinned}"
                       + ("" if ok3 else f" (expected {want_pinned})"))
        details.append("  " + sync_line(name, counter))
        syncs[name] = counter.per_step
        if not (ok1 and ok2 and ok3):
            bad.append(name)
    return {"status": "FAIL" if bad else "PASS", "reason": f"failed: {', '.join(bad)}" if bad else "",
            "numbers": "fp32 pinned, fp32 unpinned, bf16 pinned" if dev != "cuda" else
                       "; ".join(f"{k.replace('stage 3 ', '')}: {_span(v)} syncs/step" for k, v in syncs.items()),
            "details": details, "syncs": syncs}


def _span(v: list[int]) -> str:
    return "-" if not v else str(v[0]) if min(v) == max(v) else f"{min(v)}-{max(v)}"


def section_moe(a: dict) -> dict:
    """rayzero.moe.MoE forward and backward on the device against the same layer on the CPU (dropless and
    with a capacity), and the host syncs of one forward+backward for 1 and 4 stacked layers."""
    from rayzero.moe import MoE

    dev = a["device"]
    details, bad = [], []
    for name, kw in (("dropless top-2 + shared + z-loss", dict(top_k=2, num_shared_experts=1, z_loss_coef=1e-3)),
                     ("capacity 1.25 top-1", dict(top_k=1, capacity_factor=1.25, normalize_topk=False))):
        torch.manual_seed(0)
        layer = MoE(64, 128, 8, **kw)
        x = torch.randn(4, 16, 64)
        outs = {}
        for where, mod in (("cpu", layer), (dev, copy.deepcopy(layer).to(dev))):
            xi = x.clone().to(where).requires_grad_(True)
            out = mod(xi)
            loss = out.float().square().mean() + mod.aux_loss
            loss.backward()
            outs[where] = [out.detach().cpu(), mod.aux_loss.detach().cpu().reshape(1), xi.grad.cpu()] + [
                p.grad.cpu() for p in mod.parameters()]
        err = max(float((d - c).abs().max()) / max(float(c.abs().max()), 1e-12) for d, c in zip(outs[dev], outs["cpu"]))
        ok = err <= 1e-4
        details.append(f"{name}: {'ok' if ok else 'DIFFERS'}: max rel error {err:.1e} (output, aux loss, grads)")
        if not ok:
            bad.append(name)
    syncs = {}
    for stage in a.get("engine_stages", [2, 3]):
        # a model of two MoE layers (tests/moe_cases.py) trained by the engine: device against CPU
        name = f"TinyMoELM stage {stage} fp32"
        runs = {}
        for where in ("cpu", dev):
            counter = SyncCounter(where == "cuda")
            with counter:
                runs[where] = _train_moe(where, stage, a.get("steps", 4), counter)
            if where == dev:
                syncs[name] = counter.per_step
                sync_text = sync_line(name, counter)
        ok, how = compare(runs[dev], runs["cpu"], TOL["fp32"])
        details.append(f"{name}: {'ok' if ok else 'DIFFERS'}: {how}")
        details.append("  " + sync_text)
        if not ok:
            bad.append(name)
    counts = {}
    for layers in (1, 4):
        torch.manual_seed(0)
        stack = torch.nn.Sequential(*[MoE(64, 128, 8, top_k=2) for _ in range(layers)]).to(dev)
        x = torch.randn(4, 16, 64, device=dev)
        stack(x).sum().backward()  # warm-up: allocator and kernels
        counter = SyncCounter(dev == "cuda")
        with counter:
            counter.reset()
            out = stack(x)
            (out.square().mean() + sum(m.aux_loss for m in stack)).backward()
            counter.mark()
        counts[layers] = counter
        details.append("  " + sync_line(f"{layers} MoE layer(s) forward+backward", counter))
    nums = "n/a (CPU)" if dev != "cuda" else f"syncs fwd+bwd: 1 layer {counts[1].summary()}, 4 layers {counts[4].summary()}"
    syncs.update({f"MoE x{k} fwd+bwd": c.per_step for k, c in counts.items()})
    return {"status": "FAIL" if bad else "PASS", "reason": f"differs from CPU: {', '.join(bad)}" if bad else "",
            "numbers": nums, "details": details, "syncs": syncs}


def _train_moe(acc: str, stage: int, steps: int, counter: SyncCounter, warm: int = 2) -> dict:
    import moe_cases

    import rayzero

    use_accelerator(acc)
    engine = rayzero.initialize(moe_cases.tiny_rayzero_moe(0), zero_config(stage, "fp32", 4, 2, lr=1e-3))
    try:
        device = next(iter(engine.module.parameters())).device
        ids = moe_cases.batches(steps, 1, 2, gas=2).to(device)  # (steps, gas, shards, micro, SEQ)
        losses = []
        for i in range(steps):
            counter.reset()
            step_loss = torch.zeros((), device=device)
            for k in range(2):
                x = ids[i, k, 0]
                loss = engine(x, labels=x.roll(-1, dims=1)).loss
                engine.backward(loss)
                engine.step()
                step_loss = step_loss + loss.detach() / 2
            if i >= warm:
                counter.mark()
            losses.append(step_loss)
        state = {k: v.detach().float().cpu() for k, v in engine.full_state_dict().items()}
        return {"losses": [float(v) for v in losses], "state": state}
    finally:
        engine.destroy()


def section_fit(a: dict) -> dict:
    """rayzero.fit with use_gpu=True: one worker on a one-GPU local Ray node (the worker's batches must reach
    the device). In the dry run: use_gpu=False."""
    try:
        import ray  # noqa: F401
    except ImportError as e:
        return {"status": "SKIP", "reason": f"ray is not importable ({e}): fit on a GPU not covered "
                "(ray's wheel is larger than a carry allows: bench/README.md)"}
    import rayzero
    from examples.train import ByteWindows, TinyGPT, lm_loss

    dev = a["device"]
    steps = a.get("steps", 6)
    os.environ.pop("RAYZERO_ACCELERATOR", None)  # the workers pick cuda themselves where they see a GPU
    with open(TEXT, "rb") as f:
        data = ByteWindows(f.read()[:20000], 32)
    with tempfile.TemporaryDirectory() as storage:
        cluster = rayzero.ClusterConfig(workers=1, use_gpu=dev == "cuda", storage=storage, name="gpu-check",
                                        checkpoint_every=0, max_failures=0, progress=False,
                                        resources_per_worker={"CPU": 1})
        config = zero_config(2, "bf16" if dev == "cuda" else "fp32", 8, 1)
        start = time.perf_counter()
        result = rayzero.fit(lambda: TinyGPT(context=32), cluster, config=config, data=data, loss_fn=lm_loss,
                             max_steps=steps, seed=0)
        took = time.perf_counter() - start
    losses = result.losses
    ok = len(losses) == steps and all(math.isfinite(v) for v in losses)
    return {"status": "PASS" if ok else "FAIL",
            "reason": "" if ok else f"expected {steps} finite losses, got {losses}",
            "numbers": f"{len(losses)} steps, loss {losses[0]:.3f} -> {losses[-1]:.3f}, {took:.0f} s"
                       + ("" if dev == "cuda" else " (use_gpu=False)"),
            "details": [f"losses {losses}", f"world sizes {result.world_sizes}"]}


# ---- throughput -----------------------------------------------------------------------------------------

def _timed(step, batches, warmup: int, dev: str) -> float:
    """Seconds per step, median over the timed steps (each step waits for the device)."""
    sync = torch.cuda.synchronize if dev == "cuda" else (lambda: None)
    times = []
    for i, (x, y) in enumerate(batches):
        sync()
        start = time.perf_counter()
        step(x, y)
        sync()
        if i >= warmup:
            times.append(time.perf_counter() - start)
    times.sort()
    return times[len(times) // 2]


def _lm(logits, y):
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), y.reshape(-1))


def section_throughput(a: dict) -> dict:
    """Tokens/s of one rank on the same GPU and model (bf16 compute, fp32 master weights, torch's fused
    AdamW for every system, clipping 1.0): plain torch with autocast, rayzero stages 0-3, FSDP2 (fully_shard
    per block and on the root, world 1 on NCCL) and DeepSpeed stages 1-3 where importable."""
    import torch.distributed as dist

    import rayzero

    dev = a["device"]
    dim, layers, heads, context, micro = a["dim"], a["layers"], a["heads"], a["context"], a["micro"]
    steps, warmup = a["steps"], a["warmup"]
    lr, clip = 1e-4, 1.0
    adamw = {"lr": lr, "weight_decay": 0.01, "fused": True}
    use_accelerator(dev)
    batches = [(x.to(dev), y.to(dev)) for x, y in lm_batches(steps + warmup, micro, context, seed=3)]
    model_fn = lambda: make_gpt(0, dim, layers, heads, context)
    rows, details = {}, []
    n_params = sum(p.numel() for p in model_fn().parameters())

    started = time.perf_counter()

    def record(name, fn):
        if time.perf_counter() - started > 0.75 * a.get("limit", 150):
            rows[name] = None
            details.append(f"{name}: not run: the section's time limit is near")
            return
        try:
            secs = fn()
            rows[name] = micro * context / secs
            details.append(f"{name}: {1000 * secs:.2f} ms/step, {rows[name]:,.0f} tokens/s")
        except Exception as e:
            rows[name] = None
            details.append(f"{name}: FAILED {type(e).__name__}: {str(e)[:300]}")
        finally:
            if dev == "cuda":
                torch.cuda.empty_cache()
            # the rows so far survive a later row that hangs (a DeepSpeed kernel build, say)
            save_partial({"status": "FAIL", "reason": "", "details": details,
                          "numbers": ", ".join(f"{k} {v:,.0f}" for k, v in rows.items() if v)})

    def plain():
        model = model_fn().to(dev)
        opt = torch.optim.AdamW(model.parameters(), **adamw)

        def step(x, y):
            with torch.autocast(dev, dtype=torch.bfloat16):
                loss = _lm(model(x), y)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
            opt.step()
            opt.zero_grad(set_to_none=True)

        return _timed(step, batches, warmup, dev)

    record("torch, autocast bf16 (no ZeRO)", plain)

    for stage in range(4):
        def zero(stage=stage):
            cfg = zero_config(stage, "bf16", micro, 1, clip=clip,
                              optimizer={"type": "AdamW", "params": adamw})
            cfg["zero_optimization"] = {"stage": stage}  # rayzero's own bucket sizes
            engine = rayzero.initialize(model_fn(), cfg)

            def step(x, y):
                engine.backward(_lm(engine(x), y))
                engine.step()

            try:
                return _timed(step, batches, warmup, dev)
            finally:
                engine.destroy()

        record(f"rayzero stage {stage}", zero)

    # FSDP2 and DeepSpeed need a process group: world 1 (nccl on the GPU, gloo in the dry run)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()), RANK="0", WORLD_SIZE="1",
                      LOCAL_RANK="0", LOCAL_SIZE="1")
    dist.init_process_group("nccl" if dev == "cuda" else "gloo", rank=0, world_size=1)
    try:
        def fsdp2():
            from torch.distributed.device_mesh import init_device_mesh
            from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

            model = model_fn().to(dev)
            mesh = init_device_mesh(dev, (1,))
            mp_policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
            for block in model.blocks:
                fully_shard(block, mesh=mesh, mp_policy=mp_policy)
            fully_shard(model, mesh=mesh, mp_policy=mp_policy)
            opt = torch.optim.AdamW(model.parameters(), **adamw)

            def step(x, y):
                _lm(model(x), y).backward()
                torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
                opt.step()
                opt.zero_grad(set_to_none=True)

            return _timed(step, batches, warmup, dev)

        record("FSDP2 (fully_shard, bf16 params)", fsdp2)
        try:
            import deepspeed
        except Exception as e:
            deepspeed = None
            rows["DeepSpeed"] = None
            details.append(f"DeepSpeed: not importable ({type(e).__name__}: {str(e)[:120]})")
        if deepspeed is not None:
            deepspeed.init_distributed(dist_backend="nccl" if dev == "cuda" else "gloo")
            for stage in (1, 2, 3):
                def ds(stage=stage):
                    cfg = {"train_batch_size": micro, "train_micro_batch_size_per_gpu": micro,
                           "gradient_clipping": clip, "bf16": {"enabled": True},
                           "zero_optimization": {"stage": stage},
                           # torch's fused AdamW, as every other row (no JIT-built kernel)
                           "optimizer": {"type": "AdamW", "params": {"lr": lr, "weight_decay": 0.01,
                                                                     "torch_adam": True, "fused": True}}}
                    model = model_fn()
                    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)

                    def step(x, y):
                        engine.backward(_lm(engine(x), y))
                        engine.step()

                    try:
                        return _timed(step, batches, warmup, dev)
                    finally:
                        getattr(engine, "destroy", lambda: None)()

                record(f"DeepSpeed stage {stage}", ds)
    finally:
        dist.destroy_process_group()
    failed = [k for k, v in rows.items() if v is None and k != "DeepSpeed"]
    base = rows.get("torch, autocast bf16 (no ZeRO)")
    table = ["| system | tokens/s | x torch |", "|---|---:|---:|"]
    for k, v in rows.items():
        table.append(f"| {k} | {'-' if v is None else f'{v:,.0f}'} | "
                     f"{'-' if v is None or not base else f'{v / base:.2f}'} |")
    fsdp, z3 = rows.get("FSDP2 (fully_shard, bf16 params)"), rows.get("rayzero stage 3")
    return {
        "status": "FAIL" if failed else "PASS",
        "reason": f"failed: {', '.join(failed)}" if failed else "",
        "numbers": (f"{n_params / 1e6:.1f}M params, {micro}x{context} tokens/step; stage 3 {z3 or 0:,.0f} vs FSDP2 "
                    f"{fsdp or 0:,.0f} tokens/s" + ("" if rows.get("DeepSpeed", 0) is not None else "; no DeepSpeed")),
        "details": details, "table": table,
    }


_RESULT_PATH: str | None = None


def save_partial(result: dict) -> None:
    """What a section has so far, for the driver to show if the section is killed at its limit."""
    if _RESULT_PATH:
        with open(_RESULT_PATH + ".partial", "w") as f:
            json.dump(result, f)


SECTIONS = {
    "train-parity": section_train_parity,
    "train-parity-world2": section_train_parity_world2,
    "capture": section_capture,
    "offload": section_offload,
    "moe": section_moe,
    "fit": section_fit,
    "throughput": section_throughput,
}


def main() -> None:
    global _RESULT_PATH
    name, args_json, out = sys.argv[1], sys.argv[2], sys.argv[3]
    _RESULT_PATH = out
    args = json.loads(args_json)
    if args["device"] == "cpu":
        torch.set_num_threads(max(1, args.get("threads", 1)))
    import faulthandler

    # a hang prints every thread's stack before the driver kills the process at its limit
    faulthandler.dump_traceback_later(max(args.get("limit", 120) - 5, 5), exit=False)
    start = time.perf_counter()
    try:
        result = SECTIONS[name](args)
    except Exception as e:
        result = {"status": "FAIL", "reason": f"{type(e).__name__}: {str(e)[:300]}",
                  "details": traceback.format_exc().splitlines()[-25:]}
    result["seconds"] = round(time.perf_counter() - start, 1)
    with open(out, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
