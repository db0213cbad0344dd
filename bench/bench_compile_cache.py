"""Time to the first captured step with a cold and a warm compile cache (graph_capture.cache_dir).

Each run is a fresh process; a capture run's inductor cache is the one rayzero keeps in cache_dir (empty
for the cold run), so the only thing a warm run can reuse is what rayzero's compile cache hands it
(``BENCH_ARTIFACTS_ONLY=1``: every run gets a fresh inductor cache of its own instead, and the warm run
has only the torch.compiler artifacts).  Rows:

* eager: no capture (the floor: set-up plus two steps);
* cold: capture of the step and the model, an empty cache_dir (compiles everything, rank 0 writes it);
* warm: the same, with the cache_dir the cold run wrote (loads it before anything compiles);
* new node: the same on a node that has never compiled: its compile cache owner (the ``NodeCompileCache``
  actor's logic, rayzero/train/compile_actor.py) fetched what the cold node's owner uploaded to the run's
  storage (the artifacts and the kernel archive), as on a node the autoscaler just added.

The clock runs from before ``rayzero.initialize`` to the end of step 2 (step 1 is the eager warm-up step;
step 2 records and replays the step's graphs; the model compiles in step 1).  World size 1.

    python bench/bench_compile_cache.py [--repeat 2] [--hidden 4096]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def child(mode: str, cache_dir: str, hidden: int) -> None:
    import torch

    sys.path.insert(0, ROOT)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ.get("BENCH_PORT", "29591"))
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    import rayzero
    from bench.bench_zero import build_model

    model = build_model(1024, hidden, 4)
    cfg = {"train_batch_size": 8, "zero_optimization": {"stage": 2},
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}}, "gradient_clipping": 1.0}
    if mode != "eager":
        cfg["graph_capture"] = {"enabled": True, "targets": ["model"], "cache_dir": cache_dir}
    g = torch.Generator().manual_seed(0)
    batches = [(torch.randn(8, 1024, generator=g), torch.randn(8, 1024, generator=g)) for _ in range(2)]
    start = time.perf_counter()
    engine = rayzero.initialize(model, cfg)
    for x, y in batches:
        engine.backward(torch.nn.functional.mse_loss(engine(x), y))
        engine.step()
    seconds = time.perf_counter() - start
    if os.environ.get("BENCH_COMPILE_TIMES"):
        from torch._dynamo.utils import compile_times, counters

        print(compile_times(repr="str", aggregate=True), file=sys.stderr)
        print(dict(counters["inductor"]), file=sys.stderr)
    cache = engine._capture.cache if engine._capture is not None else None
    print(json.dumps({"seconds": seconds, "loaded": cache.loaded if cache else 0,
                      "load_s": cache.load_seconds if cache else 0.0, "saved": cache.saved_bytes if cache else 0}))
    engine.destroy()


def run(mode: str, cache_dir: str, hidden: int, scratch: str) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    if mode == "eager" or os.environ.get("BENCH_ARTIFACTS_ONLY"):
        env["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(dir=scratch)  # a fresh inductor cache of its own
    else:  # rayzero puts inductor's cache in cache_dir: the cold run's is empty, the warm run reuses it
        env.pop("TORCHINDUCTOR_CACHE_DIR", None)
    out = subprocess.run([sys.executable, __file__, "--child", mode, "--cache-dir", cache_dir, "--hidden", str(hidden)],
                         env=env, capture_output=True, text=True, check=False)
    if out.returncode:
        raise RuntimeError(f"{mode} run failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repeat", type=int, default=2, help="cold/warm pairs (each row: median)")
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--child", help=argparse.SUPPRESS)
    p.add_argument("--cache-dir", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.child:
        child(a.child, a.cache_dir, a.hidden)
        return
    sys.path.insert(0, ROOT)
    from rayzero.train.compile_actor import CompileCacheOwner

    rows: dict[str, list[dict]] = {"eager": [], "cold": [], "warm": [], "new node": []}
    with tempfile.TemporaryDirectory() as scratch:
        for i in range(a.repeat):
            run_cache = os.path.join(scratch, f"run{i}", "compile_cache")  # the run's storage
            first = CompileCacheOwner(run_cache, "bench", root=os.path.join(scratch, f"node-a{i}"), sync_interval_s=0)
            cache_dir = first.lease("cpu")
            rows["eager"].append(run("eager", cache_dir, a.hidden, scratch))
            rows["cold"].append(run("cold", cache_dir, a.hidden, scratch))
            rows["warm"].append(run("warm", cache_dir, a.hidden, scratch))
            t = time.perf_counter()
            uploaded = first.sync()
            upload_s = time.perf_counter() - t
            second = CompileCacheOwner(run_cache, "bench", root=os.path.join(scratch, f"node-b{i}"), sync_interval_s=0)
            t = time.perf_counter()
            node_dir = second.lease("cpu")
            fetch_s = time.perf_counter() - t
            row = run("warm", node_dir, a.hidden, scratch)
            row.update(uploaded=uploaded, upload_s=upload_s, fetch_s=fetch_s, seconds_with_fetch=row["seconds"] + fetch_s)
            rows["new node"].append(row)
            print(f"[bench] pair {i + 1}: " + ", ".join(f"{k} {v[-1]['seconds']:.1f} s" for k, v in rows.items()),
                  flush=True)
    med = {k: statistics.median(r.get("seconds_with_fetch", r["seconds"]) for r in v) for k, v in rows.items()}
    print(f"\nTime to the end of step 2 (s, median of {a.repeat}; hidden {a.hidden}, stage 2, world 1):\n")
    print("| run | seconds | x eager | cache |")
    print("|---|---:|---:|---|")
    for k, v in rows.items():
        last = v[-1]
        if k == "eager":
            note = "no capture"
        elif k == "cold":
            note = f"wrote {last['saved']:,} bytes"
        elif k == "warm":
            note = f"loaded {last['loaded']} artifacts in {last['load_s']:.2f} s"
        else:
            note = (f"fetched {last['uploaded']:,} bytes in {last['fetch_s']:.2f} s (counted), "
                    f"loaded {last['loaded']} artifacts")
        print(f"| {k} | {med[k]:.1f} | {med[k] / med['eager']:.2f} | {note} |")
    print(f"\nwarm / cold: {med['warm'] / med['cold']:.2f}; new node / cold: {med['new node'] / med['cold']:.2f}")


if __name__ == "__main__":
    main()
