#!/usr/bin/env bash
# Creates .venv with Python 3.12 and installs moerl with everything the demo and the
# tests need. Safe to re-run: it does nothing when pyproject.toml has not changed.
set -euo pipefail
cd "$(dirname "$0")/.."

VENV=${MOERL_VENV:-.venv}
STAMP="$VENV/.moerl-installed"

find_python312() {
  local candidate
  for candidate in "${PYTHON312:-}" python3.12 "$(pyenv root 2>/dev/null)/versions/3.12.1/bin/python3.12" \
    /usr/bin/python3.12 /usr/local/bin/python3.12; do
    [ -n "$candidate" ] || continue
    if command -v "$candidate" >/dev/null 2>&1 && \
       "$candidate" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 12))' 2>/dev/null; then
      command -v "$candidate"; return 0
    fi
  done
  local root
  for root in "$HOME/.pyenv" /root/.pyenv /opt/pyenv; do
    for candidate in "$root"/versions/3.12*/bin/python3.12; do
      [ -x "$candidate" ] && { echo "$candidate"; return 0; }
    done
  done
  return 1
}

install_system_packages() {
  # bubblewrap isolates model-written code in the sandbox; refuse-by-default without it.
  # gcc, make and git are what the shipped terminal tasks use inside the sandbox.
  local missing=()
  command -v bwrap >/dev/null 2>&1 || missing+=(bubblewrap)
  command -v gcc >/dev/null 2>&1 || missing+=(gcc libc6-dev)
  command -v make >/dev/null 2>&1 || missing+=(make)
  command -v git >/dev/null 2>&1 || missing+=(git)
  [ ${#missing[@]} -eq 0 ] && return 0
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    echo "installing ${missing[*]} (sandbox and terminal tasks)"
    apt-get update -qq >/dev/null && apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
  else
    echo "warning: ${missing[*]} missing and cannot be installed here; sandboxed rewards or terminal tasks will not run" >&2
  fi
}

install_system_packages

if [ -f "$STAMP" ] && [ "$STAMP" -nt pyproject.toml ]; then
  exit 0
fi

PY=$(find_python312) || {
  echo "error: Python 3.12 not found (megatron-core 0.19 requires it). Install it or set PYTHON312=/path/to/python3.12" >&2
  exit 1
}
echo "using $PY"
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
# torch first and alone: pip otherwise resolves it together with megatron-core's range.
"$VENV/bin/pip" install -q --upgrade pip
"$VENV/bin/pip" install -q "torch==2.13.0" numpy packaging
# bench: TRL for benchmarks/learning_vs_trl.py, whose smoke test `make test` runs.
"$VENV/bin/pip" install -q -e ".[dev,rewards,launch,hf,bench]"
touch "$STAMP"
echo "environment ready: $VENV"
