"""The MoE example's model (examples/train_moe.py) on 2 CPU ranks: rayzero at EP=1 and EP=2, torch DDP, and
DeepSpeed AutoEP when it is installed, on the same global batches.

    python bench/bench_moe.py                   # 3 rounds, ~2 minutes on 2 cores
    python bench/bench_moe.py --quick           # 1 round of 1 warm-up + 3 timed steps: every code path (~30 s)
    python bench/bench_moe.py --json out.json   # also write every number as JSON

Every system runs in its own fresh spawn of 2 processes (gloo on 127.0.0.1, one torch thread per rank).  Each
rank builds the same tiny Qwen3-MoE from the same seed; each step takes the same global batch of byte windows
of the shipped text (rayzero's seeded global order), cut over the data-parallel ranks, and runs forward
(``out.loss``: next-byte cross-entropy + the router's load-balancing loss), backward, gradient clipping at 1.0
and AdamW.  For the rayzero rows, every ``torch.distributed.all_to_all_single`` call (which is what
``rayzero.moe.dispatch`` uses for the expert counts and for the tokens, forward and backward) is timed by
wrapping the function from this script.  See bench/README.md.
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import statistics
import sys
import time
import traceback

import torch

from bench_zero import _provenance_line, _short_error, cpu_busy_s, deepspeed_available, hwm_mib, reset_hwm, \
    source_provenance
from spawn_ranks import free_port, spawn

HERE = os.path.dirname(os.path.abspath(__file__))
EXAMPLES = os.path.join(os.path.dirname(HERE), "examples")
if EXAMPLES not in sys.path:
    sys.path.insert(0, EXAMPLES)

import train_moe  # noqa: E402  (the example's model and data)

# ---------------------------------------------------------------------------------------------------------
# Timing all_to_all_single (installed in each rank process)
# ---------------------------------------------------------------------------------------------------------

A2A = {"s": 0.0, "calls": 0, "bytes": 0}


def _install_a2a_timer() -> None:
    import torch.distributed as dist

    inner = dist.all_to_all_single

    def timed(output, input, *args, **kwargs):
        t0 = time.perf_counter()
        try:
            return inner(output, input, *args, **kwargs)
        finally:
            A2A["s"] += time.perf_counter() - t0
            A2A["calls"] += 1
            A2A["bytes"] += input.numel() * input.element_size()

    dist.all_to_all_single = timed  # rayzero.moe.dispatch looks it up as dist.all_to_all_single at call time


# ---------------------------------------------------------------------------------------------------------
# Systems: each returns (step(batch) -> loss, dp_rank, dp_size, params held by this rank)
# ---------------------------------------------------------------------------------------------------------


def engine_config(a, ep: int, world: int) -> dict:
    dp = world
    return {
        "train_batch_size": a.global_batch,
        "train_micro_batch_size_per_gpu": a.global_batch // dp,
        "zero_optimization": {"stage": a.stage},
        "optimizer": {"type": "AdamW", "params": {"lr": a.lr, "fused": True}},
        "gradient_clipping": a.clip,
        "expert_parallel": {"enabled": True, "autoep_size": ep, "preset_model": "qwen3_moe"},
        "steps_per_print": 0,
    }


def _held(module) -> int:
    return sum(p.numel() for p in dict.fromkeys(module.parameters()))


def setup_ddp(model, a, rank, world):
    from torch.nn.parallel import DistributedDataParallel as DDP

    ddp = DDP(model)
    opt = torch.optim.AdamW(ddp.parameters(), lr=a.lr, fused=True)

    def step(batch):
        loss = ddp(**batch).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(ddp.parameters(), a.clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()

    return step, rank, world, _held(model)


def setup_rayzero(model, a, rank, world, ep):
    import rayzero

    engine = rayzero.initialize(model, engine_config(a, ep, world))

    def step(batch):
        loss = engine(**batch).loss
        engine.backward(loss)
        engine.step()
        return loss.detach()

    return step, engine.dp_rank, engine.dp_world_size, _held(engine.module)


def setup_deepspeed_autoep(model, a, rank, world, ep):
    from bench_zero import init_deepspeed  # CPU accelerator, LOCAL_RANK, torch's gloo group

    deepspeed = init_deepspeed()
    cfg = engine_config(a, ep, world)
    cfg["optimizer"]["params"]["torch_adam"] = True  # the others' torch.optim.AdamW(fused=True), not FusedAdam
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)

    def step(batch):
        loss = engine(**batch).loss
        engine.backward(loss)
        engine.step()
        return loss.detach()

    return step, rank, world, _held(engine.module)


def system_specs() -> list[dict]:
    return [
        dict(name="torch DDP", kind="ddp", ep=1),
        dict(name="rayzero EP=1", kind="rayzero", ep=1),
        dict(name="rayzero EP=2", kind="rayzero", ep=2),
        dict(name="DeepSpeed AutoEP EP=2", kind="deepspeed", ep=2),
    ]


# ---------------------------------------------------------------------------------------------------------
# One rank of one system
# ---------------------------------------------------------------------------------------------------------


def _rank_main(rank: int, world: int, port: int, spec: dict, a: argparse.Namespace, queue) -> None:
    import torch.distributed as dist

    from rayzero.train.data import GlobalOrder, micro_batches

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    try:
        out: dict = {"rank": rank}
        reset_hwm()
        dist.init_process_group("gloo", rank=rank, world_size=world)
        _install_a2a_timer()
        torch.manual_seed(0)
        model = train_moe.build_model(a.context)
        if spec["kind"] == "ddp":
            step, dp_rank, dp, held = setup_ddp(model, a, rank, world)
        elif spec["kind"] == "rayzero":
            step, dp_rank, dp, held = setup_rayzero(model, a, rank, world, spec["ep"])
        else:
            step, dp_rank, dp, held = setup_deepspeed_autoep(model, a, rank, world, spec["ep"])
        out["params_held"] = held
        text = open(train_moe.shipped.TEXT, "rb").read()
        data = train_moe.LMWindows(text[: int(len(text) * 0.9)], a.context)
        order = GlobalOrder(len(data), seed=0)
        micro = a.global_batch // dp
        losses, times, a2a_s, a2a_calls, a2a_bytes = [], [], [], [], []
        for i in range(a.warmup + a.steps):
            if i == a.warmup:
                dist.barrier()
                timed_t0, busy0, own0 = time.perf_counter(), cpu_busy_s(), time.process_time()
            (ids,) = micro_batches(order, i, a.global_batch, dp, dp_rank, micro)
            batch = torch.utils.data.default_collate([data[j] for j in ids])
            A2A.update(s=0.0, calls=0, bytes=0)
            t0 = time.perf_counter()
            loss = step(batch)
            dt = time.perf_counter() - t0
            losses.append(float(loss))
            if i >= a.warmup:
                times.append(dt)
                a2a_s.append(A2A["s"])
                a2a_calls.append(A2A["calls"])
                a2a_bytes.append(A2A["bytes"])
        out["timed_wall_s"] = time.perf_counter() - timed_t0
        out["timed_machine_busy_s"] = cpu_busy_s() - busy0
        out["timed_own_cpu_s"] = time.process_time() - own0
        out["peak_rss_mib"] = hwm_mib()
        out["step_s"] = times
        out["median_step_ms"] = statistics.median(times) * 1000
        out["median_a2a_ms"] = statistics.median(a2a_s) * 1000
        out["a2a_calls_per_step"] = statistics.median(a2a_calls)
        out["a2a_kib_per_step"] = statistics.median(a2a_bytes) / 1024
        t = torch.tensor(losses, dtype=torch.float64)
        dist.all_reduce(t)
        out["losses"] = (t / world).tolist()
        queue.put((rank, "ok", pickle.dumps(out)))
    except BaseException:
        queue.put((rank, "error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_system(spec: dict, a: argparse.Namespace) -> dict:
    res = dict(spec)
    if spec["kind"] == "deepspeed":
        ok, why = deepspeed_available()
        if not ok:
            res.update(status="skipped", error=why)
            return res
    port = free_port()
    ranks, error = spawn(_rank_main, lambda r: (r, a.world, port, spec, a), a.world, a.timeout)
    if error is not None:
        res.update(status="error", error=error)
        return res
    slow = max(ranks, key=lambda r: r["median_step_ms"])  # the slowest rank sets the pace
    res.update(
        status="ok",
        ranks=ranks,
        median_step_ms=slow["median_step_ms"],
        tokens_per_s=a.global_batch * (a.context + 1) / (slow["median_step_ms"] / 1000),
        a2a_ms=max(r["median_a2a_ms"] for r in ranks),
        a2a_calls=ranks[0]["a2a_calls_per_step"],
        a2a_kib=max(r["a2a_kib_per_step"] for r in ranks),
        peak_rss_mib=max(r["peak_rss_mib"] for r in ranks),
        params_held=[r["params_held"] for r in ranks],
        foreign_cores=max(0.0, (ranks[0]["timed_machine_busy_s"] - sum(r["timed_own_cpu_s"] for r in ranks))
                          / ranks[0]["timed_wall_s"]) if ranks[0]["timed_wall_s"] >= 1.0 else None,
        losses=ranks[0]["losses"],
    )
    return res


def combine_rounds(rounds: list[dict]) -> dict:
    """One row per system: the median over rounds of each round's figures (and the step-time range)."""
    ok = [r for r in rounds if r["status"] == "ok"]
    if len(ok) != len(rounds) or not ok:
        return rounds[-1]
    out = dict(ok[0], rounds=ok)
    for key in ("median_step_ms", "tokens_per_s", "a2a_ms", "a2a_kib", "peak_rss_mib"):
        out[key] = statistics.median(r[key] for r in ok)
    out["step_ms_range"] = (min(r["median_step_ms"] for r in ok), max(r["median_step_ms"] for r in ok))
    loads = [r["foreign_cores"] for r in ok if r["foreign_cores"] is not None]
    out["foreign_cores"] = max(loads) if loads else None
    return out


