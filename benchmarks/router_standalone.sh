#!/usr/bin/env bash
# Router strategies side by side (issue #19), standalone: three `kubeinfer serve` engines on
# loopback ports, one `kubeinfer route` per strategy in front of the same three, and
# `kubeinfer bench serve` through each router in turn (ROUNDS rounds, strategy order rotating).
# Every run has its own --seed, so each starts with prefixes no engine has cached.
# Usage: benchmarks/router_standalone.sh [OUT_DIR]
#   env: ROUNDS, PREFIX_LEN, NUM_PROMPTS (shared-prefix), RANDOM_PROMPTS (default NUM_PROMPTS), CONCURRENCY,
#        KV_CACHE (each engine's --kv-cache-memory, default 512Mi)
# The issue's workload: PREFIX_LEN=1024 NUM_PROMPTS=128 CONCURRENCY=16 (8 tenants x 16 requests).
# Each engine gets one c=32 random burst first (the first large batch after start is slower).
set -euo pipefail
out="${1:-benchmarks/results/router-$(date -u +%Y%m%dT%H%M)}"
rounds="${ROUNDS:-1}" prefix_len="${PREFIX_LEN:-512}" prompts="${NUM_PROMPTS:-64}" conc="${CONCURRENCY:-16}"
random_prompts="${RANDOM_PROMPTS:-$prompts}" kv="${KV_CACHE:-512Mi}"
mkdir -p "$out"
pids=()
trap 'kill "${pids[@]}" 2>/dev/null || true; wait 2>/dev/null || true' EXIT
wait_ready() { for _ in $(seq 600); do curl -sf "$1/ready" >/dev/null && return 0; sleep 0.5; done; return 1; }
backends=()
for port in 18101 18102 18103; do
  OMP_NUM_THREADS=1 kubeinfer serve --port "$port" --max-num-seqs 16 --kv-cache-memory "$kv" \
    --max-model-len 2048 --log-level warning >"$out/engine-$port.log" 2>&1 & pids+=($!)
  backends+=(--backend "http://127.0.0.1:$port")
done
declare -A router=([prefix-aware]=18111 [least-load]=18112 [round-robin]=18113)
for port in 18101 18102 18103; do wait_ready "http://127.0.0.1:$port"; done
for port in 18101 18102 18103; do   # warm each engine: one c=32 burst of random prompts
  kubeinfer bench serve --base-url "http://127.0.0.1:$port" --dataset random --input-len 64 --output-len 16 \
    --num-prompts 32 --concurrency 32 --warmup 0 --seed "$port" --no-progress >/dev/null
  echo "engine $port: --kv-cache-memory $kv = $(curl -s "http://127.0.0.1:$port/metrics" |
    awk '/^kubeinfer:kv_cache_blocks_total/ {print $NF}') blocks" | tee -a "$out/console.txt"
done
for strategy in "${!router[@]}"; do
  kubeinfer route "${backends[@]}" --port "${router[$strategy]}" --strategy "$strategy" \
    --log-level warning >"$out/router-$strategy.log" 2>&1 & pids+=($!)
done
for strategy in "${!router[@]}"; do wait_ready "http://127.0.0.1:${router[$strategy]}"; done
hits() {   # prompt tokens the three engines found cached, and looked up, so far
  for port in 18101 18102 18103; do curl -s "http://127.0.0.1:$port/metrics"; done |
    awk '/^vllm:prefix_cache_hits_total/ {h += $NF} /^vllm:prefix_cache_queries_total/ {q += $NF} END {print h, q}'
}
order=(prefix-aware round-robin least-load)
seed=100
for round in $(seq "$rounds"); do
  for i in 0 1 2; do
    strategy="${order[$(( (i + round - 1) % 3 ))]}"
    for dataset in shared-prefix random; do
      seed=$((seed + 1))
      read -r h0 q0 < <(hits)
      n="$prompts"; [ "$dataset" = random ] && n="$random_prompts"
      echo "$strategy/$dataset/r$round: load average $(cut -d' ' -f1-3 /proc/loadavg) at $(date -u +%T)" | tee -a "$out/console.txt"
      kubeinfer bench serve --base-url "http://127.0.0.1:${router[$strategy]}" --dataset "$dataset" \
        --num-groups 8 --prefix-len "$prefix_len" --input-len 64 --output-len 16 --num-prompts "$n" \
        --concurrency "$conc" --warmup 0 --seed "$seed" --no-progress --label "$strategy/$dataset/r$round" \
        --json "$out/$strategy-$dataset-r$round.json" | tee -a "$out/console.txt"
      read -r h1 q1 < <(hits)
      echo "$strategy/$dataset/r$round: cached prompt tokens $((${h1%.*} - ${h0%.*})) of $((${q1%.*} - ${q0%.*})) looked up" |
        tee -a "$out/console.txt"
    done
  done
done
for strategy in "${!router[@]}"; do
  curl -s "http://127.0.0.1:${router[$strategy]}/metrics" | grep '^kubeinfer:router' >"$out/router-$strategy.metrics"
done
for port in 18101 18102 18103; do
  curl -s "http://127.0.0.1:$port/metrics" | grep -E '^vllm:(prefix_cache_(hits|queries)_total|request_success_total|num_preemptions_total)' \
    >"$out/engine-$port.metrics"
done
