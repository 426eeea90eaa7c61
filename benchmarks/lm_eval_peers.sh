#!/usr/bin/env bash
# lm-evaluation-harness (`local-completions`) against kubeinfer and vLLM-CPU on the same weights:
# the two local tasks of benchmarks/lm_eval_tasks.py, scores, per-sample agreement, wall time.
#
#   KUBEINFER_PYTHON=... benchmarks/lm_eval_peers.sh [kubeinfer] [vllm]
#
# Needs lm-eval[api] in $KUBEINFER_PYTHON's environment and, for vllm, `benchmarks/peers.sh
# install vllm` (its venv and the dequantized SmolLM2 both models load, $PEERS/smollm2-hf).
set -euo pipefail

REPO="$(cd "$(dirname "$0")/.." && pwd)"
PY="${KUBEINFER_PYTHON:-$HOME/.cache/kubeinfer/venv/bin/python}"
PEERS="${KUBEINFER_PEERS:-$HOME/.cache/kubeinfer/peers}"
RESULTS="${RESULTS:-$REPO/benchmarks/results/lm-eval-$(date -u +%Y%m%d)}"
MODEL="${MODEL:-$PEERS/smollm2-hf}"
DTYPE="${DTYPE:-float32}"
DOCS="${DOCS:-100}"
CONCURRENCY="${CONCURRENCY:-4}"
THREADS="${THREADS:-$(nproc)}"
PORT="${PORT:-8766}"
TASKS=kubeinfer_arith_choice,kubeinfer_arith_answer
export HF_DATASETS_OFFLINE=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1

mkdir -p "$RESULTS"
"$PY" "$REPO/benchmarks/lm_eval_tasks.py" "$RESULTS/tasks" --docs "$DOCS"

wait_ready() {  # pid
  for _ in $(seq 1 600); do
    kill -0 "$1" 2>/dev/null || { echo "server exited" >&2; return 1; }
    curl -sf "http://127.0.0.1:$PORT/v1/models" >/dev/null && return 0
    sleep 1
  done
  return 1
}

evaluate() {  # name, then the server command
  local name="$1"; shift
  echo "== $name: $*"
  "$@" > "$RESULTS/$name-server.log" 2>&1 &
  local pid=$!
  wait_ready "$pid"
  local start=$EPOCHREALTIME
  "$PY" -m lm_eval --model local-completions --tasks "$TASKS" --include_path "$RESULTS/tasks" \
    --model_args "base_url=http://127.0.0.1:$PORT/v1/completions,model=smollm2,num_concurrent=$CONCURRENCY,max_retries=3,tokenized_requests=True,tokenizer_backend=huggingface,tokenizer=$MODEL" \
    --output_path "$RESULTS/$name" --log_samples 2>&1 | tee "$RESULTS/$name-lm-eval.log" | grep -v "it/s\]" || true
  awk -v a="$start" -v b="$EPOCHREALTIME" -v n="$name" 'BEGIN { printf "%s: lm_eval wall time %.1f s\n", n, b - a }' \
    | tee "$RESULTS/$name-wall.txt"
  kill -TERM "$pid"; wait "$pid" || true
}

engines=("$@")
[[ ${#engines[@]} -gt 0 ]] || engines=(kubeinfer vllm)
for engine in "${engines[@]}"; do
  case "$engine" in
    kubeinfer) OMP_NUM_THREADS="$THREADS" evaluate kubeinfer "$PY" -m kubeinfer.server.cli serve --model "$MODEL" --dtype "$DTYPE" \
                 --served-model-name smollm2 --host 127.0.0.1 --port "$PORT" --kv-cache-memory 1GiB \
                 --enable-prefix-caching --log-level warning ;;
    vllm) VLLM_CPU_OMP_THREADS_BIND="0-$((THREADS - 1))" VLLM_CPU_KVCACHE_SPACE=1 VLLM_HOST_IP=127.0.0.1 \
          evaluate vllm "$PEERS/vllm-venv/bin/python" -m vllm.entrypoints.openai.api_server --model "$MODEL" \
            --served-model-name smollm2 --host 127.0.0.1 --port "$PORT" --dtype "$DTYPE" \
            --enable-prefix-caching --max-model-len 2048 --max-num-seqs 64 ;;
    *) echo "unknown engine $engine" >&2; exit 2 ;;
  esac
done
if [[ -d "$RESULTS/kubeinfer" && -d "$RESULTS/vllm" ]]; then
  "$PY" "$REPO/benchmarks/lm_eval_compare.py" "$RESULTS/kubeinfer" "$RESULTS/vllm" | tee "$RESULTS/compare.txt"
fi
