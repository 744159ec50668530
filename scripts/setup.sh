#!/usr/bin/env bash
# Idempotent set-up: a venv in .venv with the CPU torch build pinned for this machine kind,
# the engines, and shardfit itself in editable mode. A second run only checks and returns.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
TORCH_PIN=${SHARDFIT_TORCH:-torch==2.13.0}
stamp=.venv/.shardfit-setup
want="$(cat pyproject.toml scripts/setup.sh | sha256sum | cut -c1-16) $TORCH_PIN"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  exit 0
fi
[ -x .venv/bin/python ] || "$PY" -m venv .venv
pip() { .venv/bin/python -m pip -q --disable-pip-version-check "$@"; }
# torch first and pinned: an unpinned torch would pull a multi-GB CUDA build.
.venv/bin/python -c "import torch" 2>/dev/null || pip install "$TORCH_PIN"
pip install -e ".[run,dev]" "$TORCH_PIN"
echo "$want" > "$stamp"
echo "shardfit: environment ready in .venv"
