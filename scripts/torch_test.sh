#!/usr/bin/env bash
# The PyTorch adapter's tests: a virtual environment outside the clone
# (reused when present; NPK_VENV overrides where), torch from PyPI if
# missing (first time: a ~5 GB CUDA build, 2-3 minutes), the static library
# rebuilt so the extension links the current code, the adapter reinstalled,
# then pytest: with transformers and kernels pinned as a pair, the test files
# whose behaviour depends on those versions (the Hugging Face drop-in and
# the `kernels` route: every test file that imports transformers, kernels,
# hf_models or npukern_torch.hf); then all of adapters/torch/tests with the
# newest transformers on PyPI and no `kernels` package (what a new user
# installs). The other files use torch alone: one run covers them.
#
#   scripts/torch_test.sh           # all of the above
#   scripts/torch_test.sh --setup   # only the environment (venv, torch,
#                                   # accelerate, the pinned pair): what
#                                   # scripts/test.sh starts first, beside
#                                   # its other steps
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
SETUP_ONLY=0
case "${1:-}" in
  "") ;;
  --setup) SETUP_ONLY=1 ;;
  *) echo "usage: scripts/torch_test.sh [--setup]" >&2; exit 2 ;;
esac
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
if ! "$PY" -c "import accelerate" 2>/dev/null; then
  # Trainer's own dependency: tests/test_hf_trainer.py runs Hugging Face's Trainer.
  echo "== installing accelerate into $VENV"
  "$PY" -m pip install --quiet accelerate
fi
# Hugging Face's transformers and kernels for the drop-in tests (tiny configs,
# no download). Pinned as a pair: transformers 5.23+ enables its kernels hub
# decorators only with kernels >= 0.18.2, which PyPI does not have; 5.22.2
# takes kernels 0.17.2, the newest there.
HF_PINS="transformers==5.22.2 kernels==0.17.2"
if ! "$PY" -c "import transformers, kernels, sys; sys.exit(transformers.__version__ != '5.22.2' or kernels.__version__ != '0.17.2')" 2>/dev/null; then
  echo "== installing $HF_PINS into $VENV"
  "$PY" -m pip install --quiet $HF_PINS
fi

[ "$SETUP_ONLY" = 0 ] || exit 0

echo "== cargo build --release (the static library the extension links)"
cargo build --release

echo "== pip install --no-build-isolation ./adapters/torch"
"$PY" -m pip install --quiet --no-build-isolation --no-deps --force-reinstall ./adapters/torch

run_suite() { # test files or directories
  # From the repository root, so the installed package (not the source tree) is imported.
  cd "$ROOT"
  set +e
  "$PY" -m pytest "$@" -q -p no:cacheprovider --durations=5
  local status=$?
  set -e
  if [ "$status" -eq 5 ]; then
    echo "pytest collected no tests: failing" >&2
    exit 1
  fi
  [ "$status" -eq 0 ] || exit "$status"
}

# The version-dependent files, found by what they import (so a new one is
# picked up without a list to maintain).
mapfile -t HF_FILES < <(cd "$ROOT" && grep -l -E \
  '(import|from) +(transformers|kernels|hf_models)\b|npukern_torch\.hf\b' adapters/torch/tests/test_*.py)
if [ ${#HF_FILES[@]} -eq 0 ]; then
  echo "no test file imports transformers: failing" >&2
  exit 1
fi
echo "== pytest, the files that use transformers / kernels ($HF_PINS): ${HF_FILES[*]##*/}"
run_suite "${HF_FILES[@]}"

echo "== the newest transformers on PyPI, without kernels"
"$PY" -m pip uninstall --quiet --yes kernels
"$PY" -m pip install --quiet --upgrade transformers
echo "== pytest adapters/torch/tests (transformers $("$PY" -c 'import transformers; print(transformers.__version__)'), no kernels)"
run_suite adapters/torch/tests