# ---------------------------------------------------------------------------------------------------------
# Report
# ---------------------------------------------------------------------------------------------------------


def render(results: list[dict], meta: dict) -> str:
    ddp = next((r for r in results if r["kind"] == "ddp" and r["status"] == "ok"), None)
    lines = [
        f"Workload: examples/train_moe.py's Qwen3-MoE ({meta['params']:,} params: hidden 64, 2 layers, "
        f"{meta['experts']} experts top-2, vocab 256), ZeRO stage {meta['stage']} for rayzero, fp32, "
        f"AdamW(lr {meta['lr']}, fused) and clip {meta['clip']} everywhere, global batch {meta['global_batch']} "
        f"x {meta['context'] + 1} tokens over {meta['world']} ranks (gloo, 1 thread/rank), {meta['warmup']} "
        f"warm-up + {meta['steps']} timed steps per round, {meta['rounds']} rounds.",
        _provenance_line(meta.get("provenance", {})),
        "",
        "| system | step ms | tokens/s | x DDP | all-to-all ms/step | all-to-all share "
        "| all-to-all calls, KiB sent /step | params held per rank | peak RSS MiB | other load |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in results:
        if r["status"] != "ok":
            lines.append(f"| {r['name']} | {r['status']}: {_short_error(r['error'])} | | | | | | | | |")
            continue
        ms = r["median_step_ms"]
        lo, hi = r.get("step_ms_range", (ms, ms))
        xd = f"{ms / ddp['median_step_ms']:.2f}" if ddp else "n/a"
        a2a = "-" if not r["a2a_calls"] else f"{r['a2a_ms']:.1f}"
        share = "-" if not r["a2a_calls"] else f"{100 * r['a2a_ms'] / ms:.0f}%"
        calls = "-" if not r["a2a_calls"] else f"{r['a2a_calls']:.0f}, {r['a2a_kib']:.0f}"
        held = " / ".join(f"{h:,}" for h in sorted(set(r["params_held"])))
        other = "-" if r["foreign_cores"] is None else f"{r['foreign_cores']:.2f}"
        lines.append(
            f"| {r['name']} | {ms:.1f} ({lo:.1f}-{hi:.1f}) | {r['tokens_per_s']:,.0f} | {xd} | {a2a} | {share} | "
            f"{calls} | {held} | {r['peak_rss_mib']:.0f} | {other} |"
        )
    lines += [
        "",
        f"step ms: median over the timed steps, slowest rank; the median of {meta['rounds']} rounds in which the "
        "systems take turns (range over rounds in brackets); the other columns are medians over rounds too, "
        "other load the largest. tokens/s: global batch x tokens per window / step time. all-to-all: time inside "
        "torch.distributed.all_to_all_single per step (median over steps, largest rank), which "
        "rayzero.moe.dispatch calls for the expert counts and the tokens, forward and backward; on gloo the "
        "call blocks, so it includes waiting for the slower rank. params held per rank: "
        "the model's parameters on one rank (EP=2 keeps half of the experts). other load: cores kept busy by "
        "processes outside the bench during the timed steps.",
        "",
        "Cross-check (loss of the global batch; every system trains on the same samples from the same weights):",
        "",
        "| system | loss step 1 | loss last |",
        "|---|---:|---:|",
    ]
    for r in results:
        if r["status"] == "ok":
            lines.append(f"| {r['name']} | {r['losses'][0]:.6f} | {r['losses'][-1]:.6f} |")
    return "\n".join(lines)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=None, help="timed steps per system (default 50; --quick: 3)")
    p.add_argument("--warmup", type=int, default=None, help="warm-up steps per system (default 3; --quick: 1)")
    p.add_argument("--quick", action="store_true", help="1 warm-up + 3 timed steps, 1 round: a smoke test")
    p.add_argument("--rounds", type=int, default=None, help="rounds of all systems (default 3; --quick: 1)")
    p.add_argument("--global-batch", type=int, default=32, help="samples per step, all ranks together")
    p.add_argument("--context", type=int, default=64)
    p.add_argument("--stage", type=int, default=2, choices=[0, 1, 2], help="rayzero ZeRO stage")
    p.add_argument("--only", default=None, help="comma-separated substrings: run only systems whose name matches")
    p.add_argument("--json", default=None, help="also write the results as JSON to this path")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds per system before it is reported as hung")
    a = p.parse_args(argv)
    a.steps = a.steps if a.steps is not None else (3 if a.quick else 50)
    a.warmup = a.warmup if a.warmup is not None else (1 if a.quick else 3)
    a.rounds = a.rounds if a.rounds is not None else (1 if a.quick else 3)
    if a.steps < 1 or a.warmup < 0 or a.rounds < 1:
        p.error("--steps and --rounds must be >= 1 and --warmup >= 0")
    a.world, a.lr, a.clip = 2, 1e-3, 1.0
    if a.global_batch % a.world:
        p.error(f"--global-batch must be a multiple of {a.world}")
    return a


