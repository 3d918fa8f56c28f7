#!/usr/bin/env bash
# The fleet loop, closed on this machine with a real vLLM (its CPU build), on a labelled traffic
# mix:
#   1. autospec serves a packaged prompt set's categories, each request labelled with its
#      category, and probes the pair's costs (a store);
#   2. `autospec export --engine vllm` writes vLLM's settings per category, each distinct
#      setting validated by vLLM's own code (--check);
#   3. vLLM serves the pair with exactly an exported --speculative-config: one server per
#      distinct setting (on 127.0.0.1, bounded in time, killed on exit), serving every category
#      that exported it;
#   4. each category's prompts go to vLLM in turn, /metrics scraped before and after each
#      category, and `autospec ingest --baseline` records each category's difference in that
#      category and pair; the script checks that what was ingested equals the scrapes'
#      difference (read by its own pattern) and fails where it does not;
#   5. `autospec stats` / `report` show both sources per category (the report's acceptance by
#      source: autospec's own requests beside vLLM's counters, per draft position); every
#      category is exported again.
#
# Usage: scripts/engine_loop.sh [WORKDIR]
#   The pair: autospec's default pair (Qwen2.5-Coder 0.5B drafting for 1.5B, bf16, from the
#   cache; built there first where missing). AUTOSPEC_LOOP_TARGET / AUTOSPEC_LOOP_DRAFT: other
#   local model directories. AUTOSPEC_LOOP_PAIR=small: a small random-weight Llama pair
#   written to WORKDIR (autospec.testing.small_pair; the prompts' words mapped into its
#   vocabulary), which loads in seconds but whose draft costs as much as its target on a CPU,
#   so its export says speculation does not pay: AUTOSPEC_LOOP_K defaults to 3 for it.
#   AUTOSPEC_LOOP_SET          the packaged prompt set (default: default; or a JSONL file)
#   AUTOSPEC_LOOP_CATEGORIES   comma-separated categories of the set (default: all of them)
#   AUTOSPEC_LOOP_PER_CATEGORY prompts per category (default 2)
#   AUTOSPEC_LOOP_TOKENS       new tokens per request (default 48), greedy
#   AUTOSPEC_LOOP_PROPOSER     export --proposer (default draft)
#   AUTOSPEC_LOOP_K            export --k: this k instead of the measured choice (default:
#                              the measured choice; 3 for the small pair)
#   AUTOSPEC_LOOP_START_S / AUTOSPEC_LOOP_SERVE_S   a server's start and life limits
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
SET=${AUTOSPEC_LOOP_SET:-default}
CATEGORIES=${AUTOSPEC_LOOP_CATEGORIES:-all}
PER=${AUTOSPEC_LOOP_PER_CATEGORY:-2}
TOKENS=${AUTOSPEC_LOOP_TOKENS:-48}
PROPOSER=${AUTOSPEC_LOOP_PROPOSER:-draft}
K=${AUTOSPEC_LOOP_K:-}
[ -n "$K" ] || [ "${AUTOSPEC_LOOP_PAIR:-}" != small ] || K=3
START_LIMIT=${AUTOSPEC_LOOP_START_S:-420}    # a server must answer /health within this
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

# -- 1. autospec's own traffic, labelled per category, and a probe -----------------------------
stamp "1. autospec serves the labelled mix (prompt set '$SET', $PER per category) and probes the pair (store $DB)"
"$PY" scripts/engine_loop.py mix "$WORK" "$DB" "$SET" "$CATEGORIES" "$PER" "$TOKENS"
read -r TARGET < <("$PY" -c 'import json,sys; print(json.load(open(sys.argv[1]))["target"])' "$WORK/loop.json")
read -r -a CATS < <("$PY" -c 'import json,sys; print(" ".join(json.load(open(sys.argv[1]))["categories"]))' "$WORK/loop.json")
# vLLM serves the same model on this machine: the export's hardware and model are the store's
IFS=$'\t' read -r _ _ _ HARDWARE < <("$PY" scripts/engine_loop.py pair "$DB" "${CATS[0]}")
EXPORT=(--db "$DB" --engine vllm --proposer "$PROPOSER" --engine-model "$TARGET"
        --engine-hardware "$HARDWARE")
[ -z "$K" ] || EXPORT+=(--k "$K")

