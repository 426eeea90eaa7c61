#!/usr/bin/env bash
# --kv-cache-dtype fp8 against auto (bf16) on the embedded model, both servers up at once and
# benchmarked in alternation (ABBA...), with a KV-cache budget that bf16 cannot fit 32 sequences
# of 128 + 128 tokens into (KV_MEMORY, default 96MiB: 273 bf16 blocks = 17 such sequences, 546 fp8
# blocks = 34). Per run: random 128/128 at c=32, output tok/s, the most requests running at once
# (vllm:num_requests_running polled every 0.2 s) and the preemptions it caused.
#
#   benchmarks/kv_cache_dtype.sh [rounds]    # default 2 (A B B A); a minute or two a run
set -euo pipefail
ROUNDS="${1:-2}"
PY="${KUBEINFER_PYTHON:-python}"
KV_MEMORY="${KV_MEMORY:-96MiB}"
HOST=127.0.0.1
LOGS="${TMPDIR:-/tmp}"

for spec in "8811 auto" "8812 fp8"; do
  set -- $spec
  "$PY" -m kubeinfer.server.cli serve --model embedded --host $HOST --port "$1" --kv-cache-memory "$KV_MEMORY" \
    --kv-cache-dtype "$2" --max-num-seqs 64 --log-level warning > "$LOGS/kv-cache-dtype-$2.log" 2>&1 &
done
trap 'kill $(jobs -p) 2>/dev/null || true' EXIT
for port in 8811 8812; do
  for _ in $(seq 400); do curl -sf "http://$HOST:$port/v1/models" > /dev/null && break; sleep 1; done
done

metric() {  # port name: the metric's value (awk reads to the end: an early exit would fail curl's pipe)
  curl -sf "http://$HOST:$1/metrics" | awk -v name="$2" '$1 ~ "^"name"[{ ]" || $1 == name {value = $2} END {print value}'
}
run() {  # port seed
  local port="$1" seed="$2" most=0 before after
  before=$(metric "$port" vllm:num_preemptions_total)
  ( set +e; while :; do metric "$port" vllm:num_requests_running; sleep 0.2; done ) > "$LOGS/kv-running-$port" 2>/dev/null &
  local poller=$!
  local result
  result=$("$PY" -m kubeinfer.server.cli bench serve --base-url "http://$HOST:$port" --num-prompts 32 \
    --max-duration 120 --seed "$seed" --no-progress --dataset random --input-len 128 --output-len 128 \
    --concurrency 32 | tail -1)
  kill "$poller" 2>/dev/null || true
  most=$(sort -g "$LOGS/kv-running-$port" | tail -1)
  after=$(metric "$port" vllm:num_preemptions_total)
  echo "  $result | blocks $(metric "$port" kubeinfer:kv_cache_blocks_total) most running ${most%.*} preemptions $(( ${after%.*} - ${before%.*} ))"
}
echo "load before: $(cut -d' ' -f1-3 /proc/loadavg)"
for round in $(seq "$ROUNDS"); do
  order="8811 8812"; (( round % 2 == 0 )) && order="8812 8811"
  for port in $order; do
    echo "round $round $([[ $port == 8811 ]] && echo auto || echo fp8) $(date -u +%T) load $(cut -d' ' -f1 /proc/loadavg)"
    run "$port" $((round * 100))
  done
done
echo "load after: $(cut -d' ' -f1-3 /proc/loadavg)"
