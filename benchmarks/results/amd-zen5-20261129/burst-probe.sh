#!/usr/bin/env bash
# kubeinfer W8A8 with every step and arrival logged (probe_serve.py), then 6 bursts of 32 (128 in / 64 out).
PY=~/.cache/kubeinfer/venv/bin/python; P=~/.cache/kubeinfer/peers; D=/work/main/benchmarks/results
$PY $D/burst-arrivals-20261129/probe_serve.py /tmp/s26/probe.log serve --model $P/smollm2-w8a8 --served-model-name smollm2 \
  --host 127.0.0.1 --port 8821 --kv-cache-memory 1GiB --max-num-seqs 64 --enable-prefix-caching --log-level warning > /tmp/s26/probe-server.log 2>&1 &
trap 'kill $(jobs -p) 2>/dev/null' EXIT
for _ in $(seq 300); do curl -sf http://127.0.0.1:8821/v1/models >/dev/null && break; sleep 1; done
for seed in 1 2 3 4 5 6 7 8; do
  echo "burst seed $seed: $($PY -m kubeinfer.server.cli bench serve --base-url http://127.0.0.1:8821 --num-prompts 32 --seed $seed --no-progress --dataset random --input-len 128 --output-len 64 --concurrency 32 | tail -1)"
done
