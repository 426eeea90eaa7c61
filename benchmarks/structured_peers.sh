#!/usr/bin/env bash
# Structured outputs against free decoding, kubeinfer and vLLM-CPU side by side (issue 21).
# Both servers up at once (the host's speed drifts, see BENCHMARKS.md), the same prompts and the
# same request body on both: random 64-token prompts, exactly 32 output tokens, either free
# (`ignore_eos`) or (max_tokens 32, no ignore_eos) under `structured_outputs: {"json": SCHEMA}`, vLLM's field, which kubeinfer
# also reads (vLLM 0.32 ignores the older `guided_json` without an error, so it is not used).
# SCHEMA is BENCHMARKS.md's issue-21 schema: an array of at least 100 {name, age, role} objects,
# which cannot complete in 32 tokens, so every step masks every constrained row on both engines.
# Each round: on one server then the other (odd rounds kubeinfer first), free / json / json / free
# at c=1 (4 requests) and at c=32 (32 requests), with the round's seed for both.
# Before round 1: one unmeasured c=32 burst per server, then the compile probes: the time of a
# 1-token request with a schema the server has not seen (first ever: includes the grammar
# backend's start), the same request again (cached), and a second new schema.
#
#   KUBEINFER_PYTHON=... benchmarks/structured_peers.sh [rounds]   # default 2; needs peers.sh install vllm
# Ports 18941 (kubeinfer, the embedded GGUF) and 18942 (vLLM, peers.sh's bf16 directory of it);
# both with KV_CACHE_GIB (default 1) of KV cache, THREADS (default nproc) threads.
set -euo pipefail
ROUNDS="${1:-2}"
PY="${KUBEINFER_PYTHON:-python}"
PEERS="${KUBEINFER_PEERS:-$HOME/.cache/kubeinfer/peers}"
KV_CACHE_GIB="${KV_CACHE_GIB:-1}"
THREADS="${THREADS:-$(nproc)}"
HOST=127.0.0.1
LOGS="${TMPDIR:-/tmp}"
SCHEMA='{"type": "array", "minItems": 100, "items": {"type": "object", "additionalProperties": false, "required": ["name", "age", "role"], "properties": {"name": {"type": "string", "maxLength": 12}, "age": {"type": "integer", "minimum": 0, "maximum": 120}, "role": {"enum": ["admin", "user", "guest"]}}}}'
cd "$(dirname "$0")/.."

"$PY" -m kubeinfer.server.cli serve --model embedded --served-model-name smollm2 --host $HOST --port 18941 \
  --kv-cache-memory "${KV_CACHE_GIB}GiB" --max-num-seqs 64 --log-level warning > "$LOGS/structured-kubeinfer.log" 2>&1 &
VLLM_CPU_OMP_THREADS_BIND="0-$((THREADS - 1))" VLLM_CPU_KVCACHE_SPACE=$KV_CACHE_GIB VLLM_HOST_IP=$HOST \
  "$PEERS/vllm-venv/bin/python" -m vllm.entrypoints.openai.api_server --model "$PEERS/smollm2-hf" \
  --served-model-name smollm2 --host $HOST --port 18942 --dtype bfloat16 --max-model-len 2048 --max-num-seqs 64 \
  > "$LOGS/structured-vllm.log" 2>&1 &
trap 'kill $(jobs -p) 2>/dev/null || true' EXIT
for port in 18941 18942; do
  for _ in $(seq 600); do curl -sf "http://$HOST:$port/v1/models" > /dev/null && break; sleep 1; done
done
declare -A NAME_OF=([18941]=kubeinfer [18942]=vllm)

bench() {  # port seed concurrency num-prompts [extra body]
  local port="$1" seed="$2" c="$3" n="$4"; shift 4
  "$PY" -m kubeinfer.server.cli bench serve --base-url "http://$HOST:$port" --dataset random --input-len 64 \
    --output-len 32 --num-prompts "$n" --concurrency "$c" --max-duration 240 --seed "$seed" --no-progress "$@" | tail -1
}
probe() {  # port schema -> seconds for one 1-token constrained completion, and its text
  local body
  body=$(printf '{"model": "smollm2", "prompt": "Users:", "max_tokens": 1, "temperature": 0, "structured_outputs": {"json": %s}}' "$2")
  curl -s -o "$LOGS/structured-probe.json" -w '%{time_total}' -H 'Content-Type: application/json' \
    -d "$body" "http://$HOST:$1/v1/completions"
  printf ' s, text %s' "$("$PY" -c 'import json,sys; print(repr(json.load(open(sys.argv[1]))["choices"][0]["text"]))' \
    "$LOGS/structured-probe.json")"
}
new_schema() {  # n: a schema of the same shape no server has compiled
  printf '{"type": "object", "additionalProperties": false, "required": ["id%s", "tags"], "properties": {"id%s": {"type": "integer", "minimum": 0}, "tags": {"type": "array", "items": {"enum": ["a%s", "b", "c"]}}}}' "$1" "$1" "$1"
}
JSON_BODY="{\"structured_outputs\": {\"json\": $SCHEMA}}"
# kubeinfer refuses ignore_eos with a grammar (400: the grammar decides where the output ends), so the
# json levels run without it: the schema cannot end within 32 tokens, and both engines stop at max_tokens.
JSON=(--no-ignore-eos --extra-body "$JSON_BODY")
stamp=$(date +%s)
for port in 18941 18942; do
  name=${NAME_OF[$port]}
  echo "warm-up $name: $(bench "$port" 1 32 32)"
  echo "compile probe $name, first structured request: $(probe "$port" "$(new_schema "${stamp}a$port")")"
  echo "compile probe $name, same schema again:        $(probe "$port" "$(new_schema "${stamp}a$port")")"
  echo "compile probe $name, a second new schema:      $(probe "$port" "$(new_schema "${stamp}b$port")")"
  echo "compile probe $name, the benchmark's schema:   $(probe "$port" "$SCHEMA")"
  echo "  json sample $name: $(curl -s -H 'Content-Type: application/json' -d "{\"model\": \"smollm2\", \"prompt\": \"Users:\", \"max_tokens\": 32, \"temperature\": 0, \"structured_outputs\": {\"json\": $SCHEMA}}" \
    "http://$HOST:$port/v1/completions" | "$PY" -c 'import json,sys; d=json.load(sys.stdin); print(repr(d["choices"][0]["text"]), d["usage"]["completion_tokens"], "tokens")')"
done
for round in $(seq "$ROUNDS"); do
  order="18941 18942"; (( round % 2 == 0 )) && order="18942 18941"
  for port in $order; do
    name=${NAME_OF[$port]}
    echo "round $round $name $(date -u +%T) load $(cut -d' ' -f1-3 /proc/loadavg)"
    for c in 1 32; do
      n=$(( c == 1 ? 4 : 32 )); seed=$((round * 100))
      echo "  c=$c free: $(bench "$port" "$seed" "$c" "$n")"
      echo "  c=$c json: $(bench "$port" "$seed" "$c" "$n" "${JSON[@]}")"
      echo "  c=$c json: $(bench "$port" "$seed" "$c" "$n" "${JSON[@]}")"
      echo "  c=$c free: $(bench "$port" "$seed" "$c" "$n")"
    done
  done
done
