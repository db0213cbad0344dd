#!/usr/bin/env bash
# rayzero on a lent GPU (issue 26): every section of bench/gpu_check.py, one table, exit 1 on any FAIL.
#   bench/gpu_check.sh               on the GPU machine (through the device tool: bench/README.md)
#   bench/gpu_check.sh --cpu-smoke   the dry run on the CPU
# Wheels in .whl/ (prepared by bench/gpu_wheels.sh, carried with the tree) are installed first into
# /tmp/gpu_check_site. rayzero itself runs from this tree (PYTHONPATH), never installed.
set -u
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
if [ -n "${PYTHON:-}" ]; then PY="$PYTHON"
elif [ -x /opt/torch/.venv/bin/python3 ]; then PY=/opt/torch/.venv/bin/python3
elif [ -x "$ROOT/.venv/bin/python" ]; then PY="$ROOT/.venv/bin/python"
else PY=python3; fi
export PYTHONUNBUFFERED=1
EXTRA=""
if compgen -G "$ROOT/.whl/*.whl" > /dev/null; then
  echo "installing $(ls "$ROOT"/.whl/*.whl | wc -l) carried wheel(s) from .whl/ into /tmp/gpu_check_site"
  if "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
       --target /tmp/gpu_check_site "$ROOT"/.whl/*.whl; then
    EXTRA=/tmp/gpu_check_site
  else
    echo "installing the carried wheels failed: going on without them" >&2
  fi
fi
export PYTHONPATH="$ROOT:$ROOT/tests${EXTRA:+:$EXTRA}${PYTHONPATH:+:$PYTHONPATH}"
exec "$PY" "$ROOT/bench/gpu_check.py" "$@"
