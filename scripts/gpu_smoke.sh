#!/usr/bin/env bash
# One-GPU smoke test of the GPU-only paths: the Transformer Engine layer spec, bf16,
# and every FP8 recipe the installed Transformer Engine supports (step time and MFU
# per mode); the rollout server on Megatron's dynamic inference engine, whose greedy
# tokens must equal the static engine's; and the vLLM / SGLang command lines the
# launcher would run. Says plainly what it could not run. Under 5 minutes on one
# H100/H200. Usage: scripts/gpu_smoke.sh [--steps N] [--only te|rollout] [--check]
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
[ -x "$PY" ] || PY=python3
exec "$PY" scripts/gpu_smoke.py "$@"
