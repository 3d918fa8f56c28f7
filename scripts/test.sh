#!/usr/bin/env bash
# Install (scripts/bootstrap.sh) and run the test suite: tiny random-weight models, no downloads.
# Extra arguments go to pytest (e.g. scripts/test.sh -k greedy).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/bootstrap.sh
exec .venv/bin/python -m pytest -q "$@"
