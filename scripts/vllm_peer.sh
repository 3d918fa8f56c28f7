#!/usr/bin/env bash
# vLLM (its CPU build) as a peer, measured side by side with autospec on the same prompts and
# pair (autospec's default pair, bf16, greedy), request by request:
#   plain     vLLM without speculation (the baseline of the next two)
#   exported  vLLM with the --speculative-config `autospec export --engine vllm` writes for a
#             store holding autospec's own traffic and probe (as scripts/engine_loop.sh builds)
#   default   vLLM with its documented setting for the same method (draft model: k=5, the
#             docs' draft_model example; n-gram: k=5, vLLM's prompt_lookup_min/max default 5)
#   schedule  one server whose --speculative-config has num_speculative_tokens_per_batch_size:
#             requests at concurrency 1, 4 and 12, vLLM's spec-decode counters read before and
#             after each phase (draft tokens per draft = the k it used)
#   autospec  `autospec bench --modes plain policy:auto` in transformers (in-process, 2
#             threads), plain interleaved with auto request by request: autospec's own baseline
#   table     tokens/s per mode and category, each mode's paired speedup over its own plain
#
# Usage: scripts/vllm_peer.sh WORKDIR [STEP...]   (default: every step, in the order above)
#   AUTOSPEC_PEER_DB      a store URL with autospec's traffic and probe for the prompts (default:
#                         built in WORKDIR by `engine_loop.py traffic`, about 5 minutes)
#   AUTOSPEC_PEER_CATEGORY  its category (default: loop, as engine_loop.sh writes)
#   AUTOSPEC_PEER_TOKENS  new tokens per request (default 48); AUTOSPEC_PEER_ROUNDS (default 1)
#   AUTOSPEC_PEER_SCHEDULE  the schedule server's --speculative-config (default: n-gram, k 4,
#                         [[1,1,3],[2,8,2],[9,256,0]])
# One vLLM server at a time, on 127.0.0.1, each killed (its process group) when its step ends
# or after AUTOSPEC_PEER_SERVE_S (default 900) s; a server takes 2.5–4.5 minutes to start here.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
WORK=${1:?usage: scripts/vllm_peer.sh WORKDIR [STEP...]}
shift
STEPS=${*:-plain exported default schedule autospec table}
mkdir -p "$WORK"
WORK=$(cd "$WORK" && pwd)
PY=$ROOT/.venv/bin/python
AS=$ROOT/.venv/bin/autospec
TOKENS=${AUTOSPEC_PEER_TOKENS:-48}
ROUNDS=${AUTOSPEC_PEER_ROUNDS:-1}
CATEGORY=${AUTOSPEC_PEER_CATEGORY:-loop}
START_LIMIT=${AUTOSPEC_PEER_START_S:-420}
SERVE_LIMIT=${AUTOSPEC_PEER_SERVE_S:-900}
SCHEDULE=${AUTOSPEC_PEER_SCHEDULE:-'{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 5, "prompt_lookup_min": 1, "num_speculative_tokens_per_batch_size": [[1, 1, 3], [2, 8, 2], [9, 256, 0]]}'}
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
[ -x "$PY" ] || bash scripts/bootstrap.sh
read -r TARGET DRAFT < <("$PY" -c '
from autospec.pairs import PAIRS, cache_dir
p = PAIRS["qwen2.5-coder"]
print(*(cache_dir() / "hf" / f"{m.name}-bfloat16" for m in (p.target, p.draft)))')
[ -d "$TARGET" ] && [ -d "$DRAFT" ] || {  # built into the cache where missing
  "$PY" -c 'from autospec.pairs import load_pair; load_pair("qwen2.5-coder", progress=False)'; }
t0=$SECONDS
stamp() { echo "[$((SECONDS - t0)) s] $*"; }
[ -f "$WORK/peer_prompts.json" ] || "$PY" scripts/engine_loop.py peer-prompts "$WORK" "$TARGET"

# shellcheck source=scripts/vllm_server.sh
source scripts/vllm_server.sh
vllm_env
trap stop_server EXIT
trap 'exit 130' INT TERM
serve_prompts() {  # LABEL [SPEC]: every prompt, one at a time, counters before and after
  start_server "$@"
  curl -sf "http://127.0.0.1:$PORT/metrics" >"$WORK/vllm-$1_before.txt"
  "$PY" scripts/engine_loop.py peer-send "$WORK" "$PORT" "$TARGET" "$TOKENS" "$ROUNDS" "vllm-$1"
  curl -sf "http://127.0.0.1:$PORT/metrics" >"$WORK/vllm-$1_after.txt"
  stop_server
}
exported_spec() {  # the export for the store's traffic (proposer auto), checked by vLLM
  if [ ! -f "$WORK/vllm-export.sh" ]; then
    local db=${AUTOSPEC_PEER_DB:-}
    if [ -z "$db" ]; then
      db="sqlite:///$WORK/loop.db"
      AUTOSPEC_LOOP_TARGET=$TARGET AUTOSPEC_LOOP_DRAFT=$DRAFT \
        "$PY" scripts/engine_loop.py traffic "$WORK" "$db" "$CATEGORY" 6 "$TOKENS" >&2
    fi
    "$AS" export --db "$db" --engine vllm --category "$CATEGORY" --out "$WORK/vllm-export.sh" \
      --check >&2
  fi
  "$PY" scripts/engine_loop.py spec "$WORK/vllm-export.sh"
}
default_spec() {  # vLLM's documented setting for the exported method
  "$PY" - "$1" "$DRAFT" <<'EOF'
import json, sys
spec, draft = json.loads(sys.argv[1]), sys.argv[2]
if spec["method"] == "ngram":  # vllm/config/speculative.py: lookup min = max = 5 where unset
    out = {"method": "ngram", "num_speculative_tokens": 5}
else:  # docs.vllm.ai features/speculative_decoding/draft_model: "speculating 5 tokens"
    out = {"model": draft, "method": "draft_model", "num_speculative_tokens": 5}
print(json.dumps(out))
EOF
}

for step in $STEPS; do
  case $step in
    plain) serve_prompts plain ;;
    exported)
      SPEC=$(exported_spec)
      [ -n "$SPEC" ] || { echo "the export serves without speculation" >&2; exit 1; }
      echo "$SPEC" >"$WORK/exported.spec"
      serve_prompts exported "$SPEC" ;;
    default)
      SPEC=$(default_spec "$(cat "$WORK/exported.spec" 2>/dev/null || exported_spec)")
      echo "$SPEC" >"$WORK/default.spec"
      serve_prompts default "$SPEC" ;;
    schedule)
      start_server schedule "$SCHEDULE"
      for c in 1 4 12; do
        "$PY" scripts/engine_loop.py conc-send "$WORK" "$PORT" "$TARGET" "$TOKENS" "$c" \
          "$(( c == 1 ? 3 : c ))" schedule
      done
      stop_server ;;
    autospec)
      stamp "autospec bench: plain and policy:auto, interleaved, 2 threads"
      "$AS" bench --target "$TARGET" --draft "$DRAFT" --dtype bf16 --threads 2 \
        --modes plain policy:auto --repeats "$ROUNDS" --max-new-tokens "$TOKENS" \
        --json "$WORK/bench.json" ;;
    table)
      "$PY" scripts/engine_loop.py peer-table "$WORK" \
        $([ -f "$WORK/bench.json" ] && echo "$WORK/bench.json") | tee "$WORK/table.md" ;;
    *) echo "unknown step $step" >&2; exit 2 ;;
  esac
done
stamp "done; everything is in $WORK"
