"""int8 against bf16 GEMM on this CPU, in GOPS: `torch._int_mm` (what W8A8-int8 and
`--quantization int8` run: oneDNN, AMX-INT8 / VNNI) and bf16 `torch.matmul` (AMX-BF16), the two
timed in alternation on the same shapes so a drifting host hits both alike.

    python benchmarks/int8_gemm.py [--threads N] [--rounds R]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

# (M tokens, K, N): SmolLM2-135M's decode and prefill MLP up-projection, a 7B-class projection
SHAPES = [(32, 576, 1536), (512, 576, 1536), (32, 4096, 4096), (512, 4096, 4096), (2048, 4096, 4096)]


def timed(fn, repeats: int) -> float:
    fn()
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    return (time.perf_counter() - start) / repeats


def threads_and_rounds(description: str) -> argparse.Namespace:
    """`--threads` (set for torch at once) and `--rounds`, the flags of this folder's int8 timers."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    return args


def main() -> None:
    args = threads_and_rounds(__doc__.splitlines()[0])
    print(f"threads {args.threads}; per shape: median of {args.rounds} alternated rounds")
    print(f"{'M':>5} {'K':>5} {'N':>5}  {'int8 GOPS':>10} {'bf16 GFLOPS':>12} {'int8/bf16':>9}")
    for m, k, n in SHAPES:
        a8 = torch.randint(-127, 128, (m, k), dtype=torch.int8)
        b8 = torch.randint(-127, 128, (k, n), dtype=torch.int8)
        a16, b16 = a8.to(torch.bfloat16), b8.to(torch.bfloat16)
        repeats = max(1, int(2e9 / (2 * m * k * n)))
        int8, bf16 = [], []
        for _ in range(args.rounds):
            int8.append(timed(lambda: torch._int_mm(a8, b8), repeats))
            bf16.append(timed(lambda: torch.matmul(a16, b16), repeats))
        ops = 2 * m * k * n
        i, b = statistics.median(int8), statistics.median(bf16)
        print(f"{m:>5} {k:>5} {n:>5}  {ops / i / 1e9:>10.0f} {ops / b / 1e9:>12.0f} {b / i:>9.2f}")


if __name__ == "__main__":
    main()
