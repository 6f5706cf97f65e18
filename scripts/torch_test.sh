#!/usr/bin/env bash
# The PyTorch adapter's tests: a virtual environment outside the clone
# (reused when present; NPK_VENV overrides where), torch from PyPI if
# missing (first time: a ~5 GB CUDA build, 2-3 minutes), the static library
# rebuilt so the extension links the current code, the adapter reinstalled,
# then pytest on adapters/torch/tests.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
VENV=${NPK_VENV:-$HOME/.cache/npukern/venv}
PY=$VENV/bin/python

if [ ! -x "$PY" ]; then
  echo "== creating the virtual environment $VENV"
  mkdir -p "$(dirname "$VENV")"
  python3 -m venv "$VENV" || {
    # A Python without the venv module (Debian's python3 without python3-venv).
    python3 -m pip install --quiet --user virtualenv && python3 -m virtualenv --quiet "$VENV"
  }
fi
if ! "$PY" -c "import torch, pytest, numpy, ninja" 2>/dev/null; then
  echo "== installing torch, pytest, numpy, ninja into $VENV (first time only)"
  "$PY" -m pip install --quiet --upgrade pip
  "$PY" -m pip install --quiet torch pytest numpy ninja setuptools
fi

echo "== cargo build --release (the static library the extension links)"
cargo build --release

echo "== pip install --no-build-isolation ./adapters/torch"
"$PY" -m pip install --quiet --no-build-isolation --no-deps --force-reinstall ./adapters/torch

echo "== pytest adapters/torch/tests"
# From the repository root, so the installed package (not the source tree) is imported.
cd "$ROOT"
set +e
"$PY" -m pytest adapters/torch/tests -q -p no:cacheprovider --durations=5
status=$?
set -e
if [ "$status" -eq 5 ]; then
  echo "pytest collected no tests: failing" >&2
  exit 1
fi
exit "$status"
