#!/usr/bin/env bash
# kubeinfer served on glibc malloc and on tcmalloc (LD_PRELOAD), both up at once, alternated.
set -u
PY=~/.cache/kubeinfer/venv/bin/python; P=~/.cache/kubeinfer/peers; TC=/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4
MODEL=${MODEL:-$P/smollm2-w8a8}
serve() { "$PY" -m kubeinfer.server.cli serve --model "$MODEL" --served-model-name smollm2 --host 127.0.0.1 --port $1 \
  --kv-cache-memory 1GiB --max-num-seqs 64 --enable-prefix-caching --log-level warning > /tmp/tcab/$1.log 2>&1 & }
GLIBC_TUNABLES=glibc.malloc.check=0 serve 8811; LD_PRELOAD=$TC serve 8812
trap 'kill $(jobs -p) 2>/dev/null' EXIT
for port in 8811 8812; do for _ in $(seq 400); do curl -sf http://127.0.0.1:$port/v1/models >/dev/null && break; sleep 1; done; done
declare -A N=([8811]=glibc [8812]=tcmalloc)
bench() { "$PY" -m kubeinfer.server.cli bench serve --base-url http://127.0.0.1:$1 --num-prompts 32 --max-duration 60 --seed $2 --no-progress --dataset random --input-len 128 "$@" | tail -1; }
for port in 8811 8812; do echo "warm-up ${N[$port]}: $("$PY" -m kubeinfer.server.cli bench serve --base-url http://127.0.0.1:$port --num-prompts 32 --seed 1 --no-progress --dataset random --input-len 128 --output-len 16 --concurrency 32 | tail -1)"; done
for round in 1 2 3 4; do
  order="8811 8812"; (( round % 2 == 0 )) && order="8812 8811"
  for port in $order; do
    echo "round $round ${N[$port]} $(date -u +%T)"
    for c in 32 16; do echo "  random c=$c: $("$PY" -m kubeinfer.server.cli bench serve --base-url http://127.0.0.1:$port --num-prompts 32 --max-duration 60 --seed $((round*100)) --no-progress --dataset random --input-len 128 --output-len 128 --concurrency $c | tail -1)"; done
  done
done