# -- 2. export per category; each distinct setting checked by vLLM's own code -------------------
stamp "2. export for vLLM per category (--proposer $PROPOSER${K:+ --k $K}), validated by vLLM"
export_all() {  # $1: file suffix
  for c in "${CATS[@]}"; do
    "$AS" export "${EXPORT[@]}" --category "$c" --out "$WORK/vllm-$c$1.sh"
  done
}
export_all ""
for c in "${CATS[@]}"; do
  echo "category $c: $(grep -v '^#' "$WORK/vllm-$c.sh")"
done
mapfile -t SETTINGS < <("$PY" scripts/engine_loop.py groups "$WORK" "${CATS[@]}")
if [ "${#SETTINGS[@]}" = 0 ]; then
  echo "every category's export serves without speculation: nothing to close the loop with" \
       "(AUTOSPEC_LOOP_K exports a k of your choice)" >&2
  exit 1
fi
for g in "${SETTINGS[@]}"; do  # vLLM's verdict, once per distinct setting
  first=${g#*$'\t'}; first=${first%% *}
  "$AS" export "${EXPORT[@]}" --category "$first" --out "$WORK/vllm-$first.sh" --check
done
stamp "${#SETTINGS[@]} distinct setting(s): one vLLM server each"

# -- 3./4. one server per setting; each category's prompts, scraped around ----------------------
SERVED=()
i=0
for g in "${SETTINGS[@]}"; do
  i=$((i + 1))
  SPEC=${g%%$'\t'*}
  read -r -a GCATS <<<"${g#*$'\t'}"
  stamp "3. vLLM serves $TARGET with exactly the exported --speculative-config for: ${GCATS[*]}"
  grep -v '^#' "$WORK/vllm-${GCATS[0]}.sh"
  start_server "vllm-$i" "$SPEC"
  stamp "   vLLM's command: $(cat "$WORK/vllm-$i.cmd")"
  for c in "${GCATS[@]}"; do
    "$PY" scripts/engine_loop.py scrape "$PORT" "$WORK/before-$c.txt"
    "$PY" scripts/engine_loop.py send-category "$WORK" "$PORT" "$TARGET" "$TOKENS" "$c"
    "$PY" scripts/engine_loop.py scrape "$PORT" "$WORK/after-$c.txt"
    SERVED+=("$c")
  done
  stop_server
done

stamp "4. ingest each category's counters (after − before) into that category, and check them"
for c in "${SERVED[@]}"; do
  IFS=$'\t' read -r PTARGET PDRAFT PDTYPE PHW < <("$PY" scripts/engine_loop.py pair "$DB" "$c")
  "$AS" ingest --db "$DB" --prometheus "$WORK/after-$c.txt" --baseline "$WORK/before-$c.txt" \
    --category "$c" --engine vllm --target "$PTARGET" --draft "$PDRAFT" \
    --dtype "$PDTYPE" --hardware "$PHW"
  "$PY" scripts/engine_loop.py verify "$DB" "$c" "$WORK/before-$c.txt" "$WORK/after-$c.txt"
done

# -- 5. both sources in the store; every category exported again --------------------------------
stamp "5. stats, report (acceptance by source per category), export again"
"$AS" stats --db "$DB"
"$AS" report --db "$DB" --out "$WORK/report" >/dev/null
sed -n '/^#  category/,/^$/p' "$WORK/report/report.txt"
awk '/^workload [0-9]+:/ {print; next}
     /^verdict:/ {print; next}
     /^1\. acceptance/ {p = 1}
     /^alpha over time|^2\. verification/ {p = 0}
     p' "$WORK/report/report.txt"
export_all "-again"
for c in "${CATS[@]}"; do  # with vLLM's counters in the category now
  grep -E '^# (k from|  B=)' "$WORK/vllm-$c-again.sh" | sed "s/^# */category $c: /"
  if diff <(grep -v '^#' "$WORK/vllm-$c.sh") <(grep -v '^#' "$WORK/vllm-$c-again.sh") >/dev/null; then
    echo "category $c: the settings did not change"
  else
    echo "category $c: now $(grep -v '^#' "$WORK/vllm-$c-again.sh")"
  fi
done
stamp "done; everything is in $WORK (the report: $WORK/report/)"
