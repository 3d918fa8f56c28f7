#!/usr/bin/env bash
# The device check for the GPU path: the `gpu`-marked tests, then scripts/gpu_bench.py
# (7B-shaped target, 0.5B-shaped drafts, bf16, random and controlled weights). Fits in 8 minutes
# on one H200 and needs only a python with torch and transformers: it installs nothing from
# the network (wheels carried in shared/wheels, e.g. pytest and nvidia-ml-py, are installed
# from there with --no-index if that folder exists). Without pytest the tests run as a script;
# without pynvml the NVML figures are absent.
#
#   scripts/gpu_check.sh            # outputs under $OUT (the device runner collects it), else
#                                   # ./gpu_check_out; PYTHON=/path/to/python to choose one
#
# On a machine without CUDA it is a dry run: the GPU tests skip and the benchmark runs --tiny.
set -uo pipefail
OUT=${OUT:-$(dirname "$0")/../gpu_check_out}
mkdir -p "$OUT" && OUT=$(cd "$OUT" && pwd)  # absolute: the check runs from elsewhere
cd "$(dirname "$0")/.."
REPO=$(pwd)
START=$(date +%s)
LIMIT=${GPU_CHECK_LIMIT_S:-470}  # the whole check, seconds (8 minutes less a margin)
elapsed() { echo $(( $(date +%s) - START )); }

# a python with torch and transformers
PY=${PYTHON:-}
if [ -z "$PY" ]; then
  for c in "$REPO/.venv/bin/python" python3 python; do
    if command -v "$c" >/dev/null 2>&1 && "$c" -c "import torch, transformers" 2>/dev/null; then
      PY=$c
      break
    fi
  done
fi
[ -n "$PY" ] || { echo "gpu_check: no python with torch and transformers found" >&2; exit 2; }

# the checkout's own package tree, without an install (a scratch folder holds wheels, cache)
SHIM=$(mktemp -d)
trap 'rm -rf "$SHIM"' EXIT
export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"
if [ -d "$REPO/shared/wheels" ]; then
  "$PY" -m pip install --no-index --find-links "$REPO/shared/wheels" --target "$SHIM/site" \
    pytest nvidia-ml-py >"$OUT/pip.log" 2>&1 || echo "(some wheels in shared/wheels did not install: see pip.log)"
  export PYTHONPATH="$PYTHONPATH:$SHIM/site"
fi
export PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
export AUTOSPEC_CACHE="$SHIM/cache"
cd "$SHIM"  # outside the repo: nothing the tests write lands in the checkout

"$PY" - <<'EOF' 2>&1 | tee "$OUT/env.txt"
import importlib, sys
import torch, transformers
print("python", sys.version.split()[0], "| torch", torch.__version__, "cuda", torch.version.cuda,
      "| transformers", transformers.__version__)
if torch.cuda.is_available():
    p = torch.cuda.get_device_properties(0)
    print("device:", p.name, f"{p.total_memory / 2**30:.0f} GiB", "capability", p.major, p.minor)
else:
    print("device: no CUDA (dry run)")
for mod in ("triton", "pytest", "pynvml", "sqlalchemy", "scipy"):
    try:
        m = importlib.import_module(mod)
        print(f"{mod}: {getattr(m, '__version__', 'present')}")
    except Exception as e:
        print(f"{mod}: absent ({type(e).__name__})")
import os
import autospec.testing.controlled, autospec.policies, autospec.engine.runners, autospec.store.record
here = os.getcwd()  # the shim: every part of the package must come from it
paths = [m.__file__ for m in (autospec, autospec.policies, autospec.engine.runners, autospec.store)]
print("autospec from", os.path.dirname(paths[0]))
assert all(p.startswith(here) for p in paths), paths
EOF
[ "${PIPESTATUS[0]}" = 0 ] || { echo "gpu_check: autospec does not import from the repo" >&2; exit 2; }
CUDA=$("$PY" -c "import torch; print(int(torch.cuda.is_available()))")

# 1. the GPU tests (tests/test_gpu_path.py holds every `gpu`-marked test; the other test files
#    need packages a bare device machine may lack, so they are not collected here)
echo "== gpu tests ($(elapsed) s)"
if "$PY" -c "import pytest" 2>/dev/null; then
  timeout 180 "$PY" -m pytest -m gpu -q -p no:cacheprovider --rootdir "$REPO" \
    -c "$REPO/pyproject.toml" "$REPO/tests/test_gpu_path.py" 2>&1 | tee "$OUT/gpu_tests.txt"
else
  timeout 180 "$PY" "$REPO/tests/test_gpu_path.py" 2>&1 | tee "$OUT/gpu_tests.txt"
fi
TESTS_RC=${PIPESTATUS[0]}

# 2. the benchmark, in what time is left (it skips sections that would not fit, saying so)
LEFT=$(( LIMIT - $(elapsed) ))
echo "== benchmark ($(elapsed) s elapsed, ${LEFT} s left)"
if [ "$CUDA" = 1 ]; then
  ARGS=(--budget-s $(( LEFT - 60 )))
else
  ARGS=(--tiny)
fi
timeout "$LEFT" "$PY" "$REPO/scripts/gpu_bench.py" "${ARGS[@]}" --json "$OUT/gpu_bench.json" 2>&1 | tee "$OUT/gpu_bench.txt"
BENCH_RC=${PIPESTATUS[0]}

echo "gpu tests rc=$TESTS_RC, benchmark rc=$BENCH_RC, $(elapsed) s in all" | tee "$OUT/summary.txt"
[ "$TESTS_RC" = 0 ] && [ "$BENCH_RC" = 0 ]
