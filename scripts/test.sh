#!/usr/bin/env bash
# The test command of the README: the whole suite, on this machine's CPU, with real gloo process groups.
set -euo pipefail
cd "$(dirname "$0")/.."
exec python -m pytest -q -p no:cacheprovider tests "$@"
