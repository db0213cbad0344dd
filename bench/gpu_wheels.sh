#!/usr/bin/env bash
# Prepare the wheels bench/gpu_check.sh installs on the GPU machine, which has no network: DeepSpeed (built
# here as a pure-Python wheel, no prebuilt ops: the check runs it with torch's fused AdamW) and the packages
# it needs that the machine's image lacks. Run on the development machine, in the repo root:
#   bench/gpu_wheels.sh                 # writes .whl/ (ignored by git) and prints what it holds
#   WHL_DIR=/tmp/w bench/gpu_wheels.sh  # elsewhere (then copy it to .whl/ before the run)
# Then name ".whl" in the device run's carry list. Everything carried (tree + wheels) must stay under 64 MiB.
# Ray is NOT prepared: its wheel alone is over the limit (bench/README.md).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
PY="${PYTHON:-python3}"
OUTDIR="${WHL_DIR:-$ROOT/.whl}"
DS_VERSION="${DS_VERSION:-0.19.8}"
# the GPU image: CPython 3.12 on x86-64 (bench/README.md)
PLATFORM=(--only-binary=:all: --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64
          --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64)
mkdir -p "$OUTDIR"
if [ "$OUTDIR" = "$ROOT/.whl" ]; then
  exclude="$(git rev-parse --git-path info/exclude)"
  grep -qx '/.whl/' "$exclude" 2>/dev/null || echo '/.whl/' >> "$exclude"
fi
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
# DeepSpeed ships as a source archive; DS_BUILD_OPS=0 makes a py3-none-any wheel (ops would be JIT-built)
"$PY" -m pip download -q --no-deps --no-binary=:all: -d "$tmp" "deepspeed==$DS_VERSION"
DS_BUILD_OPS=0 "$PY" -m pip wheel -q --no-deps --no-build-isolation -w "$OUTDIR" "$tmp"/deepspeed-*.tar.gz
# its requirements the image lacks (einops, msgpack, ninja, numpy, packaging, psutil, py-cpuinfo, tqdm and
# torch are there); pydantic with its dependencies so pydantic-core matches it exactly
"$PY" -m pip download -q "${PLATFORM[@]}" -d "$OUTDIR" hjson pydantic
# typing-extensions is in the image already; one version of each package only
rm -f "$OUTDIR"/typing_extensions-*.whl
ls -l "$OUTDIR"
du -sh "$OUTDIR"
