#!/usr/bin/env bash
# Create .venv (if missing) and install autospec with its test tools into it.
# torch is installed first, pinned to the CPU wheel this machine kind provides, so that no
# dependency resolution pulls a multi-GB CUDA build. On a GPU machine install your CUDA torch
# into the venv first (or set AUTOSPEC_TORCH=skip) and this step leaves it alone.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
VPY=.venv/bin/python
"$VPY" -m pip install -q --upgrade pip
if [ "${AUTOSPEC_TORCH:-}" != "skip" ] && ! "$VPY" -c "import torch" 2>/dev/null; then
  "$VPY" -m pip install -q "torch==${AUTOSPEC_TORCH_VERSION:-2.13.0}"
fi
"$VPY" -m pip install -q -e ".[test]"
