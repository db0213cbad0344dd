"""One check of rayzero on a lent GPU (issue 26): run through bench/gpu_check.sh, see bench/README.md.

Each section runs in a fresh process (bench/gpu_cases.py, or pytest) under its own time limit and inside
one overall budget, so a hang costs one section, not the run. The result is one markdown table (printed,
and written to $OUT/gpu_check.md with every detail in $OUT/gpu_check.json); the exit code is 1 when any
section FAILs.

    bench/gpu_check.sh                 # on the GPU machine (about 3-5 minutes on one H100)
    bench/gpu_check.sh --cpu-smoke     # the same sections on the CPU, CUDA-only parts skipped: proves the script
    bench/gpu_check.sh --only train-parity,moe
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
OPTIONAL = ("ray", "deepspeed", "pytest", "pyarrow", "numpy", "transformers", "triton")
CUDA_TEST_FILES = re.compile(r"torch\.cuda\.is_available\(\)|requires_cuda|skipif\(.*(cuda|gpu)", re.IGNORECASE)
# a collection error that only says an optional package is missing on this machine (not a rayzero bug)
MISSING_OPTIONAL = re.compile(r"No module named '(ray|deepspeed|transformers)")

# name, time limit (s), arguments on a GPU, arguments in the dry run
GPU_SIZES = dict(dim=768, layers=8, heads=12, context=512, micro=16, steps=30, warmup=10)
SMOKE_SIZES = dict(dim=32, layers=1, heads=2, context=16, micro=2, steps=2, warmup=1)
SECTIONS = [
    ("train-parity", 150, {}, {"steps": 3, "stages": [0, 1, 2, 3], "dtypes": ["fp32", "bf16"]}),
    ("capture", 120, {}, {"steps": 4, "stages": [1]}),  # the dry run captures with inductor
    ("offload", 120, {}, {"steps": 3}),
    ("moe", 60, {}, {}),
    ("throughput", 150, GPU_SIZES, SMOKE_SIZES),
    ("train-parity-world2", 120, {}, {"steps": 2, "stages": [0, 3], "dtypes": ["fp32"]}),
    ("fit", 180, {}, {"steps": 3}),
]


def environment() -> dict:
    import torch

    info = {"python": sys.version.split()[0], "torch": torch.__version__, "cuda": torch.version.cuda,
            "gpus": [], "packages": {}}
    if torch.cuda.is_available():
        info["gpus"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
        info["capability"] = ".".join(map(str, torch.cuda.get_device_capability(0)))
        free, total = torch.cuda.mem_get_info(0)
        info["gpu_memory_gib"] = round(total / 2**30, 1)
        try:
            import torch.cuda.nccl

            info["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
        except Exception as e:  # informative only
            info["nccl"] = f"unknown ({type(e).__name__})"
    for name in OPTIONAL:
        try:
            info["packages"][name] = importlib.metadata.version(name) if importlib.util.find_spec(name) else None
        except importlib.metadata.PackageNotFoundError:
            info["packages"][name] = "present (no metadata)"
    try:
        smi = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20)
        info["nvidia_smi"] = smi.stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        info["nvidia_smi"] = None
    return info


def run_child(cmd: list[str], limit: float, env: dict) -> tuple[int | None, str]:
    """Run ``cmd`` in its own process group; on the time limit kill the whole group (spawned ranks, Ray's
    processes) and return None as the exit code."""
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=limit)
        return proc.returncode, out
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        return None, out


def child_env(extra_path: str = "") -> dict:
    env = dict(os.environ)
    parts = [ROOT, os.path.join(ROOT, "tests"), HERE] + ([extra_path] if extra_path else [])
    env["PYTHONPATH"] = os.pathsep.join(parts + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    env["PYTHONUNBUFFERED"] = "1"
    return env


def cuda_tests(limit: float, smoke: bool) -> dict:
    files = []
    for name in sorted(os.listdir(os.path.join(ROOT, "tests"))):
        if name.startswith("test_") and name.endswith(".py"):
            with open(os.path.join(ROOT, "tests", name)) as f:
                if CUDA_TEST_FILES.search(f.read()):
                    files.append(os.path.join("tests", name))
    if not files:
        return {"status": "FAIL", "reason": "no test file in tests/ mentions CUDA: the selection is broken"}
    with tempfile.TemporaryDirectory() as tmp:
        report = os.path.join(tmp, "report.json")
        env = child_env()
        env["RAYZERO_GPU_PYTEST_REPORT"] = report
        cmd = [sys.executable, "-m", "pytest", "-q", "-rfEs", "-p", "gpu_pytest_select", "-p", "no:cacheprovider", *files]
        code, out = run_child(cmd, limit, env)
        if code is None:
            return {"status": "FAIL", "reason": f"timed out after {limit:.0f} s", "details": out.splitlines()[-30:]}
        if not os.path.exists(report):
            return {"status": "FAIL", "reason": f"pytest ended with {code} and no report", "details": out.splitlines()[-30:]}
        with open(report) as f:
            rep = json.load(f)
    outcomes = rep["outcomes"]
    passed = [k for k, v in outcomes.items() if v == "passed"]
    failed = [k for k, v in outcomes.items() if v.startswith("failed")]
    skipped = {k: v for k, v in outcomes.items() if v.startswith("skipped")}
    env_errors = [e for e in rep["collect_errors"] if MISSING_OPTIONAL.search(e["error"])]
    real_errors = [e for e in rep["collect_errors"] if e not in env_errors]
    details = [f"{k}: {v}" for k, v in outcomes.items()]
    details += [f"collection error {e['nodeid']}: {e['error'][-300:]}" for e in rep["collect_errors"]]
    numbers = f"{len(passed)} passed, {len(failed)} failed, {len(skipped)} skipped of {len(rep['selected'])} selected"
    if skipped and not smoke:
        numbers += " (skipped: " + ", ".join(k.split("::")[-1] for k in skipped) + ")"
    if env_errors:
        numbers += f"; {len(env_errors)} file(s) not importable here (optional package missing)"
    if failed or real_errors:
        return {"status": "FAIL", "reason": f"failed: {', '.join(failed + [e['nodeid'] for e in real_errors])}",
                "numbers": numbers, "details": details}
    if smoke:  # the selected tests that need CUDA skipped; the ones that passed check the CPU side
        return {"status": "SKIP", "reason": f"no CUDA here: {len(skipped)} skipped "
                + "; ".join(sorted({v.split(': ', 1)[-1] for v in skipped.values()})),
                "numbers": numbers, "details": details}
    if not passed:
        return {"status": "FAIL", "reason": "no CUDA test passed on the GPU", "numbers": numbers, "details": details}
    return {"status": "PASS", "reason": "", "numbers": numbers, "details": details}


def section(name: str, limit: float, args: dict) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result.json")
        cmd = [sys.executable, os.path.join(HERE, "gpu_cases.py"), name, json.dumps(args), out]
        code, text = run_child(cmd, limit, child_env())
        if code is None:
            result = {"status": "FAIL", "reason": f"timed out after {limit:.0f} s (killed)", "log": text.splitlines()[-30:]}
            if os.path.exists(out + ".partial"):  # what the section finished before it was killed
                with open(out + ".partial") as f:
                    partial = json.load(f)
                result.update(numbers=partial.get("numbers", ""), details=partial.get("details", []))
            return result
        if not os.path.exists(out):
            return {"status": "FAIL", "reason": f"the section's process ended with {code} and no result",
                    "log": text.splitlines()[-30:]}
        with open(out) as f:
            result = json.load(f)
    result["log"] = text.splitlines()[-30:]
    return result


def cell(text) -> str:
    return str(text if text not in (None, "") else "").replace("|", "/").replace("\n", " ")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cpu-smoke", action="store_true", help="dry run on the CPU: tiny sizes, CUDA-only parts skipped")
    p.add_argument("--only", default="", help="comma-separated section names (cuda-tests and the ones above)")
    p.add_argument("--budget", type=float, default=450.0, help="seconds for every section together (default 450)")
    p.add_argument("--sync-limit", type=int, default=2,
                   help="most host syncs allowed per optimizer step (issue 26: the norm's read, and the loss's)")
    p.add_argument("--out", default=os.environ.get("OUT", ""), help="folder for gpu_check.md/.json (default $OUT)")
    a = p.parse_args(argv)
    start = time.perf_counter()
    deadline = start + a.budget
    only = {s.strip() for s in a.only.split(",") if s.strip()}
    known = {"cuda-tests"} | {s[0] for s in SECTIONS}
    if only - known:
        p.error(f"unknown section(s) {', '.join(sorted(only - known))}; known: {', '.join(sorted(known))}")

    env = environment()
    gpus = len(env["gpus"])
    if not a.cpu_smoke and not gpus:
        print("no CUDA device is visible: run on the GPU machine, or use --cpu-smoke for the dry run", file=sys.stderr)
        return 2
    device = "cpu" if a.cpu_smoke else "cuda"
    print(f"gpu_check: device {device}; python {env['python']}, torch {env['torch']}, CUDA {env['cuda']}, "
          f"GPUs {env['gpus'] or 'none'} {env.get('nvidia_smi') or ''}", flush=True)
    print("optional packages: " + ", ".join(f"{k} {v or 'absent'}" for k, v in env["packages"].items()), flush=True)

    rows: list[tuple[str, dict]] = []

    def want(name):
        return not only or name in only

    def left() -> float:
        return deadline - time.perf_counter()

    if want("cuda-tests"):
        t = time.perf_counter()
        r = cuda_tests(min(150.0, max(left(), 1.0)), a.cpu_smoke)
        r["seconds"] = round(time.perf_counter() - t, 1)
        rows.append(("cuda-tests", r))
        print(f"[cuda-tests] {r['status']} {r.get('numbers', '')} {r.get('reason', '')}", flush=True)

    for name, limit, gpu_args, smoke_args in SECTIONS:
        if not want(name):
            continue
        args = gpu_args if not a.cpu_smoke else smoke_args
        if name == "fit" and env["packages"].get("ray") is None:
            rows.append((name, {"status": "SKIP", "reason": "ray is not importable: rayzero.fit with use_gpu=True "
                                "not covered (ray's wheel is over the 64 MiB carry limit: bench/README.md)"}))
            continue
        if name == "train-parity-world2" and not a.cpu_smoke and gpus < 2:
            rows.append((name, {"status": "SKIP", "reason": f"needs 2 GPUs, {gpus} visible: NCCL between ranks "
                                "(bucket reduce-scatters, weight all-gathers, stage-3 gathers, the norm's "
                                "all-reduce) not covered"}))
            continue
        budget = min(limit, left())
        if budget < 15:
            rows.append((name, {"status": "SKIP", "reason": f"the overall budget ({a.budget:.0f} s) is spent"}))
            continue
        r = section(name, budget, dict(args, device=device, limit=budget))
        counts = [c for v in (r.get("syncs") or {}).values() for c in v]
        if counts:  # host syncs per optimizer step over the section's counted runs
            r["numbers"] = (r.get("numbers") or "") + f"; syncs/step {min(counts)}-{max(counts)}"
        rows.append((name, r))
        print(f"[{name}] {r['status']} in {r.get('seconds', '?')} s: {r.get('numbers', '')} {r.get('reason', '')}",
              flush=True)
        for line in r.get("details", []):
            print(f"    {line}", flush=True)
        if r["status"] == "FAIL":
            for line in r.get("log", []):
                print(f"    | {line}", flush=True)

    # host syncs per optimizer step, across every section that counted them
    counted = {f"{n}: {k}": v for n, r in rows for k, v in (r.get("syncs") or {}).items() if v}
    if device != "cuda":
        rows.append(("host syncs", {"status": "SKIP", "reason": "torch's sync debug mode reports CUDA syncs only"}))
    elif not counted:
        rows.append(("host syncs", {"status": "SKIP", "reason": "no section counted any step"}))
    else:
        over = {k: max(v) for k, v in counted.items() if max(v) > a.sync_limit}
        rows.append(("host syncs", {
            "status": "FAIL" if over else "PASS",
            "reason": (f"more than {a.sync_limit} per step: " + ", ".join(f"{k} {v}" for k, v in over.items())) if over else "",
            "numbers": f"max {max(max(v) for v in counted.values())} per step over {len(counted)} runs "
                       f"(limit {a.sync_limit})"}))
    if not a.cpu_smoke and gpus < 2:
        rows.append(("not covered on 1 GPU", {"status": "SKIP", "reason": "need 2 GPUs: NCCL collectives between "
                     "ranks, shards and devices at LOCAL_RANK > 0 (zero_init, set_device), workers sharing GPUs "
                     "(fractional use_gpu); need several machines: ranks on several hosts"}))

    total = time.perf_counter() - start
    lines = [f"# rayzero GPU check ({'CPU dry run' if a.cpu_smoke else 'GPU'})", "",
             f"torch {env['torch']}, CUDA {env['cuda']}, GPUs: {', '.join(env['gpus']) or 'none'}; "
             f"optional: {', '.join(f'{k} {v}' for k, v in env['packages'].items() if v) or 'none'}; "
             f"absent: {', '.join(k for k, v in env['packages'].items() if not v) or 'none'}; total {total:.0f} s", "",
             "| section | result | s | numbers | reason |", "|---|---|---:|---|---|"]
    for name, r in rows:
        lines.append(f"| {name} | {r['status']} | {cell(r.get('seconds'))} | {cell(r.get('numbers'))} | "
                     f"{cell(r.get('reason'))} |")
    for name, r in rows:
        if r.get("table"):
            lines += ["", f"## {name}", "", *r["table"]]
    text = "\n".join(lines) + "\n"
    print("\n" + text, flush=True)
    if a.out:
        os.makedirs(a.out, exist_ok=True)
        with open(os.path.join(a.out, "gpu_check.md"), "w") as f:
            f.write(text)
        with open(os.path.join(a.out, "gpu_check.json"), "w") as f:
            json.dump({"environment": env, "sections": dict(rows), "seconds": total}, f, indent=1, default=str)
    return 1 if any(r["status"] == "FAIL" for _, r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