def main(argv=None) -> int:
    a = parse_args(argv)
    model = train_moe.build_model(a.context)
    meta = dict(
        params=sum(p.numel() for p in model.parameters()), experts=train_moe.NUM_EXPERTS, stage=a.stage, lr=a.lr,
        clip=a.clip, global_batch=a.global_batch, context=a.context, world=a.world, warmup=a.warmup,
        steps=a.steps, rounds=a.rounds, torch=torch.__version__, cpus=os.cpu_count(),
        command=" ".join([os.path.basename(sys.executable), *sys.argv]),
    )
    meta["provenance"] = source_provenance()
    specs = system_specs()
    if a.only:
        keys = [k.strip().lower() for k in a.only.split(",") if k.strip()]
        specs = [s for s in specs if any(k in s["name"].lower() for k in keys)]
    runs: dict[str, list[dict]] = {s["name"]: [] for s in specs}
    for round_ in range(a.rounds):  # the systems take turns, so load from other processes falls on all of them
        for spec in specs:
            if runs[spec["name"]] and runs[spec["name"]][-1]["status"] != "ok":
                continue  # skipped or failed: once is enough
            print(f"[bench] round {round_ + 1}/{a.rounds}: {spec['name']} ...", file=sys.stderr, flush=True)
            r = run_system(spec, a)
            msg = (f"{r['median_step_ms']:.1f} ms/step" if r["status"] == "ok"
                   else f"{r['status']}: {_short_error(r['error'])}")
            print(f"[bench]   {msg}", file=sys.stderr, flush=True)
            if r["status"] == "error":
                print(r["error"], file=sys.stderr, flush=True)
            runs[spec["name"]].append(r)
    results = [combine_rounds(runs[s["name"]]) for s in specs]
    after = source_provenance().get("rayzero_sources_sha256")
    meta["provenance"]["rayzero_sources_sha256_after"] = after
    meta["provenance"]["sources_changed_during_run"] = after != meta["provenance"].get("rayzero_sources_sha256")
    busy = [r["name"] for r in results if r["status"] == "ok" and (r["foreign_cores"] or 0.0) > 0.25]
    if busy:
        print(f"[bench] WARNING: other processes used CPU during: {', '.join(busy)}; their step times are "
              "inflated. Re-run on an idle machine.", file=sys.stderr, flush=True)
    print(render(results, meta))
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"meta": meta, "results": results}, f, indent=1, default=str)
        print(f"\nJSON written to {a.json}")
    return 0 if all(r["status"] in ("ok", "skipped") for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
