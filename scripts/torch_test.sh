#!/usr/bin/env bash
# The PyTorch adapter's tests: a virtual environment outside the clone
# (reused when present; NPK_VENV overrides where) with torch from PyPI if
# missing (first time: a ~5 GB CUDA build, 2-3 minutes) and the newest
# transformers on PyPI without the `kernels` package (what a new user
# installs); beside it a small overlay environment ($VENV-pinned) holding
# only transformers and kernels pinned as a pair, the main environment's
# packages (torch, the adapter) after them on its path. The static library
# is rebuilt so the extension links the current code, the adapter
# reinstalled, then two pytest runs side by side: all of adapters/torch/tests
# with the newest transformers, and with the pinned pair the test files
# whose behaviour depends on those versions (the Hugging Face drop-in and
# the `kernels` route: every test file that imports transformers, kernels,
# hf_models or npukern_torch.hf). The other files use torch alone: one run
# covers them.
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
if ! "$PY" -c "import expecttest" 2>/dev/null; then
  # torch.testing._internal (tests/test_optim_db.py: PyTorch's own optimizer
  # inputs) imports it; torch's wheel does not depend on it.
  echo "== installing expecttest into $VENV"
  "$PY" -m pip install --quiet expecttest
fi
if ! "$PY" -c "import accelerate" 2>/dev/null; then
  # Trainer's own dependency: tests/test_hf_trainer.py runs Hugging Face's Trainer.
  echo "== installing accelerate into $VENV"
  "$PY" -m pip install --quiet accelerate
fi
# The main environment: the newest transformers, no kernels.
if "$PY" -c "import kernels" 2>/dev/null; then
  "$PY" -m pip uninstall --quiet --yes kernels
fi
# And the newest trl beside it (tests/test_trl_head.py: TRL's trainers put
# their own fused LM head on the model, which hf.patch serves on npukern's
# kernels), as a fresh machine gets it: the two move together.
echo "== the newest transformers and trl into $VENV"
"$PY" -m pip install --quiet --upgrade transformers trl
# Hugging Face's transformers and kernels for the drop-in tests (tiny configs,
# no download). Pinned as a pair: transformers 5.23+ enables its kernels hub
# decorators only with kernels >= 0.18.2, which PyPI does not have; 5.22.2
# takes kernels 0.17.2, the newest there. In the overlay environment: its
# own site-packages first, then the main one's (a .pth line; site.addsitedir
# also reads the main one's .pth files), so pip installs only what the pair
# needs beyond the main environment.
PIN_VENV=$VENV-pinned
PIN_PY=$PIN_VENV/bin/python
HF_PINS="transformers==5.22.2 kernels==0.17.2"
if [ ! -x "$PIN_PY" ]; then
  echo "== creating the overlay environment $PIN_VENV"
  python3 -m venv "$PIN_VENV" || python3 -m virtualenv --quiet "$PIN_VENV"
fi
main_site=$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
pin_site=$("$PIN_PY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
echo "import site; site.addsitedir('$main_site')" >"$pin_site/npukern-main-venv.pth"
if ! "$PIN_PY" -c "import transformers, kernels, sys; sys.exit(transformers.__version__ != '5.22.2' or kernels.__version__ != '0.17.2')" 2>/dev/null; then
  echo "== installing $HF_PINS into $PIN_VENV"
  "$PIN_PY" -m pip install --quiet $HF_PINS 2>&1 | { grep -v -i 'outside environment\|not uninstalling\|can.t uninstall' || true; }
  "$PIN_PY" -c "import transformers, kernels, torch, sys; sys.exit(transformers.__version__ != '5.22.2' or kernels.__version__ != '0.17.2')"
fi

[ "$SETUP_ONLY" = 0 ] || exit 0

echo "== cargo build --release (the static library the extension links)"
cargo build --release

echo "== pip install --no-build-isolation ./adapters/torch"
"$PY" -m pip install --quiet --no-build-isolation --no-deps --force-reinstall ./adapters/torch

run_suite() { # PYTHON, then test files or directories
  local py=$1
  shift
  # From the repository root, so the installed package (not the source tree) is imported.
  cd "$ROOT"
  set +e
  "$py" -m pytest "$@" -q -p no:cacheprovider --durations=5
  local status=$?
  set -e
  if [ "$status" -eq 5 ]; then
    echo "pytest collected no tests: failing" >&2
    return 1
  fi
  return "$status"
}

# The version-dependent files, found by what they import (so a new one is
# picked up without a list to maintain).
mapfile -t HF_FILES < <(cd "$ROOT" && grep -l -E \
  '(import|from) +(transformers|kernels|hf_models)\b|npukern_torch\.hf\b' adapters/torch/tests/test_*.py)
if [ ${#HF_FILES[@]} -eq 0 ]; then
  echo "no test file imports transformers: failing" >&2
  exit 1
fi
# The two runs side by side (pytest is mostly one core each), the pinned
# one's output printed whole after the other's. Their OpenMP threads (torch's
# intra-op pool, and at::parallel_for, npukern's runner here) sleep when idle
# instead of spinning: two processes of two spinning threads each on two
# cores (three with the fuzz runs beside) made every parallel region wait for
# a descheduled spinner, and a 0.8 s test took 61 s.
export OMP_WAIT_POLICY=PASSIVE
PIN_LOG=$(mktemp)
PIN_TMP=$(mktemp -d) # its own pytest base temp: two sessions never share one
trap 'rm -rf "$PIN_LOG" "$PIN_TMP"' EXIT
echo "== pytest with $HF_PINS ($PIN_VENV), beside the next run: ${HF_FILES[*]##*/}"
# Tests marked torch_only (conftest.py) use torch alone: the other run has them.
run_suite "$PIN_PY" --basetemp="$PIN_TMP" -m "not torch_only" "${HF_FILES[@]}" >"$PIN_LOG" 2>&1 &
PIN_PID=$!
echo "== pytest adapters/torch/tests (transformers $("$PY" -c 'import transformers; print(transformers.__version__)'), no kernels)"
status=0
run_suite "$PY" adapters/torch/tests || status=$?
pin_status=0
wait "$PIN_PID" || pin_status=$?
echo "== the pinned run ($HF_PINS), its output:"
cat "$PIN_LOG"
[ "$status" -eq 0 ] || { echo "FAIL: pytest with the newest transformers (status $status)" >&2; exit "$status"; }
[ "$pin_status" -eq 0 ] || { echo "FAIL: pytest with $HF_PINS (status $pin_status)" >&2; exit "$pin_status"; }
