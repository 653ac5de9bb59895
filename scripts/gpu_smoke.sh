#!/usr/bin/env bash
# One-GPU smoke test of the GPU-only paths: the Transformer Engine layer spec, bf16,
# and every FP8 recipe the installed Transformer Engine supports. Prints step time
# and MFU per mode, and says plainly what it could not run. Under 5 minutes on one
# H100/H200. Usage: scripts/gpu_smoke.sh [--steps N]
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
[ -x "$PY" ] || PY=python3
exec "$PY" scripts/gpu_smoke.py "$@"
