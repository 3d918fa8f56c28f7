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
# structured output's tests need xgrammar; its wheel declares triton (286 MB of GPU kernels
# that a CPU machine never runs), so the tests take xgrammar and what it imports without it
# (`pip install autospec[structured]` installs it as xgrammar declares itself)
if ! "$VPY" -c "import xgrammar" 2>/dev/null; then
  "$VPY" -m pip install -q --no-deps "xgrammar==0.2.9" "apache-tvm-ffi>=0.1.11"
  "$VPY" -m pip install -q pydantic typing-extensions
fi
