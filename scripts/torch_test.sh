#!/usr/bin/env bash
# The PyTorch adapter's tests: a virtual environment outside the clone
# (reused when present; NPK_VENV overrides where) with torch from PyPI if
# missing (first time: a ~5 GB CUDA build, 2-3 minutes) and the newest
# transformers on PyPI without the `kernels` package (what a new user
# installs); beside it a small overlay environment ($VENV-pinned) holding
# only transformers and kernels pinned as a pair, the main environment's
# packages (torch, the adapter) after them on its path. The static library
# is rebuilt so the extension links the current code, the adapter
# reinstalled, then all of adapters/torch/tests with the newest
# transformers and, with the pinned pair, the test files whose behaviour
# depends on those versions (the Hugging Face drop-in and the `kernels`
# route: every test file that imports transformers, kernels, hf_models or
# npukern_torch.hf): three pytest runs side by side (those files with each
# version, the files that use torch alone with the newest).
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
# The main environment: the newest transformers, no kernels.
if "$PY" -c "import kernels" 2>/dev/null; then
  "$PY" -m pip uninstall --quiet --yes kernels
fi
echo "== the newest transformers into $VENV"
"$PY" -m pip install --quiet --upgrade transformers
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
# The other files, which use torch alone (one run covers them).
mapfile -t TORCH_FILES < <(cd "$ROOT" && for f in adapters/torch/tests/test_*.py; do
  printf '%s\n' "${HF_FILES[@]}" | grep -qxF "$f" || echo "$f"
done)
if [ ${#TORCH_FILES[@]} -eq 0 ]; then
  echo "no test file uses torch alone: failing" >&2
  exit 1
fi
# Three pytest runs side by side (each mostly one core; the newest
# transformers' run split in two by those file lists, so that the adapter's
# tests take the cores the two runs and the fuzz runs beside left half idle):
# the version-dependent files with the pinned pair, the same files with the
# newest transformers, the torch-only files. The last one's output is
# printed as it runs, the others' whole after it. Their OpenMP threads
# (torch's intra-op pool, and at::parallel_for, npukern's runner here) sleep
# when idle instead of spinning: processes of two spinning threads each on
# two cores made every parallel region wait for a descheduled spinner, and a
# 0.8 s test took 61 s.
export OMP_WAIT_POLICY=PASSIVE
SIDE=$(mktemp -d) # the side runs' logs and pytest base temps: no two sessions share one
trap 'rm -rf "$SIDE"' EXIT
NEWEST=$("$PY" -c 'import transformers; print(transformers.__version__)')
side_names=("with $HF_PINS ($PIN_VENV)" "with transformers $NEWEST, no kernels")
side_pys=("$PIN_PY" "$PY")
side_pids=()
for i in 0 1; do
  echo "== pytest ${side_names[$i]}, beside the next run: ${HF_FILES[*]##*/}"
  mkdir "$SIDE/tmp$i"
  run_suite "${side_pys[$i]}" --basetemp="$SIDE/tmp$i" "${HF_FILES[@]}" >"$SIDE/log$i" 2>&1 &
  side_pids+=($!)
done
echo "== pytest with transformers $NEWEST, the files that use torch alone: ${TORCH_FILES[*]##*/}"
status=0
run_suite "$PY" "${TORCH_FILES[@]}" || status=$?
side_status=(0 0)
for i in 0 1; do
  wait "${side_pids[$i]}" || side_status[i]=$?
  echo "== pytest ${side_names[$i]} (the version-dependent files), its output:"
  cat "$SIDE/log$i"
done
[ "$status" -eq 0 ] || { echo "FAIL: pytest of the torch-only files (status $status)" >&2; exit "$status"; }
for i in 0 1; do
  [ "${side_status[$i]}" -eq 0 ] || { echo "FAIL: pytest ${side_names[$i]} (status ${side_status[$i]})" >&2; exit "${side_status[$i]}"; }
done
