#!/usr/bin/env bash
# What a lent CUDA machine runs, in one go, from a plain checkout (no install: the repo's folders
# are mapped into the `kubeinfer` namespace on PYTHONPATH; torch, triton, transformers and
# pytest(-xdist) must be there):
#   1. tests/gpu: every Triton kernel and the engine on CUDA against the references, bf16 too;
#   2. `kubeinfer bench-kernels` at Llama-3-8B shapes (bf16);
#   3. `kubeinfer bench throughput` on a random-weight Llama of Llama-3.2-1B's shape, bf16;
#   4. (tune) benchmarks/gpu_tune.py: the attention knobs swept, the engine's decode step profiled.
# Each step has its own time limit so the later ones still run. Results go to $1 (default $OUT).
#   bash benchmarks/gpu_check.sh /tmp/gpu-results
#   5. (graphs) engine throughput with decode CUDA graphs and with --enforce-eager, alternated.
#   STEPS="tests tune" TESTS_MATCHING="fp8 or engine" bash benchmarks/gpu_check.sh /tmp/gpu-results
# DRY_RUN=1 runs the same steps on the CPU, so a machine without a GPU checks the script itself
# (make test does, tests/test_gpu_check.py): a 2-layer random Llama in float32, 8 requests of 16
# tokens a run, tests/gpu collected rather than run, the CUDA-only steps (bench-kernels, tune)
# named as skipped.
#   DRY_RUN=1 STEPS="tests kernels throughput graphs" bash benchmarks/gpu_check.sh /tmp/dry
set -uo pipefail
out="${1:-${OUT:?give a results folder}}"
repo="$(cd "$(dirname "$0")/.." && pwd)"
mkdir -p "$out"
shim="$(mktemp -d)"
mkdir -p "$shim/kubeinfer"
for part in server kernels operator; do ln -s "$repo/$part" "$shim/kubeinfer/$part"; done
export PYTHONPATH="$shim${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 TRITON_CACHE_AUTOTUNING=1
cd "$repo"
say() { echo "== $(date -u +%T) $*" | tee -a "$out/summary.log"; }

dry="${DRY_RUN:-}"
device=$([[ -n $dry ]] && echo cpu || echo cuda)
dtype=$([[ -n $dry ]] && echo float32 || echo bfloat16)
skipped() { say "$1: skipped in a dry run (needs CUDA)"; }

say "machine"
{ if [[ -n $dry ]]; then echo "dry run on the CPU: no GPU"
  else nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv,noheader; fi
  python3 -c 'import torch, triton, transformers; print("torch", torch.__version__, "triton", triton.__version__,
"transformers", transformers.__version__, *((torch.cuda.get_device_name(), torch.cuda.get_device_capability())
                                           if torch.cuda.is_available() else ()))'
  nproc; } 2>&1 | tee -a "$out/summary.log"

steps="${STEPS:-tests kernels throughput}"
model="$(mktemp -d)/llama-1b-random"
[[ " $steps " =~ " "(throughput|tune|graphs)" " ]] && python3 benchmarks/random_llama.py "$model" ${dry:+--tiny}

if [[ " $steps " == *" tests "* ]]; then
  say "tests/gpu"
  # shellcheck disable=SC2086
  # shellcheck disable=SC2046
  timeout "${TEST_SECONDS:-300}" python3 -m pytest -q -p no:cacheprovider -rfE tests/gpu \
    $([[ -n $dry ]] && echo --collect-only || echo -n "${WORKERS:-8}") \
    ${TESTS_MATCHING:+-k "$TESTS_MATCHING"} > "$out/tests.log" 2>&1
  echo "rc=$?" >> "$out/tests.log"
  tail -n 40 "$out/tests.log" | tee -a "$out/summary.log"
fi

if [[ " $steps " == *" kernels "* && -n $dry ]]; then
  skipped "bench-kernels"
elif [[ " $steps " == *" kernels "* ]]; then
  say "bench-kernels"
  timeout "${KERNEL_SECONDS:-150}" python3 -m kubeinfer.server.cli bench-kernels 2>&1 | tee "$out/bench-kernels.txt"
fi

if [[ " $steps " == *" tune "* && -n $dry ]]; then
  skipped "tune"
elif [[ " $steps " == *" tune "* ]]; then
  say "tune"
  timeout "${TUNE_SECONDS:-240}" python3 benchmarks/gpu_tune.py --profile "$model" 2>&1 | tee "$out/tune.log"
fi

bench() {   # name, then flags for `kubeinfer bench throughput`
  local name="$1"; shift
  timeout 120 python3 -m kubeinfer.server.cli bench throughput --model "$model" --device "$device" --dtype "$dtype" \
    --json "$out/throughput-$name.json" "$@" ${dry:+--num-prompts 8 --output-len 16} > "$out/throughput-$name.txt" 2>&1
  echo "$name rc=$?: $(grep -E 'output_tokens_per_second|total_tokens_per_second|wall_seconds' "$out/throughput-$name.txt" | tr -s ' ' | tr '\n' ' ')" \
    | tee -a "$out/summary.log"
}

if [[ " $steps " == *" graphs "* ]]; then
  say "decode graphs against --enforce-eager (on $device)"
  bench warmup --num-prompts 16 --input-len 256 --output-len 16 --max-num-seqs 256
  for round in $(seq "${ROUNDS:-2}"); do
    for eager in true false; do
      flag=$([[ $eager == true ]] && echo --enforce-eager || echo --no-enforce-eager)
      bench "c32-eager-$eager-$round" --num-prompts 128 --input-len 128 --output-len 128 --max-num-seqs 32 "$flag"
      bench "c256-eager-$eager-$round" --num-prompts 512 --input-len 512 --output-len 128 --max-num-seqs 256 \
        --max-num-batched-tokens 8192 "$flag"
    done
  done
fi

[[ " $steps " == *" throughput "* ]] || { say "done"; exit 0; }
say "engine throughput"
bench warmup --num-prompts 16 --input-len 256 --output-len 16
bench random-c256 --num-prompts 512 --input-len 512 --output-len 128 --max-num-seqs 256 --max-num-batched-tokens 8192
bench random-c32 --num-prompts 128 --input-len 128 --output-len 128 --max-num-seqs 32
bench shared-prefix-c64 --dataset shared-prefix --prefix-len 1024 --num-prompts 256 --input-len 64 --output-len 64 \
  --max-num-seqs 64 --max-num-batched-tokens 8192
say "done"
