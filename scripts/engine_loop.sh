#!/usr/bin/env bash
# The fleet loop, closed on this machine with a real vLLM (its CPU build):
#   1. autospec serves a category's prompts with a pair and probes the pair's costs (a store);
#   2. `autospec export --engine vllm --check` writes vLLM's settings for that workload and
#      has vLLM's own code validate them;
#   3. vLLM serves the pair with exactly the exported --speculative-config (one server on
#      127.0.0.1, bounded in time, killed on exit);
#   4. the same category's prompts go to vLLM; its /metrics are scraped before and after, and
#      `autospec ingest --baseline` records the difference in the same category and pair;
#   5. `autospec stats` / `report` show both sources; the workload is exported again.
#
# Usage: scripts/engine_loop.sh [WORKDIR]
#   The pair: autospec's default pair (Qwen2.5-Coder 0.5B drafting for 1.5B, bf16, from the
#   cache; built there first where missing), the first AUTOSPEC_LOOP_PROMPTS (default 6)
#   benchmark prompts, AUTOSPEC_LOOP_TOKENS (default 48) new tokens each, greedy.
#   AUTOSPEC_LOOP_TARGET / AUTOSPEC_LOOP_DRAFT: other local model directories.
#   AUTOSPEC_LOOP_PAIR=small: a small random-weight Llama pair written to WORKDIR
#   (autospec.testing.small_pair), which loads in seconds but whose draft costs as much as its
#   target on a CPU, so the export usually says speculation does not pay and the loop stops
#   there.
# Builds what it needs where it is missing: .venv (scripts/bootstrap.sh) and the vLLM
# environment (`autospec export --engine vllm --build-checker`). A vLLM CPU server takes
# 2.5–3.5 minutes to start and uses every core.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
WORK=${1:-$(mktemp -d /tmp/autospec-loop.XXXXXX)}
mkdir -p "$WORK"
WORK=$(cd "$WORK" && pwd)
PY=$ROOT/.venv/bin/python
AS=$ROOT/.venv/bin/autospec
DB="sqlite:///$WORK/loop.db"
CATEGORY=loop
PROMPTS=${AUTOSPEC_LOOP_PROMPTS:-6}
TOKENS=${AUTOSPEC_LOOP_TOKENS:-48}
START_LIMIT=${AUTOSPEC_LOOP_START_S:-420}    # the server must answer /health within this
SERVE_LIMIT=${AUTOSPEC_LOOP_SERVE_S:-1200}   # and is killed after this, whatever happens
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
[ -x "$PY" ] || bash scripts/bootstrap.sh  # a fresh machine: autospec's own venv first
t0=$SECONDS
stamp() { echo "[$((SECONDS - t0)) s] $*"; }
# shellcheck source=scripts/vllm_server.sh
source scripts/vllm_server.sh
vllm_env
trap stop_server EXIT
trap 'exit 130' INT TERM  # the EXIT trap stops the server

# -- 1. autospec's own traffic and probe ------------------------------------------------------
stamp "1. autospec serves category '$CATEGORY' and probes the pair (store $DB)"
"$PY" scripts/engine_loop.py traffic "$WORK" "$DB" "$CATEGORY" "$PROMPTS" "$TOKENS"
read -r TARGET DRAFT < <("$PY" -c 'import json,sys; d=json.load(open(sys.argv[1])); print(d["target"], d["draft"])' "$WORK/loop.json")

# -- 2. export, checked by vLLM's own code ------------------------------------------------------
stamp "2. export for vLLM, validated by vLLM"
"$AS" export --db "$DB" --engine vllm --category "$CATEGORY" --proposer draft \
  --out "$WORK/vllm.sh" --check
grep -v '^#' "$WORK/vllm.sh"
SPEC=$("$PY" scripts/engine_loop.py spec "$WORK/vllm.sh")
if [ -z "$SPEC" ]; then
  echo "the export serves without speculation: nothing to close the loop with" >&2
  exit 1
fi

# -- 3. vLLM with exactly those settings --------------------------------------------------------
stamp "3. vLLM serves $TARGET with exactly the exported --speculative-config"
start_server vllm "$SPEC"

# -- 4. the category's prompts to vLLM, scraped before and after, ingested ----------------------
curl -sf "http://127.0.0.1:$PORT/metrics" >"$WORK/before.txt"
"$PY" scripts/engine_loop.py send "$WORK" "$PORT" "$TARGET" "$TOKENS"
curl -sf "http://127.0.0.1:$PORT/metrics" >"$WORK/after.txt"
stop_server
IFS=$'\t' read -r PTARGET PDRAFT PDTYPE PHW < <("$PY" scripts/engine_loop.py pair "$DB" "$CATEGORY")
stamp "4. ingest vLLM's counters (after − before) into category '$CATEGORY', pair $PTARGET / $PDRAFT"
"$AS" ingest --db "$DB" --prometheus "$WORK/after.txt" --baseline "$WORK/before.txt" \
  --category "$CATEGORY" --engine vllm --target "$PTARGET" --draft "$PDRAFT" \
  --dtype "$PDTYPE" --hardware "$PHW"

# -- 5. both sources in the store; the workload exported again ----------------------------------
stamp "5. stats, report, export again"
"$AS" stats --db "$DB" --category "$CATEGORY"
"$AS" report --db "$DB" --category "$CATEGORY" | sed -n '1,40p'
"$AS" export --db "$DB" --engine vllm --category "$CATEGORY" --proposer draft --out "$WORK/vllm-again.sh"
diff <(grep -v '^#' "$WORK/vllm.sh") <(grep -v '^#' "$WORK/vllm-again.sh") \
  && echo "the settings did not change" || true
stamp "done; everything is in $WORK"
