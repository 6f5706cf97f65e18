#!/usr/bin/env bash
# The CPU peer race (docs/performance.md, "npukern beside IPEX"): a venv of
# its own with torch 2.8 + Intel Extension for PyTorch 2.8 from PyPI
# (NPK_IPEX_VENV overrides where; ~5 GB the first time), npukern_torch built
# there for that torch, then benches/ipex_race.py: fresh and resident
# outputs, one thread and all threads. Extra arguments go to the script.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${NPK_IPEX_VENV:-$HOME/.cache/npukern/ipex-venv}
PY=$VENV/bin/python
if ! "$PY" -c "import torch, intel_extension_for_pytorch, wheel" 2>/dev/null; then
  python3 -m venv "$VENV"
  "$PY" -m pip install --quiet --upgrade pip
  "$PY" -m pip install --quiet torch==2.8.0 intel-extension-for-pytorch==2.8.0 numpy ninja setuptools wheel psutil
fi
"$PY" -m pip install --quiet --no-build-isolation --no-deps --force-reinstall ./adapters/torch
# libnpukern.so for the C ABI column (benches/capi_ctypes.py).
cargo build --release --quiet -p npukern-capi
all=$(nproc)
for threads in 1 "$all"; do
  for mode in "" --resident; do
    taskset -c "0-$((threads - 1))" "$PY" benches/ipex_race.py --threads "$threads" $mode "$@" 2>/dev/null
    echo
  done
done
