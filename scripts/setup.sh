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
  if command -v bwrap >/dev/null 2>&1; then return 0; fi
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    echo "installing bubblewrap (sandbox for model-written code)"
    apt-get update -qq >/dev/null && apt-get install -y -qq --no-install-recommends bubblewrap >/dev/null
  else
    echo "warning: bubblewrap is missing and cannot be installed here; sandboxed rewards will refuse to run" >&2
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
"$VENV/bin/pip" install -q -e ".[dev,rewards,launch,hf]"
touch "$STAMP"
echo "environment ready: $VENV"
